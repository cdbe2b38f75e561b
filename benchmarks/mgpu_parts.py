"""Time the Mosaic GPU ring-step kernels one by one (forward, dQ, dK/dV), without the ring around them.

    python benchmarks/mgpu_parts.py --seqs 8192,32768 [--configs '{"pair_heads": false}']

bf16, batch 1, 32 query / 8 KV heads, head_dim 128, one step on one GPU. TFLOP/s here counts the
matmuls each kernel executes: forward 2, dQ 3, dK/dV 4 per block pair (4*B*H*T*T*D per 2 matmuls,
half when causal), so it compares a kernel with the matmul ceiling rather than with other kernels.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ringjax.masks import TokenInfo
from ringjax.options import AttentionOptions
from ringjax.pallas.mosaic_gpu import MosaicGpuConfig, kernels

from common import timeit  # benchmarks/ is on sys.path when a script runs

B, H, KVH, D = 1, 32, 8, 128


def _parts(cfg, opts, info, lse2, delta):
    """{kernel: (matmuls per block pair, fn(q, k, v, do))} of one step."""
    return {
        "forward": (2, lambda q, k, v, do: kernels.block_fwd(q, k, v, info, info, opts, cfg)),
        "dq": (3, lambda q, k, v, do: kernels._launch_dq(q, k, v, do, lse2, delta, info, info, [], opts, cfg)),
        "dkv": (4, lambda q, k, v, do: kernels._launch_dkv(q, k, v, do, lse2, delta, info, info, [], opts, cfg)),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="8192,32768")
    p.add_argument("--configs", default="", help="extra MosaicGpuConfig JSONs, ';'-separated")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    configs = [MosaicGpuConfig()] + [MosaicGpuConfig.from_json(c) for c in filter(None, args.configs.split(";"))]
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for t in (int(x) for x in args.seqs.split(",")):
        ks = jax.random.split(jax.random.key(0), 5)
        q, do = (jax.random.normal(k, (B, t, H, D), jnp.bfloat16) for k in ks[:2])
        k, v = (jax.random.normal(k, (B, t, KVH, D), jnp.bfloat16) for k in ks[2:4])
        lse2 = jax.random.normal(ks[4], (B, H, t), jnp.float32) + 10.0
        delta = jnp.zeros((B, H, t), jnp.float32)
        info = TokenInfo(jnp.arange(t, dtype=jnp.int32), None)
        for causal in (True, False):
            opts = AttentionOptions(causal=causal, softmax_scale=D ** -0.5)
            unit = 4.0 * B * H * t * t * D / 2 / (2 if causal else 1)  # FLOPs of one matmul over all pairs
            for cfg in configs:
                parts = _parts(cfg, opts, info, lse2, delta)
                for name, (mm, fn) in parts.items():
                    ms = timeit(jax.jit(fn), q, k, v, do, reps=args.reps) * 1e3
                    print(f"parts T={t} causal={causal} kernel={name} ms={ms:.3f} "
                          f"executed_tflops={mm * unit / ms / 1e9:.1f} config={cfg.to_json()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

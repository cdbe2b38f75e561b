"""One-shot GPU check of the Mosaic GPU fused backward (issue 25): is it right, and is it faster?

    python3 benchmarks/bwd_fused_check.py --out bwd.jsonl

Per case (batch 1, 32 query / 8 KV heads, bf16; T, causal, head_dim from --cases), in one process: the
forward and forward+backward of `ring_attention` on one GPU with the split backward (`MosaicGpuConfig()`,
its dQ and dK/dV kernels) and with the fused one (`bwd_fused=True`, --stages dK/dV stages), and cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`) beside them; the fused gradients against the
split ones (relative Frobenius error per dq, dk, dv). Rates as the `step` suite counts them
(benchmarks/common.py). Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import other_attention  # noqa: E402

import ringjax  # noqa: E402
from ringjax.backends.pallas_mosaic_gpu.config import MosaicGpuConfig  # noqa: E402
from ringjax.backends.pallas_mosaic_gpu.implementation import device_refusal  # noqa: E402

from common import Shape, attention_fns, errors, measure, random_inputs  # noqa: E402


def case(text: str) -> tuple[int, bool, int]:
    """"8192:causal:128" -> (8192, True, 128)."""
    t, mask, d = text.split(":")
    return int(t), mask == "causal", int(d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=case, nargs="+",
                   default=[case(c) for c in ("8192:causal:128", "32768:full:128", "8192:causal:64")],
                   help="T:causal|full:head_dim (default 8192:causal:128 32768:full:128 8192:causal:64)")
    p.add_argument("--stages", type=int, default=2, help="dK/dV pipeline stages of the fused kernel (default 2)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("bwd_fused_check.jsonl"))
    args = p.parse_args(argv)
    device = jax.devices()[0]
    why = device_refusal(device)
    if why:
        print(f"bwd_fused_check needs a Hopper GPU: {why}", file=sys.stderr)
        return 2
    stamp = {"device_kind": device.device_kind, "jax": jax.__version__,
             "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat()}
    with args.out.open("a") as f:
        for t, causal, d in args.cases:
            shape = Shape(batch=1, heads=32, kv_heads=8, head_dim=d, dtype="bfloat16")
            q, k, v, do = random_inputs(shape, t)
            flops = shape.flops(t, causal)
            # head_dim 64 takes the default config's deeper pipelines, as `default_config` does
            base = MosaicGpuConfig(**(dict(block_kv=128, num_stages=3, dq_block_kv=128) if d == 64 else {}))
            grads = {}
            for variant, config in (("split", base),
                                    ("fused", dataclasses.replace(base, bwd_fused=True, dkv_num_stages=args.stages))):
                def attn(q, k, v, config=config):
                    return ringjax.ring_attention(q, k, v, axis_name=None, causal=causal,
                                                  implementation="pallas_mosaic_gpu", config=config)

                row = {"T": t, "causal": causal, "head_dim": d, "variant": variant, "config": config.to_json()}
                try:
                    timing, _ = measure(attn, q, k, v, do, flops, reps=args.reps, warmup=2, budget_s=5)
                    grads[variant] = jax.block_until_ready(attention_fns(attn)[1](q, k, v, do))
                    row.update(timing)
                except Exception as e:  # noqa: BLE001 - recorded, the other variants go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                if variant == "fused" and len(grads) == 2:
                    row["vs_split"] = {name: errors(a, b)["rel_err"]
                                       for name, a, b in zip(("dq", "dk", "dv"), grads["fused"], grads["split"])}
                f.write(json.dumps({**row, **stamp}) + "\n")
                print(json.dumps(row), flush=True)
            timing, _ = measure(other_attention("cudnn", causal), q, k, v, do, flops, reps=args.reps, warmup=2,
                                budget_s=5)
            row = {"T": t, "causal": causal, "head_dim": d, "variant": "cudnn", **timing}
            f.write(json.dumps({**row, **stamp}) + "\n")
            print(json.dumps(row), flush=True)
            del q, k, v, do, grads
    return 0


if __name__ == "__main__":
    sys.exit(main())

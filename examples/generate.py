"""Greedy generation from a small transformer with a KV cache sharded over the devices.

A decoder-only model (Equinox attention layers in decode mode, one `ringjax.KVCache` per layer,
striped over the "sp" axis) takes a batch of prompts in one prefill call, then decodes greedily one
token per step with a jitted step that updates the caches in place (donated). The weights are random:
the point is the plumbing, checked by comparing the cached logits with one call on the whole sequence.

On CPU it simulates 8 devices; on GPUs it uses the real ones.

    python examples/generate.py --prompt-len 64 --steps 32
    python examples/generate.py --batch 8 --prompt-len 4096 --steps 64 --d-model 1024 --heads 16 --dtype bfloat16

Needs: pip install -e ".[examples]"  (equinox)
"""

from __future__ import annotations

import argparse
import os
import time

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # simulated devices for CPU runs; ignored by GPU backends
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _model import Transformer  # examples/_model.py: examples/ is on sys.path when its scripts run

import ringjax


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="tokens generated per row")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--sp", type=int, default=None, help="devices on the cache's axis (default: all)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    n = args.sp or len(jax.devices())
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    dtype = jnp.dtype(args.dtype)
    # axis_name=None: the whole-sequence call runs on one device; with a cache, the cache's axis is used
    model = Transformer(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads, key=jax.random.key(args.seed),
                        axis_name=None)
    model = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
    params, static = eqx.partition(model, eqx.is_array)
    capacity = -(-(args.prompt_len + args.steps) // n) * n
    head_dim = args.d_model // args.heads
    caches = [ringjax.KVCache.create(args.batch, capacity, args.kv_heads, head_dim, dtype=dtype, mesh=mesh)
              for _ in range(args.layers)]
    prompt = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.prompt_len), 0, args.vocab)

    def prefill(params, tokens, caches):
        logits, caches = eqx.combine(params, static)(tokens, caches)
        return logits[:, -1], caches

    def step(params, token, caches):
        logits, caches = eqx.combine(params, static)(token[:, None], caches)
        return logits[:, 0], caches

    # the caches are donated: XLA writes the new tokens in place
    prefill = jax.jit(prefill, donate_argnums=2)
    step = jax.jit(step, donate_argnums=2)

    start = time.perf_counter()
    last, caches = prefill(params, prompt, caches)
    last.block_until_ready()
    prefill_s = time.perf_counter() - start
    tokens, logits = [], []
    token = jnp.argmax(last, axis=-1)
    decode_start = None
    for i in range(args.steps):
        tokens.append(token)
        logits.append(last)
        if i == 1:  # step 0 compiled the step: time the rest
            jax.block_until_ready(token)
            decode_start = time.perf_counter()
        last, caches = step(params, token, caches)
        token = jnp.argmax(last, axis=-1)
    jax.block_until_ready(token)
    timed = args.steps - 1 if decode_start is not None else 0
    decode_s = time.perf_counter() - decode_start if decode_start is not None else float("nan")
    tokens_per_s = args.batch * timed / decode_s if timed else float("nan")
    generated = np.stack([np.asarray(t) for t in tokens], axis=1)

    # check: one call on the whole sequence (no cache) gives the same logits at every generated position
    sequence = jnp.concatenate([prompt, jnp.asarray(generated)], axis=1)
    full, _ = jax.jit(lambda p, s: eqx.combine(p, static)(s))(params, sequence)
    want = np.asarray(full[:, args.prompt_len - 1:-1], np.float32)
    got = np.stack([np.asarray(x, np.float32) for x in logits], axis=1)
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    print(f"{n} devices ({jax.devices()[0].device_kind}), {args.layers} layers, batch {args.batch}, "
          f"prompt {args.prompt_len}, cache {capacity} per row ({capacity // n} slots per device)")
    print(f"prefill {prefill_s * 1e3:.1f} ms (with compilation); decode {tokens_per_s:.1f} tokens/s; "
          f"logits vs one whole-sequence call: max relative error {err:.2e}")
    print("generated:", generated[0].tolist())
    return {"tokens": generated, "tokens_per_s": tokens_per_s, "max_rel_err": err, "devices": n,
            "lengths": np.asarray(caches[0].lengths)}


if __name__ == "__main__":
    main()

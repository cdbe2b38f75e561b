"""Ring attention on every local device, checked against dense attention.

    python -m ringjax.demo [--seq 4096] [--layout zigzag] [--no-causal] ...

Without accelerators it simulates 8 CPU devices; on GPUs it uses the real ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _simulate_cpu_devices(count: int) -> None:
    # must happen before jax initialises its backends; it only affects the CPU platform
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=None, help="global sequence length (default: 4096 CPU, 65536 GPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "striped"])
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--window", type=int, default=None, help="sliding window (left extent)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 CPU, bfloat16 GPU)")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate without accelerators")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    _simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ringjax

    devices = jax.devices()
    n = len(devices)
    on_cpu = jax.default_backend() == "cpu"
    seq = args.seq or (4096 if on_cpu else 65536)
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    print(f"ringjax {ringjax.__version__} on {n} x {devices[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}")
    print(f"seq {seq} ({seq // n} per device), batch {args.batch}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, {dtype.name}, layout {args.layout}, causal {args.causal}, window {args.window}")

    mesh = jax.make_mesh((n,), ("sp",), devices=devices)
    rng = np.random.default_rng(0)
    shape_q = (args.batch, seq, args.heads, args.head_dim)
    shape_kv = (args.batch, seq, args.kv_heads, args.head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in (shape_q, shape_kv, shape_kv))

    spec = NamedSharding(mesh, P(None, "sp"))
    ql, kl, vl = (jax.device_put(ringjax.to_layout(x, args.layout, n), spec) for x in (q, k, v))
    kwargs = dict(causal=args.causal, sliding_window=args.window, layout=args.layout)
    with jax.set_mesh(mesh):
        ring = jax.jit(lambda q, k, v: ringjax.ring_attention(q, k, v, **kwargs))
        compiled = ring.lower(ql, kl, vl).compile()
        out = jax.block_until_ready(compiled(ql, kl, vl))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(ql, kl, vl))
            times.append(time.perf_counter() - start)
    out = np.asarray(ringjax.from_layout(np.asarray(out.astype(jnp.float32)), args.layout, n))

    # dense reference on one device, in float32, over query chunks to bound its memory
    g = args.heads // args.kv_heads
    k32, v32 = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
    pos = np.arange(seq)
    max_err = 0.0
    ref_norm = 0.0
    for start in range(0, seq, 1024):
        rows = slice(start, min(seq, start + 1024))
        s = jnp.einsum("bqhd,bkhd->bhqk", q[:, rows].astype(jnp.float32), k32,
                       precision="highest") / np.sqrt(args.head_dim)
        mask = np.ones((rows.stop - rows.start, seq), bool)
        if args.causal:
            mask &= pos[None, :] <= pos[rows, None]
        if args.window is not None:
            mask &= pos[None, :] >= pos[rows, None] - args.window
            if not args.causal:
                mask &= pos[None, :] <= pos[rows, None] + args.window
        ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1), v32,
                         precision="highest")
        max_err = max(max_err, float(jnp.abs(ref - out[:, rows]).max()))
        ref_norm = max(ref_norm, float(jnp.abs(ref).max()))

    mem = compiled.memory_analysis()
    per_device = None
    if mem is not None:
        per_device = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    stats = devices[0].memory_stats() if not on_cpu else None
    median = statistics.median(times)
    # count only the (query, key) pairs the mask keeps: a window does far less work than causal
    rows = np.arange(seq)
    left = seq if args.window is None else args.window
    right = 0 if args.causal else (seq if args.window is None else args.window)
    pairs = float((np.minimum(seq - 1, rows + right) - np.maximum(0, rows - left) + 1).sum())
    flops = 4 * args.batch * args.heads * pairs * args.head_dim
    print(f"max |ring - dense| = {max_err:.2e} (max |dense| = {ref_norm:.2f})")
    rate = flops / median / n
    rate_text = f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.2f} GFLOP/s"
    print(f"forward time: {median * 1e3:.2f} ms median of {args.repeats} ({rate_text} per device)")
    if per_device is not None:
        print(f"compiled memory per device: {_bytes(per_device)} (temp {_bytes(mem.temp_size_in_bytes)}); "
              f"a dense score matrix would need {_bytes(4.0 * args.batch * args.heads * seq * seq)}")
    if stats and "peak_bytes_in_use" in stats:
        print(f"peak device memory: {_bytes(stats['peak_bytes_in_use'])}")
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    print("OK" if max_err <= tol * max(1.0, ref_norm) else "MISMATCH")
    if max_err > tol * max(1.0, ref_norm):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""How long a sequence fits: ring attention over N devices against dense attention on one.

For each method the sequence length doubles from --start until it runs out of
memory or reaches --max-seq. Memory is the peak per-device footprint of one
forward + backward pass as XLA plans it (arguments + outputs + temporaries -
aliased, from `compiled.memory_analysis()`); where the device reports a memory
limit, plans above it count as out of memory, and with --execute each plan is
also run once so the allocator has the last word.

- ring:  `ringjax.ring_attention`, sequence sharded over all devices (zigzag layout).
- dense: standard attention on one device, materialising the [seq, seq] scores.
- local: `ringjax.ring_attention(axis_name=None)`, blockwise on one device (--methods).

Writes <out-dir>/long_context.{png,md,csv}. On CPU it simulates 8 devices and
stops at a small cap so it finishes in well under a minute.

    python examples/long_context.py                       # CPU: up to 4096 tokens
    python examples/long_context.py --max-seq 1048576     # GPUs: until OOM

Needs: pip install ringjax matplotlib
"""

from __future__ import annotations

import argparse
import csv
import os
import time

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # simulated devices for CPU runs; ignored by GPU backends
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax

METHODS = ("ring", "dense", "local")


def dense_attention(q, k, v, causal):
    """Textbook attention: the whole [heads, seq, seq] score matrix lives in memory."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def build(method, seq, args, mesh):
    """(jitted fwd+bwd function, input ShapeDtypeStructs) for one method and length."""
    dtype = jnp.dtype(args.dtype)
    q_shape = (args.batch, seq, args.heads, args.head_dim)
    kv_shape = (args.batch, seq, args.kv_heads, args.head_dim)
    if method == "ring":
        sharding = NamedSharding(mesh, P(None, "sp"))
        attn = jax.shard_map(
            lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name="sp", causal=args.causal, layout="zigzag"),
            mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    else:
        sharding = jax.sharding.make_single_device_sharding(jax.devices()[0])
        if method == "dense":
            attn = lambda q, k, v: dense_attention(q, k, v, args.causal)  # noqa: E731
        else:
            attn = lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, causal=args.causal)  # noqa: E731

    def loss(q, k, v):
        return attn(q, k, v).astype(jnp.float32).sum()

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    specs = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in (q_shape, kv_shape, kv_shape)]
    return fn, specs


def is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def measure(method, seq, args, mesh, limit):
    """Peak per-device bytes of one forward+backward, or None if it does not fit."""
    fn, specs = build(method, seq, args, mesh)
    try:
        compiled = fn.lower(*specs).compile()
    except Exception as err:  # noqa: BLE001 - compilers report OOM as several error types
        if is_oom(err):
            return None
        raise
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    if limit is not None and peak > limit:
        return None
    if args.execute:
        keys = jax.random.split(jax.random.key(seq), 3)
        try:
            inputs = [jax.jit(lambda key, s=s: jax.random.normal(key, s.shape, s.dtype), out_shardings=s.sharding)(kk)
                      for kk, s in zip(keys, specs)]
            jax.block_until_ready(compiled(*inputs))
        except Exception as err:  # noqa: BLE001
            if is_oom(err):
                return None
            raise
        del inputs
    return int(peak)


def device_limit():
    """Bytes the allocator may use on one device, when the platform says."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def parse_args(argv=None):
    on_cpu = jax.default_backend() == "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", type=int, default=512, help="first sequence length")
    p.add_argument("--max-seq", type=int, default=4096 if on_cpu else 1 << 22, help="cap on the sequence length")
    p.add_argument("--devices", type=int, default=None, help="ring size (default: all devices)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32" if on_cpu else "bfloat16")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--methods", default="ring,dense", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--execute", action=argparse.BooleanOptionalAction, default=not on_cpu,
                   help="also run each plan once (default on accelerators)")
    p.add_argument("--out-dir", default="long_context_out")
    args = p.parse_args(argv)
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        p.error(f"--methods must be a comma-separated subset of {METHODS}, got {bad or 'nothing'}")
    return args


def write_outputs(rows, args, header):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out_dir, exist_ok=True)
    paths = {ext: os.path.join(args.out_dir, f"long_context.{ext}") for ext in ("csv", "md", "png")}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(paths["md"], "w") as f:
        f.write(f"{header}\n\n| method | devices | seq_len | peak MiB per device | status |\n|---|---|---|---|---|\n")
        for r in rows:
            mib = "" if r["peak_bytes_per_device"] == "" else f"{r['peak_bytes_per_device'] / 2**20:,.1f}"
            f.write(f"| {r['method']} | {r['devices']} | {r['seq_len']} | {mib} | {r['status']} |\n")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in args.methods:
        ok = [r for r in rows if r["method"] == method and r["status"] == "ok"]
        if ok:
            label = f"{method} ({ok[0]['devices']} device{'s' if ok[0]['devices'] > 1 else ''})"
            ax.plot([r["seq_len"] for r in ok], [r["peak_bytes_per_device"] / 2**20 for r in ok], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="peak memory per device (MiB)")
    ax.set_xscale("log", base=2)
    ax.set_title(header, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=120)
    plt.close(fig)
    return paths


def main(argv=None) -> dict:
    """Run the sweep; returns {"rows": [...], "paths": {...}}."""
    args = parse_args(argv)
    n = args.devices or len(jax.devices())
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])
    limit = device_limit()
    device = jax.devices()[0]
    header = (f"fwd+bwd, batch {args.batch}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
              f"{args.dtype}, causal={args.causal}; {n} x {device.device_kind} ({device.platform}), "
              f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print(header)
    rows = []
    for method in args.methods:
        devices = n if method == "ring" else 1
        seq = args.start
        while seq <= args.max_seq:
            if method == "ring" and seq % (2 * n):
                raise ValueError(f"sequence length {seq} must be divisible by 2 x {n} devices (zigzag layout)")
            peak = measure(method, seq, args, mesh, limit)
            status = "ok" if peak is not None else "OOM"
            rows.append({"method": method, "devices": devices, "seq_len": seq,
                         "peak_bytes_per_device": "" if peak is None else peak, "status": status})
            shown = "out of memory" if peak is None else f"{peak / 2**20:,.1f} MiB per device"
            print(f"{method:>5} seq {seq:>9,}: {shown}", flush=True)
            if peak is None:
                break
            seq *= 2
        longest = max((r["seq_len"] for r in rows if r["method"] == method and r["status"] == "ok"), default=None)
        capped = rows and rows[-1]["status"] == "ok"
        print(f"{method:>5}: longest that fits {longest}" + (f" (stopped at the cap {args.max_seq})" if capped else ""))
    paths = write_outputs(rows, args, header)
    print("wrote " + ", ".join(paths.values()))
    return {"rows": rows, "paths": paths}


if __name__ == "__main__":
    main()

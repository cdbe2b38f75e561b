"""Time ring attention forward and forward+backward on a TPU pod slice and write the results as JSON.

Run the same command on every host of the slice (see README.md here). Every process
joins `jax.distributed`, the devices form a (data x sp) mesh, q, k, v are generated
directly in their shards (nothing is materialised on a host), and process 0 writes
the timings, the throughput per device, the peak memory and, when the chip is known,
the cost model's prediction (`ringjax.strategies.plan`) beside the measurement.

It runs anywhere JAX runs: on one CPU process with small sizes it is a smoke test
(`--distributed off`), and `--check` compares the ring with dense attention.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax

# device_kind -> ringjax.strategies.plan chip key
CHIP_OF_DEVICE_KIND = {
    "TPU v4": "tpu_v4",
    "TPU v5 lite": "tpu_v5e",
    "TPU v5e": "tpu_v5e",
    "TPU v5": "tpu_v5p",
    "TPU v5p": "tpu_v5p",
    "TPU v6 lite": "tpu_v6e",
    "TPU v6e": "tpu_v6e",
}


def chip_of(device_kind: str) -> str | None:
    """The ringjax.strategies.plan chip for a device kind, if the cost model knows it."""
    if device_kind.startswith("NVIDIA H100"):
        return "h100"
    if device_kind.startswith("NVIDIA H200"):
        return "h200"
    return CHIP_OF_DEVICE_KIND.get(device_kind)
# environment variables that mark a Cloud TPU VM or a cluster jax.distributed can detect
CLUSTER_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "MEGASCALE_COORDINATOR_ADDRESS",
               "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=131072, help="global sequence length")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the data axis size)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument("--data-parallel", type=int, default=1, help="size of the data axis; the rest is the ring")
    p.add_argument("--implementation", default="auto", help="'auto', 'pallas_tpu', 'xla', ...")
    p.add_argument("--block-q", type=int, default=None, help="with a named implementation: its block_q")
    p.add_argument("--block-kv", type=int, default=None, help="with a named implementation: its block_kv")
    p.add_argument("--fused", action="store_true", help="pallas_tpu: the fused remote-DMA forward ring")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--check", action="store_true", help="compare with dense attention (small sizes only)")
    p.add_argument("--output", default="ring_benchmark.json", help="process 0 writes the results here")
    p.add_argument("--distributed", default="auto", choices=["auto", "on", "off"],
                   help="join jax.distributed (auto: on a Cloud TPU VM or a detected cluster)")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default: auto-detect)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    return p.parse_args(argv)


def initialize_distributed(args) -> bool:
    wanted = args.distributed == "on" or (
        args.distributed == "auto" and (args.coordinator is not None or any(v in os.environ for v in CLUSTER_ENV))
    )
    if wanted:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    return wanted


def build_mesh(data_parallel: int):
    """(data, sp) over every global device; make_mesh orders devices along the physical torus."""
    n = jax.device_count()
    if data_parallel < 1 or n % data_parallel:
        raise ValueError(f"--data-parallel {data_parallel} must divide the device count {n}")
    explicit = (AxisType.Explicit, AxisType.Explicit)
    return jax.make_mesh((data_parallel, n // data_parallel), ("data", "sp"), axis_types=explicit)


def make_config(args):
    """The config for a named implementation, from the block flags; None lets ringjax choose."""
    wants_blocks = args.block_q is not None or args.block_kv is not None or args.fused
    if args.implementation.startswith("pallas_tpu"):
        from ringjax.backends.pallas_tpu import TpuConfig

        kw = {k: v for k, v in (("block_q", args.block_q), ("block_kv", args.block_kv)) if v is not None}
        return TpuConfig(fused=args.fused, interpret=args.implementation == "pallas_tpu_interpret", **kw)
    if args.implementation == "xla" and wants_blocks and not args.fused:
        from ringjax.backends.xla import XlaConfig

        kw = {k: v for k, v in (("block_q", args.block_q), ("block_kv", args.block_kv)) if v is not None}
        return XlaConfig(**kw)
    if wants_blocks:
        raise ValueError("--block-q/--block-kv/--fused need --implementation pallas_tpu (or xla for blocks)")
    return None


def attention_flops(args, batch) -> float:
    """Forward FLOPs: 4 * B * H * T^2 * D, half of it when causal (as in shared/anchors.md)."""
    flops = 4.0 * batch * args.heads * args.seq_len**2 * args.head_dim
    return flops / 2 if args.causal else flops


def _median_time(fn, *xs, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*xs))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def _peak_memory():
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def _dense_check(args, mesh, q, k, v, attend) -> dict:
    """Max relative error of the ring against jax.nn.dot_product_attention on natural-order inputs."""
    n = mesh.shape["sp"]
    to = lambda x: ringjax.to_layout(x, args.layout, n, axis=1)  # noqa: E731
    out = ringjax.from_layout(attend(to(q), to(k), to(v)), args.layout, n, axis=1)
    f32 = lambda x: np.asarray(jax.device_get(x), np.float32)  # noqa: E731
    ref = jax.nn.dot_product_attention(*(jnp.asarray(f32(x)) for x in (q, k, v)), is_causal=args.causal)
    err = float(np.max(np.abs(f32(out) - np.asarray(ref))) / max(np.max(np.abs(np.asarray(ref))), 1e-30))
    tol = 2e-2 if args.dtype == "bfloat16" else 1e-4
    return {"max_rel_err": err, "tolerance": tol, "ok": err < tol}


def main(argv=None) -> dict:
    args = parse_args(argv)
    distributed = initialize_distributed(args)
    mesh = build_mesh(args.data_parallel)
    batch = args.batch if args.batch is not None else args.data_parallel
    dtype = jnp.dtype(args.dtype)
    config = make_config(args)
    sharding = NamedSharding(mesh, P("data", "sp"))
    shapes = {
        "q": (batch, args.seq_len, args.heads, args.head_dim),
        "k": (batch, args.seq_len, args.kv_heads, args.head_dim),
        "v": (batch, args.seq_len, args.kv_heads, args.head_dim),
    }

    def attend(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name="sp", causal=args.causal, layout=args.layout,
                                      implementation=args.implementation, config=config)

    def loss(q, k, v, w):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w)

    with jax.set_mesh(mesh):
        keys = jax.random.split(jax.random.key(0), 4)
        gen = jax.jit(lambda key, shape: jax.random.normal(key, shape, dtype), static_argnums=1,
                      out_shardings=sharding)
        q, k, v = (gen(key, shapes[name]) for key, name in zip(keys, ("q", "k", "v")))
        w = jax.jit(lambda key: jax.random.normal(key, shapes["q"], jnp.float32), out_shardings=sharding)(keys[3])
        fwd = jax.jit(attend)
        fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        start = time.perf_counter()
        fwd = fwd.lower(q, k, v).compile()
        fwd_bwd = fwd_bwd.lower(q, k, v, w).compile()
        compile_s = time.perf_counter() - start
        fwd_s, fwd_times = _median_time(fwd, q, k, v, warmup=args.warmup, iters=args.iters)
        fwd_bwd_s, fwd_bwd_times = _median_time(fwd_bwd, q, k, v, w, warmup=args.warmup, iters=args.iters)
        check = _dense_check(args, mesh, q, k, v, jax.jit(attend)) if args.check else None

    n = jax.device_count()
    flops = attention_flops(args, batch)
    device_kind = jax.devices()[0].device_kind
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "ringjax_version": ringjax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device_kind,
        "num_devices": n,
        "num_processes": jax.process_count(),
        "distributed": distributed,
        "mesh": {"data": mesh.shape["data"], "sp": mesh.shape["sp"]},
        "problem": {"batch": batch, "seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim, "dtype": args.dtype, "causal": args.causal, "layout": args.layout},
        "implementation": args.implementation,
        "config": None if config is None else ringjax.config_to_json(config),
        "compile_s": compile_s,
        "fwd_s": fwd_s,
        "fwd_bwd_s": fwd_bwd_s,
        "fwd_times_s": fwd_times,
        "fwd_bwd_times_s": fwd_bwd_times,
        # TFLOP/s per device: total attention work / time / devices (forward+backward = 3.5x forward)
        "fwd_tflops_per_device": flops / fwd_s / n / 1e12,
        "fwd_bwd_tflops_per_device": 3.5 * flops / fwd_bwd_s / n / 1e12,
        "peak_memory_bytes": _peak_memory(),
        "check": check,
    }
    chip = chip_of(device_kind)
    if chip is not None and args.dtype == "bfloat16":
        from ringjax.strategies.plan import plan

        prediction = plan(chip, ring_size=mesh.shape["sp"], seq_len=args.seq_len, heads=args.heads,
                          kv_heads=args.kv_heads, head_dim=args.head_dim, causal=args.causal, layout=args.layout,
                          batch=max(1, batch // mesh.shape["data"]))
        results["plan"] = {"fwd_s": prediction.fwd_total_s, "bwd_s": prediction.bwd_total_s,
                           "fwd_error": fwd_s / prediction.fwd_total_s - 1.0, "text": str(prediction)}
    if jax.process_index() == 0:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"{n} x {device_kind}, mesh data={mesh.shape['data']} sp={mesh.shape['sp']}, seq {args.seq_len}: "
              f"fwd {fwd_s * 1e3:.2f} ms ({results['fwd_tflops_per_device']:.1f} TFLOP/s/device), "
              f"fwd+bwd {fwd_bwd_s * 1e3:.2f} ms ({results['fwd_bwd_tflops_per_device']:.1f} TFLOP/s/device)"
              + ("" if check is None else f", check {'ok' if check['ok'] else 'FAILED'} ({check['max_rel_err']:.1e})")
              + f" -> {args.output}")
    return results


if __name__ == "__main__":
    main()

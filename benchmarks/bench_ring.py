"""Side-by-side GPU benchmark: ringjax kernels vs cuDNN, the ring on 1/2/4 GPUs, ppermute bandwidth.

    python benchmarks/bench_ring.py --parts single,ring,million,ppermute --out results/
    python benchmarks/bench_ring.py --parts mosaic --seqs 8192,32768   # Mosaic GPU step vs cuDNN

bf16, batch 1, 32 query heads, 8 KV heads, head_dim 128. TFLOP/s counts 4*B*H*T*T*D for the
forward (half when causal) and 3.5x that for forward+backward; median of --reps timed runs after
warm-up, each timed around block_until_ready. Writes bench_<tag>.json (+ .png) under --out and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.pallas.gpu import GpuConfig

from common import attention_flops, timeit  # benchmarks/ is on sys.path when a script runs

B, H, KVH, D = 1, 32, 8, 128
DT = jnp.bfloat16


def flops(t_total, causal, bwd):
    return attention_flops(B, H, t_total, D, causal, bwd)


def inputs(t, sharding=None, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, t, H, D), (B, t, KVH, D), (B, t, KVH, D), (B, t, H, D)]
    out = []
    for key, shape in zip(ks, shapes):
        x = jax.random.normal(key, shape, DT)
        out.append(jax.device_put(x, sharding) if sharding is not None else x)
    return out


def make_fns(attn):
    """(fwd, fwd+bwd) jitted from attn(q, k, v) -> out."""
    fwd = jax.jit(attn)

    def loss(q, k, v, do):
        return (attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)).sum()

    fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fwd, fb


def cudnn_attn(causal):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def ringjax_attn(causal, impl, config=None, **kw):
    return lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, causal=causal, implementation=impl,
                                                  config=config, **kw)


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


_STREAM = []  # open file receiving every row as one JSON line (rows survive a killed run)


def record(rows, **row):
    rows.append(row)
    for f in _STREAM:
        f.write(json.dumps(row) + "\n")
        f.flush()
    keys = ("part", "impl", "T", "gpus", "layout", "causal", "mode", "ms", "tflops", "pct_ideal", "note")
    print(" ".join(f"{k}={row[k]}" for k in keys if k in row), flush=True)


# ----------------------------------------------------------------------------- parts


def part_sweep(rows, args):
    """A few launch configs of the pallas_gpu kernels at 8K causal, fwd and fwd+bwd."""
    t = 8192
    q, k, v, do = inputs(t)
    fwd_cfgs = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4),
                (128, 64, 8, 4)]
    best = None
    for bq, bk, w, s in fwd_cfgs:
        cfg = GpuConfig(block_q=bq, block_kv=bk, num_warps=w, num_stages=s)
        try:
            ms = timeit(jax.jit(ringjax_attn(True, "pallas_gpu", cfg)), q, k, v, reps=args.reps) * 1e3
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
            record(rows, part="sweep", impl="pallas_gpu", T=t, causal=True, mode="fwd", note=f"{(bq, bk, w, s)} "
                   f"failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        tf = flops(t, True, False) / ms / 1e9
        record(rows, part="sweep", impl="pallas_gpu", T=t, causal=True, mode="fwd", ms=round(ms, 3),
               tflops=round(tf, 1), note=str((bq, bk, w, s)))
        if best is None or ms < best[0]:
            best = (ms, cfg)
    bwd_cfgs = [(64, 64, 4, 2), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2), (32, 128, 8, 3)]
    best_b = None
    for bq, bk, w, s in bwd_cfgs:
        cfg = GpuConfig(block_q=best[1].block_q, block_kv=best[1].block_kv, num_warps=best[1].num_warps,
                        num_stages=best[1].num_stages, bwd_block_q=bq, bwd_block_kv=bk, bwd_num_warps=w,
                        bwd_num_stages=s)
        try:
            _, fb = make_fns(ringjax_attn(True, "pallas_gpu", cfg))
            ms = timeit(fb, q, k, v, do, reps=args.reps) * 1e3
        except Exception as e:  # noqa: BLE001
            record(rows, part="sweep", impl="pallas_gpu", T=t, causal=True, mode="fwd+bwd",
                   note=f"{(bq, bk, w, s)} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        tf = flops(t, True, True) / ms / 1e9
        record(rows, part="sweep", impl="pallas_gpu", T=t, causal=True, mode="fwd+bwd", ms=round(ms, 3),
               tflops=round(tf, 1), note=str((bq, bk, w, s)))
        if best_b is None or ms < best_b[0]:
            best_b = (ms, cfg)
    print("best config:", best_b[1] if best_b else best, flush=True)
    return best_b[1] if best_b else (best[1] if best else GpuConfig())


def part_sweep32(rows, args):
    """Forward launch configs at 32K, causal and not (the kernel's best case)."""
    t = 32768
    q, k, v, _ = inputs(t)
    for causal in (False, True):
        for bq, bk, w, s in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3)):
            cfg = GpuConfig(block_q=bq, block_kv=bk, num_warps=w, num_stages=s)
            try:
                ms = timeit(jax.jit(ringjax_attn(causal, "pallas_gpu", cfg)), q, k, v, reps=args.reps) * 1e3
            except Exception as e:  # noqa: BLE001
                record(rows, part="sweep32", impl="pallas_gpu", T=t, causal=causal, mode="fwd",
                       note=f"{(bq, bk, w, s)} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            record(rows, part="sweep32", impl="pallas_gpu", T=t, causal=causal, mode="fwd", ms=round(ms, 3),
                   tflops=round(flops(t, causal, False) / ms / 1e9, 1), note=str((bq, bk, w, s)))


def _time_cfg(rows, part, t, causal, mode, cfg, note, q, k, v, do, reps):
    """ms of one config (None if it fails to compile or run; the failure is recorded)."""
    try:
        if mode == "fwd":
            ms = timeit(jax.jit(ringjax_attn(causal, "pallas_gpu", cfg)), q, k, v, reps=reps) * 1e3
        else:
            ms = timeit(make_fns(ringjax_attn(causal, "pallas_gpu", cfg))[1], q, k, v, do, reps=reps) * 1e3
    except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
        record(rows, part=part, impl="pallas_gpu", T=t, causal=causal, mode=mode,
               note=f"{note} failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    record(rows, part=part, impl="pallas_gpu", T=t, causal=causal, mode=mode, ms=round(ms, 3),
           tflops=round(flops(t, causal, mode != "fwd") / ms / 1e9, 1), note=note)
    return ms


def part_tune(rows, args):
    """v4 tuning (at --tune-t): forward tiles (causal and not), then split vs fused backward tiles (causal)."""
    t = args.tune_t
    q, k, v, do = inputs(t)
    best, best_ms = GpuConfig(), None
    fwd_cfgs = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4)) if args.tune_fwd else ()
    for bq, bk, w, st in fwd_cfgs:
        cfg = GpuConfig(block_q=bq, block_kv=bk, num_warps=w, num_stages=st)
        total = 0.0
        for causal in (True, False):
            ms = _time_cfg(rows, "tune", t, causal, "fwd", cfg, str((bq, bk, w, st)), q, k, v, do, args.reps)
            total = None if ms is None or total is None else total + ms
        if total is not None and (best_ms is None or total < best_ms):
            best, best_ms = cfg, total
    best_b, best_b_ms = best, None
    for spec in args.tune_bwd.split(","):  # e.g. f64.128.8.2: fused, bq 64, bk 128, 8 warps, 2 stages
        fused = spec[0] == "f"
        bq, bk, w, st = (int(x) for x in spec[1:].split("."))
        cfg = dataclasses.replace(best, bwd_block_q=bq, bwd_block_kv=bk, bwd_num_warps=w, bwd_num_stages=st,
                                  bwd_fused=fused)
        ms = _time_cfg(rows, "tune", t, True, "fwd+bwd", cfg, f"{'fused' if fused else 'split'} {(bq, bk, w, st)}",
                       q, k, v, do, args.reps)
        if ms is not None and (best_b_ms is None or ms < best_b_ms):
            best_b, best_b_ms = cfg, ms
    print("tuned config:", best_b.to_json(), flush=True)
    return best_b


def part_ideal(rows, args, totals, cache):
    """cuDNN single-GPU references for the ring's % of ideal (causal, fwd and fwd+bwd)."""
    for t in totals:
        for mode in ("fwd", "fwd+bwd"):
            cudnn_tflops(rows, args, t, True, mode, cache)


def part_ppchain(rows, args):
    """8 ppermutes chained in one program: the per-transfer cost without per-call dispatch."""
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    perm = [(i, (i + 1) % n) for i in range(n)]

    def chain(x):
        return jax.lax.fori_loop(0, 8, lambda i, y: jax.lax.ppermute(y, "sp", perm), x)

    fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))
    for mb in (16, 64, 256):
        elems = mb * 2**20 // 2
        x = jax.device_put(jax.random.normal(jax.random.key(1), (n * elems,), DT), NamedSharding(mesh, P("sp")))
        s = timeit(fn, x, reps=args.reps) / 8
        record(rows, part="ppchain", impl="ppermute x8 in one jit", gpus=n, ms=round(s * 1e3, 3),
               note=f"{mb} MiB/device {mb * 2**20 / s / 1e9:.1f} GB/s per device per transfer")


def part_single(rows, args, cfg, seqs):
    for t in seqs:
        q, k, v, do = inputs(t)
        for causal in (True, False):
            impls = [("cudnn", cudnn_attn(causal)), ("pallas_gpu", ringjax_attn(causal, "pallas_gpu", cfg))]
            if args.with_xla and t <= 8192:
                impls.append(("xla", ringjax_attn(causal, "xla")))
            ref = None
            for name, attn in impls:
                fwd, fb = make_fns(attn)
                out = fwd(q, k, v)
                err = None
                if ref is None:
                    ref = out
                else:
                    err = rel(out, ref)
                for mode, fn, a in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fb, (q, k, v, do))):
                    try:
                        ms = timeit(fn, *a, reps=args.reps) * 1e3
                    except Exception as e:  # noqa: BLE001
                        record(rows, part="single", impl=name, T=t, gpus=1, causal=causal, mode=mode,
                               note=f"failed: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    tf = flops(t, causal, mode != "fwd") / ms / 1e9
                    record(rows, part="single", impl=name, T=t, gpus=1, causal=causal, mode=mode, ms=round(ms, 3),
                           tflops=round(tf, 1), note="" if err is None else f"rel err vs cudnn {err:.1e}")
                del fwd, fb, out


def _grads(fb, q, k, v, do):
    return [np.asarray(g, np.float32) for g in fb(q, k, v, do)]


def _jax_mgpu_fwd(rows, args, t, causal, q, k, v):
    """JAX's own attention_mgpu forward (fp16: it rejects bf16 in jax 0.11.2), for parity."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)
    q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
    try:
        fn = jax.jit(lambda q, k, v: am.attention(q, k, v, cfg))
        ms = timeit(fn, q16, k16, v16, reps=args.reps) * 1e3
    except Exception as e:  # noqa: BLE001
        record(rows, part="mosaic", impl="jax attention_mgpu", T=t, gpus=1, causal=causal, mode="fwd",
               note=f"failed: {type(e).__name__}: {str(e)[:300]}")
        return
    record(rows, part="mosaic", impl="jax attention_mgpu", T=t, gpus=1, causal=causal, mode="fwd", ms=round(ms, 3),
           tflops=round(flops(t, causal, False) / ms / 1e9, 1), note="fp16, block_q 64, block_kv 128, 2 stages")


def part_mosaic(rows, args, seqs):
    """One ring step on one GPU (axis_name=None): cuDNN, pallas_mosaic_gpu (each --mosaic-configs entry) and,
    with --with-triton, pallas_gpu; outputs and gradients compared with cuDNN's."""
    from ringjax.pallas.mosaic_gpu import MosaicGpuConfig

    mosaic = [None] + [MosaicGpuConfig.from_json(c) for c in filter(None, args.mosaic_configs.split(";"))]
    for t in seqs:
        q, k, v, do = inputs(t)
        for causal in (True, False):
            impls = [("cudnn", None, cudnn_attn(causal))]
            impls += [("pallas_mosaic_gpu", c, ringjax_attn(causal, "pallas_mosaic_gpu", c)) for c in mosaic]
            if args.with_triton:
                impls.append(("pallas_gpu", None, ringjax_attn(causal, "pallas_gpu")))
            if args.with_jax_mgpu:
                _jax_mgpu_fwd(rows, args, t, causal, q, k, v)
            ref = ref_g = None
            for name, cfg, attn in impls:
                note = "" if cfg is None else cfg.to_json()
                fwd, fb = make_fns(attn)
                try:
                    out = fwd(q, k, v)
                    grads = _grads(fb, q, k, v, do)
                except Exception as e:  # noqa: BLE001 - a failing implementation is recorded, the rest go on
                    record(rows, part="mosaic", impl=name, T=t, gpus=1, causal=causal,
                           note=f"{note} failed: {type(e).__name__}: {str(e)[:600]}")
                    continue
                if ref is None:
                    ref, ref_g = out, grads
                else:
                    errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, ref_g)]
                    note += " rel err vs cudnn out/dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs)
                for mode, fn, a in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fb, (q, k, v, do))):
                    ms = timeit(fn, *a, reps=args.reps) * 1e3
                    record(rows, part="mosaic", impl=name, T=t, gpus=1, causal=causal, mode=mode, ms=round(ms, 3),
                           tflops=round(flops(t, causal, mode != "fwd") / ms / 1e9, 1), note=note)
                del fwd, fb, out, grads
        del q, k, v, do


def cudnn_tflops(rows, args, t, causal, mode, cache):
    """cuDNN single-GPU throughput on the same total work (measured once per shape)."""
    key = (t, causal, mode)
    if key not in cache:
        for r in rows:
            if r.get("part") == "single" and r.get("impl") == "cudnn" and (r["T"], r["causal"], r["mode"]) == key \
                    and "tflops" in r:
                cache[key] = r["tflops"]
        if key not in cache:
            q, k, v, do = inputs(t)
            fwd, fb = make_fns(cudnn_attn(causal))
            fn, a = (fwd, (q, k, v)) if mode == "fwd" else (fb, (q, k, v, do))
            ms = timeit(fn, *a, reps=args.reps) * 1e3
            cache[key] = round(flops(t, causal, mode != "fwd") / ms / 1e9, 1)
            record(rows, part="ideal", impl="cudnn", T=t, gpus=1, causal=causal, mode=mode, ms=round(ms, 3),
                   tflops=cache[key], note="single-GPU reference for % of ideal")
            del q, k, v, do
    return cache[key]


def ring_fns(mesh, causal, layout, impl, cfg):
    def attn(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name="sp", mesh=mesh, causal=causal, layout=layout,
                                      implementation=impl, config=cfg)

    return make_fns(attn)


def part_ring(rows, args, cfg, per_gpu_seqs, gpu_counts, cache):
    devs = jax.devices()
    for n in gpu_counts:
        if n > len(devs):
            continue
        mesh = jax.make_mesh((n,), ("sp",), devices=devs[:n])
        sh = NamedSharding(mesh, P(None, "sp"))
        for tp in per_gpu_seqs:
            t = tp * n
            q, k, v, do = inputs(t, sh)
            for layout in args.layouts.split(","):
                impls = [("pallas_gpu", cfg)]
                if args.with_xla and n == max(gpu_counts) and tp == min(per_gpu_seqs) and layout == "zigzag":
                    impls.append(("xla", None))
                for impl, c in impls:
                    fwd, fb = ring_fns(mesh, True, layout, impl, c)
                    for mode, fn, a in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fb, (q, k, v, do))):
                        try:
                            ms = timeit(fn, *a, reps=args.reps) * 1e3
                        except Exception as e:  # noqa: BLE001
                            record(rows, part="ring", impl=impl, T=t, gpus=n, layout=layout, causal=True, mode=mode,
                                   note=f"failed: {type(e).__name__}: {str(e)[:300]}")
                            continue
                        tf = flops(t, True, mode != "fwd") / ms / 1e9 / n
                        ideal = cudnn_tflops(rows, args, t, True, mode, cache) if t <= args.max_ideal_t else None
                        pct = round(100 * tf / ideal, 1) if ideal else None
                        record(rows, part="ring", impl=impl, T=t, gpus=n, layout=layout, causal=True, mode=mode,
                               ms=round(ms, 3), tflops=round(tf, 1), pct_ideal=pct, note=f"{tp} tokens/GPU")
            del q, k, v, do


def part_million(rows, args, cfg):
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    t = 1 << 20
    q, k, v, do = inputs(t, NamedSharding(mesh, P(None, "sp")))
    _, fb = ring_fns(mesh, True, "zigzag", "pallas_gpu", cfg)
    try:
        ms = timeit(fb, q, k, v, do, reps=1, warmup=1) * 1e3
    except Exception as e:  # noqa: BLE001
        record(rows, part="million", impl="pallas_gpu", T=t, gpus=n, layout="zigzag", causal=True, mode="fwd+bwd",
               note=f"failed: {type(e).__name__}: {str(e)[:300]}")
        return
    peak = max(d.memory_stats().get("peak_bytes_in_use", 0) for d in mesh.devices.flat) / 2**30
    tf = flops(t, True, True) / ms / 1e9 / n
    record(rows, part="million", impl="pallas_gpu", T=t, gpus=n, layout="zigzag", causal=True, mode="fwd+bwd",
           ms=round(ms, 1), tflops=round(tf, 1), note=f"peak per-device memory {peak:.1f} GiB (one timed run)")


def part_ppermute(rows, args):
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    perm = [(i, (i + 1) % n) for i in range(n)]
    shift = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "sp", perm), mesh=mesh, in_specs=P("sp"),
                                  out_specs=P("sp")))
    for mb in (16, 64, 256, 1024):
        elems = mb * 2**20 // 2
        x = jax.device_put(jax.random.normal(jax.random.key(1), (n * elems,), DT), NamedSharding(mesh, P("sp")))
        s = timeit(shift, x, reps=args.reps)
        record(rows, part="ppermute", impl="ppermute", gpus=n, ms=round(s * 1e3, 3),
               note=f"{mb} MiB/device {mb * 2**20 / s / 1e9:.1f} GB/s per device; tag={args.tag}")
    # reference: XLA's own device-to-device copy between two GPUs
    d0, d1 = jax.devices()[:2]
    x = jax.device_put(jnp.ones((2**29,), DT), d0)
    s = timeit(lambda a: jax.device_put(a, d1), x, reps=args.reps)
    record(rows, part="ppermute", impl="device_put", gpus=2, ms=round(s * 1e3, 3),
           note=f"1024 MiB gpu0->gpu1 {2**30 / s / 1e9:.1f} GB/s; tag={args.tag}")


# ----------------------------------------------------------------------------- output


def table(rows):
    lines = ["| part | impl | T | GPUs | layout | causal | mode | ms | TFLOP/s (per GPU) | % ideal | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in (
            "part", "impl", "T", "gpus", "layout", "causal", "mode", "ms", "tflops", "pct_ideal", "note")) + " |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    single = [r for r in rows if r.get("part") == "single" and "tflops" in r]
    if not single:
        return
    labels = sorted({(r["T"], r["causal"], r["mode"]) for r in single})
    impls = sorted({r["impl"] for r in single})
    fig, ax = plt.subplots(figsize=(11, 4))
    w = 0.8 / len(impls)
    for i, name in enumerate(impls):
        vals = [next((r["tflops"] for r in single if r["impl"] == name and (r["T"], r["causal"], r["mode"]) == lab),
                     0) for lab in labels]
        ax.bar(np.arange(len(labels)) + i * w, vals, w, label=name)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - w / 2)
    ax.set_xticklabels([f"{t // 1024}K {'c' if c else 'nc'}\n{m}" for t, c, m in labels], fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"one-GPU attention step, bf16, 32q/8kv heads, d=128 ({jax.devices()[0].device_kind})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="sweep,single,ring,million,ppermute")
    p.add_argument("--seqs", default="8192,32768")
    p.add_argument("--gpus", default="1,2,4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-ideal-t", type=int, default=131072)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="main")
    p.add_argument("--config", default=None, help="GpuConfig as JSON, or @file holding it (skips tuning)")
    p.add_argument("--tune-t", type=int, default=32768, help="sequence length of part 'tune'")
    p.add_argument("--tune-fwd", type=int, default=1, help="part 'tune' also tunes forward tiles (0: default)")
    p.add_argument("--tune-bwd", default="s64.64.4.2,s64.64.4.3,f64.64.4.2,f64.64.4.3,f64.128.8.2,f64.128.8.3",
                   help="backward configs of part 'tune': s|f (split|fused) then bq.bk.warps.stages")
    p.add_argument("--layouts", default="zigzag,contiguous", help="ring layouts for part 'ring'")
    p.add_argument("--with-xla", type=int, default=1, help="also time the XLA ring (0: skip)")
    p.add_argument("--ideal-totals", default="16384,32768,65536,131072", help="total T for part 'ideal'")
    p.add_argument("--mosaic-configs", default="", help="part 'mosaic': extra MosaicGpuConfig JSONs, ';'-separated")
    p.add_argument("--with-triton", type=int, default=0, help="part 'mosaic': also time pallas_gpu")
    p.add_argument("--with-jax-mgpu", type=int, default=0, help="part 'mosaic': also time JAX's attention_mgpu")
    p.add_argument("--prior", default="", help="comma-separated bench JSONs whose cuDNN rows serve as ideals")
    args = p.parse_args()
    parts = args.parts.split(",")
    seqs = [int(s) for s in args.seqs.split(",")]
    meta = dict(device=jax.devices()[0].device_kind, n_devices=len(jax.devices()), jax=jax.__version__,
                date=datetime.date.today().isoformat(), env={k: v for k, v in os.environ.items()
                                                             if k.startswith(("NCCL_", "XLA_"))})
    print(meta, flush=True)
    os.makedirs(args.out, exist_ok=True)
    _STREAM.append(open(os.path.join(args.out, f"rows_{args.tag}.jsonl"), "w"))  # noqa: SIM115
    _STREAM[0].write(json.dumps({"meta": meta}) + "\n")
    rows = []
    text = args.config
    if text and text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    cfg = GpuConfig.from_json(text) if text else GpuConfig()
    if "sweep" in parts and not text:
        cfg = part_sweep(rows, args)
    if "tune" in parts and not text:
        cfg = part_tune(rows, args)
    meta["config"] = json.loads(cfg.to_json())
    with open(os.path.join(args.out, f"config_{args.tag}.json"), "w") as f:
        f.write(cfg.to_json())
    cache = {}
    for path in filter(None, args.prior.split(",")):
        if not os.path.exists(path):
            print(f"--prior {path} is missing; measuring those ideals here", flush=True)
            continue
        with open(path) as f:
            prior = [json.loads(line) for line in f] if path.endswith(".jsonl") else json.load(f)["rows"]
            for r in prior:
                if r.get("impl") == "cudnn" and r.get("part") in ("single", "ideal") and "tflops" in r:
                    cache.setdefault((r["T"], r["causal"], r["mode"]), r["tflops"])
    if "ideal" in parts:
        part_ideal(rows, args, [int(x) for x in args.ideal_totals.split(",")], cache)
    if "sweep32" in parts:
        part_sweep32(rows, args)
    if "ppchain" in parts:
        part_ppchain(rows, args)
    if "mosaic" in parts:
        part_mosaic(rows, args, seqs)
    if "single" in parts:
        part_single(rows, args, cfg, seqs)
    if "ring" in parts:
        part_ring(rows, args, cfg, seqs, [int(g) for g in args.gpus.split(",")], cache)
    if "million" in parts:
        part_million(rows, args, cfg)
    if "ppermute" in parts:
        part_ppermute(rows, args)
    with open(os.path.join(args.out, f"bench_{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, os.path.join(args.out, f"bench_{args.tag}.png"))
    print(f"\n{meta['device']} x{meta['n_devices']}, jax {meta['jax']}, {meta['date']}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

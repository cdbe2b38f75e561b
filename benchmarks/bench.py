"""ringjax benchmarks: `python benchmarks/bench.py SUITE [options]` (`--help` after a suite lists its options).

Each run appends one JSON line per case to benchmarks/results/<device>[_xN]_<date>_<suite>.jsonl and
prints a markdown table; `report` renders the newest results of every suite and device kind (README
tables between `<!-- bench:SUITE:begin/end -->` markers with --write-readme, PNG plots). What each
suite measures and how to run it on a GPU machine: docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.xla import XlaCacheConfig
from ringjax.dispatch.costs import MEASURED_DOCUMENTS
from ringjax.strategies import spread

from common import (
    FWD_BWD,
    RESULTS,
    Recorder,
    Shape,
    attention_fns,
    errors,
    failure,
    measure,
    newest_results,
    picked,
    random_inputs,
    ringjax_log,
    significant,
    timeit,
)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("fwd", "fwd_bwd", "bwd")
MODE_NAMES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd", "bwd": "bwd"}

# ----------------------------------------------------------------------------- progress and output

try:
    from tqdm import tqdm
except ImportError:  # optional: without it, rows are printed as they come and nothing else
    tqdm = None


def progress(items, desc: str):
    """`items` under a tqdm bar when tqdm is installed and stderr is a terminal."""
    return items if tqdm is None else tqdm(items, desc=desc, disable=None, leave=False)


def say(text: str):
    """Print without breaking a progress bar."""
    if tqdm is None:
        print(text, flush=True)
    else:
        tqdm.write(text)


# ----------------------------------------------------------------------------- what is compared


def ringjax_attention(implementation: str, causal: bool, **options):
    """ringjax on one device (`axis_name=None`) as attn(q, k, v)."""
    return lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, causal=causal,
                                                  implementation=implementation, **options)


def unavailable(library: str) -> str | None:
    """Why `library` ("cudnn" | "tokamax") cannot run here, or None."""
    if library == "tokamax":
        try:
            import tokamax  # noqa: F401
        except ImportError as e:
            return f"tokamax is not importable ({failure(e)})"
    platform = jax.devices()[0].platform
    return None if platform == "gpu" else f"{library} runs on NVIDIA GPUs only (this run: {platform})"


OTHER_IMPLEMENTATION = {"cudnn": "cudnn", "tokamax": "mosaic"}


def v_padded(attn):
    """attn(q, k, v) for a v narrower than k (multi-head latent attention) where `attn` takes v with k's head_dim
    only (jax.nn, tokamax): v zero-padded to it and the output sliced back, as a JAX user would run it."""

    def run(q, k, v):
        dv = v.shape[-1]
        if dv < k.shape[-1]:
            v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, k.shape[-1] - dv)])
        return attn(q, k, v)[..., :dv]

    return run


def other_attention(library: str, causal: bool, **options):
    """cuDNN through `jax.nn.dot_product_attention` or tokamax's Mosaic GPU kernel, as attn(q, k, v) (`v_padded`:
    the padded columns' work is not counted)."""
    if library == "cudnn":
        fn = jax.nn.dot_product_attention
    else:
        import tokamax

        fn = tokamax.dot_product_attention
    return v_padded(lambda q, k, v: fn(q, k, v, is_causal=causal, implementation=OTHER_IMPLEMENTATION[library],
                                       **options))


REFERENCE_MAX_SCORES = 2**31  # B*H*T*T float32 scores that the XLA reference materializes (8 GiB)


def reference(q, k, v, causal: bool):
    """(name, output) that one-device outputs are checked against; (None, None) where there is none.

    XLA in float32 while its T x T scores fit, else cuDNN on GPUs.
    """
    batch, tokens, heads, _ = q.shape
    if batch * heads * tokens * tokens <= REFERENCE_MAX_SCORES:
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return "xla float32", jax.jit(v_padded(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla")))(*f32)
    if unavailable("cudnn") is None:
        return "cudnn", jax.jit(other_attention("cudnn", causal))(q, k, v)
    return None, None


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh of the first local devices with Auto axes: XLA places what the suites do not shard."""
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:math.prod(shape)])


def sharded_ring(mesh: Mesh, implementation: str, layout: str = "zigzag", config=None):
    """The causal ring over mesh axis "sp" inside `jax.shard_map`, as attn(q, k, v) on global arrays in `layout`."""
    spec = P(None, "sp")

    def local(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name="sp", causal=True, layout=layout,
                                      implementation=implementation, config=config)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def natural(x, devices: int, layout: str = "zigzag"):
    """A global array in `layout` order, back in token order on the first device."""
    return jax.device_put(ringjax.from_layout(x, layout, devices), jax.devices()[0])


def ratios(a: dict, b: dict) -> dict:
    """a's TFLOP/s over b's, per mode (None where either is missing)."""
    out = {}
    for mode in MODES:
        x, y = a.get(f"{mode}_tflops"), b.get(f"{mode}_tflops")
        out[mode] = significant(x / y, 3) if x and y else None
    return out


def timed(attn, inputs, flops: float, args, devices: int = 1, reports: list | None = None) -> tuple[dict, object]:
    """measure(...) with ringjax's log: (rates + "implementation" it ran, forward output); the
    `ringjax.implementation` reports of the call are appended to `reports` if given."""
    with ringjax_log() as log:
        timing, out = measure(attn, *inputs, flops, reps=args.reps, warmup=args.warmup, budget_s=args.budget,
                              devices=devices, back_to_back=args.back_to_back, min_sample_s=args.sample_ms / 1e3)
    if reports is not None:
        reports.extend(log.reports)
    return {**picked(log), **timing}, out


def one_device_by_gpu(implementation: str, causal: bool, inputs, flops: float, args, devices: int):
    """The same total work on one GPU, timed on each of the first `devices` GPUs in turn: (rates per GPU,
    the first GPU's forward output). A ring runs at its slowest member's pace and GPUs of one host differ
    by a few percent, so the suites report ratios against the first GPU and against the slowest."""
    by_gpu, first = [], None
    for device in jax.devices()[:devices]:
        placed = [jax.device_put(x, device) for x in inputs]
        timing, out = timed(ringjax_attention(implementation, causal), placed, flops, args)
        by_gpu.append({"device": device.id, **timing})
        first = out if first is None else first
        del placed
    return by_gpu, first


def slowest(by_gpu: list[dict]) -> dict:
    """Per mode, the lowest TFLOP/s (and its time) among `one_device_by_gpu`'s GPUs."""
    out = {}
    for mode in MODES:
        runs = [t for t in by_gpu if t.get(f"{mode}_tflops")]
        if runs:
            worst = min(runs, key=lambda t: t[f"{mode}_tflops"])
            out.update({f"{mode}_tflops": worst[f"{mode}_tflops"], f"{mode}_ms": worst.get(f"{mode}_ms"),
                        f"{mode}_device": worst["device"]})
    return out


def candidates_timed(report, chosen: dict, options: dict, inputs, flops: float, args) -> dict:
    """Every implementation `auto` considered and could run, timed beside its prediction: {"candidates":
    {name: times and predicted times}, "auto_vs_fastest": the fastest fwd+bwd over auto's, "predicted_error":
    auto's predicted fwd+bwd over measured, minus 1}."""
    out = {}
    for c in report.candidates:
        if c.refusal is not None:
            continue
        if c.name == report.implementation:
            timing = chosen
        else:
            try:
                timing, _ = timed(ringjax_attention(c.name, True, **options), inputs, flops, args)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is a result too
                out[c.name] = {"error": failure(e)}
                continue
        p = c.prediction
        out[c.name] = {"fwd_ms": timing.get("fwd_ms"), "fwd_bwd_ms": timing.get("fwd_bwd_ms"),
                       "predicted_fwd_ms": significant(p.fwd_s * 1e3, 4) if p else None,
                       "predicted_fwd_bwd_ms": significant(p.fwd_bwd_s * 1e3, 4) if p else None}
    times = [x["fwd_bwd_ms"] for x in out.values() if x.get("fwd_bwd_ms")]
    mine = out.get(report.implementation, {})
    predicted = mine.get("predicted_fwd_bwd_ms")
    return {"candidates": out,
            "auto_vs_fastest": significant(min(times) / mine["fwd_bwd_ms"], 3) if mine.get("fwd_bwd_ms") else None,
            "predicted_error": significant(predicted / mine["fwd_bwd_ms"] - 1, 3) if predicted and
            mine.get("fwd_bwd_ms") else None}


def timed_other(library: str, causal: bool, inputs, flops: float, args, **options) -> dict:
    """cuDNN's or tokamax's rates, or {"skipped": why} / {"error": what}."""
    why = unavailable(library)
    if why is not None:
        return {"skipped": why}
    try:
        timing, _ = measure(other_attention(library, causal, **options), *inputs, flops, reps=args.reps,
                            warmup=args.warmup, budget_s=args.budget, back_to_back=args.back_to_back,
                            min_sample_s=args.sample_ms / 1e3)
    except Exception as e:  # noqa: BLE001 - a library that refuses a shape is recorded, the rest go on
        return {"error": failure(e)}
    return {"implementation": OTHER_IMPLEMENTATION[library], **timing, **library_version(library)}


def library_version(library: str) -> dict:
    """{"tokamax": its version} for tokamax's rows (jax's is in every row, and cuDNN comes with jax's GPU plugin)."""
    if library != "tokamax":
        return {}
    from importlib import metadata

    try:
        return {"tokamax": metadata.version("tokamax")}
    except metadata.PackageNotFoundError:  # imported from a source tree
        return {"tokamax": "unknown"}


# ----------------------------------------------------------------------------- suites


def config_overrides(text: str) -> dict:
    """"persistent=false,num_stages=3" -> {"persistent": False, "num_stages": 3}: each value read as JSON
    (true/false in any case), else kept as a string."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        value = value.strip()
        try:
            out[key.strip()] = json.loads(value.lower() if value.lower() in ("true", "false") else value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def deterministic_levels(text: str) -> list:
    """"false,invariant" -> [False, "invariant"]: `ring_attention`'s deterministic values."""
    levels = {"false": False, "true": True, "invariant": "invariant"}
    out = []
    for item in filter(None, text.split(",")):
        if item.strip().lower() not in levels:
            raise argparse.ArgumentTypeError(f"deterministic levels are {', '.join(levels)}, got {item!r}")
        out.append(levels[item.strip().lower()])
    return out or [False]


def variant_name(overrides: dict) -> str:
    return ",".join(f"{k}={json.dumps(v)}" for k, v in overrides.items()) or "default"


def run_step(args, rec: Recorder):
    """One device: ringjax, cuDNN and tokamax side by side, per T and causal. With --variant: ringjax's
    config as it would run and with each variant's fields replaced, in --rounds interleaved rounds."""
    shape = args.shape
    for t, causal in progress([(t, c) for t in args.seqs for c in STEP_MASKS[args.masks]], "step"):
        inputs = random_inputs(shape, t)
        ref_name, ref = reference(*inputs[:3], causal)
        flops = shape.flops(t, causal)
        for library in ("ringjax", "cudnn", "tokamax"):
            case = {"library": library, "T": t, "causal": causal, **shape.fields()}
            if library != "ringjax":
                rec.add(case, **timed_other(library, causal, inputs, flops, args))
            elif args.variant:
                step_variants(args, rec, case, inputs, flops, (ref_name, ref))
            else:
                for level in args.deterministic:
                    # rows of the default level keep the fields they always had
                    row = case if level is False else {**case, "deterministic": level}
                    try:
                        timing, out = timed(ringjax_attention(args.implementation, causal, deterministic=level),
                                            inputs, flops, args)
                    except Exception as e:  # noqa: BLE001
                        rec.add(row, error=failure(e))
                        continue
                    check = {} if ref is None else {**errors(out, ref), "reference": ref_name}
                    rec.add(row, **timing, **check)
        del inputs, ref


STEP_MASKS = {"both": (True, False), "causal": (True,), "full": (False,)}  # step --masks: which cases run


def step_variants(args, rec: Recorder, case: dict, inputs, flops: float, reference_out):
    """A/B of configs in one process: the config `--implementation` runs by itself ("default"), then the
    same with each `--variant`'s fields replaced; the list repeated `--rounds` times, so that drift in
    the GPU's clocks shows as a difference between rounds, not between variants. Each variant's output
    (every round) and gradients (the first) are compared with the default's (0.0: bitwise equal)."""
    ref_name, ref = reference_out
    base, first, first_grads, grads = None, None, None, None
    for round_ in range(args.rounds):
        for overrides in [{}] + args.variant:
            row_case = {**case, "variant": variant_name(overrides), "round": round_}
            try:
                config = dataclasses.replace(base, **overrides) if overrides else base
                reports: list = []
                attn = ringjax_attention(args.implementation, case["causal"], config=config)
                timing, out = timed(attn, inputs, flops, args, reports=reports)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                rec.add(row_case, error=failure(e))
                continue
            if base is None:
                base = reports[-1].config if reports else None
                if base is None:
                    raise SystemExit(f"--variant: {args.implementation} logged no config to vary")
            check = {} if ref is None else {**errors(out, ref), "reference": ref_name}
            try:  # gradients once per config (round 0): one more compile, no timing
                grads = jax.block_until_ready(attention_fns(attn)[1](*inputs)) if round_ == 0 else None
            except Exception as e:  # noqa: BLE001
                rec.add(row_case, **timing, error=failure(e))
                continue
            if first is None:
                first, first_grads = out, grads
            elif overrides:
                check["vs_default"] = errors(out, first)
                if grads is not None and first_grads is not None:
                    check["grads_vs_default"] = {n: errors(a, b)["rel_err"]
                                                 for n, a, b in zip(("dq", "dk", "dv"), grads, first_grads)}
            rec.add(row_case, **{**timing, **check, "config": ringjax.config_to_json(config or base)})


def run_ring(args, rec: Recorder):
    """The zigzag causal ring over N devices vs the same total work on one device (ringjax on each GPU, cuDNN)."""
    shape, n = args.shape, args.devices
    mesh = make_mesh((n,), ("sp",))
    itemsize = jnp.dtype(shape.dtype).itemsize
    for tp in progress(args.tokens_per_device, "ring"):
        t = n * tp
        case = {"devices": n, "tokens_per_device": tp, "T": t, "layout": "zigzag", "causal": True,
                **shape.fields()}
        kv_elements = 2 * shape.batch * tp * shape.kv_heads * shape.head_dim  # one shard's K and V
        flops = shape.flops(t, True)
        try:
            inputs = random_inputs(shape, t, NamedSharding(mesh, P(None, "sp")))
            ring, ring_out = timed(sharded_ring(mesh, args.implementation), inputs, flops, args, devices=n)
            fused, fused_out = {}, None
            if args.fused:  # Mosaic GPU kernels that move K/V (and dK/dV) themselves
                from ringjax.backends.pallas_mosaic_gpu import MosaicGpuConfig

                fused, fused_out = timed(sharded_ring(mesh, "pallas_mosaic_gpu", config=MosaicGpuConfig(fused=True)),
                                         inputs, flops, args, devices=n)
            one = [natural(x, n) for x in inputs]
            del inputs
            own_by_gpu, own_out = one_device_by_gpu(args.implementation, True, one, flops, args, n)
            own, own_slowest = own_by_gpu[0], slowest(own_by_gpu)
            check = errors(natural(ring_out, n), own_out)
            if fused_out is not None:
                fused = {"fused": fused, "fused_rel_err": errors(natural(fused_out, n), own_out)["rel_err"]}
            del ring_out, own_out, fused_out
            cudnn = timed_other("cudnn", True, one, flops, args)
            if fused:
                fused.update(fused_over_one_device=ratios(fused["fused"], own),
                             fused_over_slowest_one_device=ratios(fused["fused"], own_slowest),
                             fused_over_cudnn=ratios(fused["fused"], cudnn))
            del one
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest size
            rec.add(case, error=failure(e))
            continue
        rec.add(case, implementation=ring["implementation"], ring=ring, one_device=own, cudnn=cudnn,
                one_device_by_gpu=own_by_gpu, slowest_one_device=own_slowest,
                ring_over_one_device=ratios(ring, own), ring_over_slowest_one_device=ratios(ring, own_slowest),
                ring_over_cudnn=ratios(ring, cudnn), **fused,
                kv_bytes_per_step=kv_elements * itemsize,
                # backward steps carry the float32 dK, dV accumulators beside K and V
                kv_bytes_per_step_bwd=kv_elements * (itemsize + 4), **check)


STRATEGIES = ("ring", "all_gather", "ulysses", "hybrid", "auto")


def strategy_mesh(strategy: str, devices: int):
    """(mesh, axis_name): hybrid runs ulysses over "hp" (2) and the ring over "sp" (N/2)."""
    if strategy == "hybrid":
        return make_mesh((2, devices // 2), ("hp", "sp")), ("hp", "sp")
    return make_mesh((devices,), ("sp",)), "sp"


def run_strategies(args, rec: Recorder):
    """Every context-parallel strategy on global arrays over N devices, outputs checked against the ring's,
    and each against `--implementation` on the whole sequence on one GPU (timed on each GPU, first)."""
    n = args.devices
    strategies = [s for s in STRATEGIES if s != "hybrid" or (n >= 4 and n % 2 == 0)]
    kv_heads = [args.shape.heads] * (args.mha and args.shape.heads != args.shape.kv_heads) + [args.shape.kv_heads]
    for tp, kvh in progress([(tp, kvh) for tp in args.tokens_per_device for kvh in kv_heads], "strategies"):
        shape, t = dataclasses.replace(args.shape, kv_heads=kvh), n * tp
        ring_mesh = make_mesh((n,), ("sp",))
        inputs = random_inputs(shape, t, NamedSharding(ring_mesh, P(None, "sp")))
        flops = shape.flops(t, args.causal)
        try:
            own_by_gpu, _ = one_device_by_gpu(args.implementation, args.causal, inputs, flops, args, n)
            own = {"one_device": own_by_gpu[0], "one_device_by_gpu": own_by_gpu,
                   "slowest_one_device": slowest(own_by_gpu)}
        except Exception as e:  # noqa: BLE001 - e.g. the whole sequence does not fit one GPU
            own = {"one_device_error": failure(e)}
        ring_out = None  # ring runs first: the others are checked against its output
        for strategy in strategies:
            case = {"devices": n, "tokens_per_device": tp, "T": t, "strategy": strategy, "layout": args.layout,
                    "causal": args.causal, **shape.fields()}
            mesh, axis = strategy_mesh(strategy, n)

            def attn(q, k, v):
                return ringjax.ring_attention(q, k, v, axis_name=axis, mesh=mesh, causal=args.causal,
                                              layout=args.layout, strategy=strategy,
                                              implementation=args.implementation)

            try:
                placed = jax.device_put(inputs, NamedSharding(mesh, P(None, axis)))
                timing, out = timed(attn, placed, flops, args, devices=n)
                del placed
                if strategy == "ring":
                    ring_out = jax.device_put(out, jax.devices()[0])
                check = {} if ring_out is None else {"rel_err_vs_ring": errors(out, ring_out)["rel_err"]}
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it and go on
                rec.add(case, error=failure(e))
                continue
            if strategy == "auto" and "chosen" not in timing:
                timing["note"] = "ringjax logged no strategy choice"
            if strategy in ("ulysses", "hybrid"):  # rows before 2026-11-26 ran Ulysses unsorted and lack this
                timing["sort_tokens"] = spread.bind(strategy, axis, dict(mesh.shape)).sort_tokens
            vs = ({"over_one_device": ratios(timing, own["one_device"]),
                   "over_slowest_one_device": ratios(timing, own["slowest_one_device"])} if "one_device" in own else {})
            rec.add(case, **timing, **check, **vs, **own)
        del inputs, ring_out


def run_prefill(args, rec: Recorder):
    """Prefill: a chunk of t new tokens per row after t cached ones (capacity 2t, cache over N devices), by
    `cache_attention` with each strategy, on `--implementation` and on the XLA partials; outputs checked
    against the XLA partials' pass_q."""
    shape, n = args.shape, args.devices
    mesh = make_mesh((n,), ("sp",))
    for t in progress(args.chunks, "prefill"):
        cache, _ = decode_cache(mesh, shape, shape.batch, 2 * t)
        # the second half of the cache is the chunk: its rows end at 2t, its queries at t .. 2t - 1
        q = jax.random.normal(jax.random.key(t), (shape.batch, t, shape.heads, shape.head_dim), shape.dtype)
        pairs = t * t + t * (t + 1) / 2  # each query sees the t cached tokens and the chunk up to itself
        flops = 4 * shape.batch * shape.heads * shape.head_dim * pairs
        base = None
        for impl in dict.fromkeys(("xla", args.implementation)):
            for strategy in ("pass_q", "pass_kv"):
                case = {**shape.fields(), "cached": t, "t": t, "devices": n, "implementation": impl,
                        "strategy": strategy}
                try:
                    fn = jax.jit(lambda q, c, impl=impl, strategy=strategy: ringjax.cache_attention(
                        q, c, implementation=impl, strategy=strategy))
                    with ringjax_log() as log:
                        out = jax.block_until_ready(fn(q, cache))
                    seconds = timeit(fn, q, cache, reps=args.reps, warmup=args.warmup, budget_s=args.budget,
                                     back_to_back=args.back_to_back, min_sample_s=args.sample_ms / 1e3)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory
                    rec.add(case, error=failure(e))
                    continue
                base = out if base is None else base
                check = {} if out is base else {"rel_err_vs_xla": errors(out, base)["rel_err"]}
                rec.add(case, **picked(log), ms=significant(seconds * 1e3),
                        tflops_per_device=significant(flops / seconds / 1e12 / n), **check)
        del cache


def coverage_features(shape: Shape, t: int, args) -> list[tuple[str, Shape, dict, dict | str]]:
    """(feature, shape, ring_attention keywords, cuDNN keywords or why cuDNN is left out) at length t."""
    heads = shape.heads
    dims = (shape.head_dim // 2, shape.head_dim * 3 // 4, shape.head_dim * 3 // 2, shape.head_dim * 2)
    half, three_quarters, one_and_half, double = (dataclasses.replace(shape, head_dim=d) for d in dims)
    docs = MEASURED_DOCUMENTS  # as many as calibrations read into rows with segments
    segments = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None].repeat(shape.batch, 0)

    def absent(what):
        return f"jax.nn.dot_product_attention has no {what}"

    return [
        ("plain", shape, {}, {}),
        *((f"head_dim={other.head_dim}", other, {}, {}) for other in (half, three_quarters, one_and_half, double)),
        # multi-head latent attention (DeepSeek-V2/V3): q/k 3D/2, v D (192 / 128 at the default D)
        ("mla", dataclasses.replace(one_and_half, v_head_dim=shape.head_dim), {}, {}),
        ("float32", dataclasses.replace(shape, dtype="float32"), {}, "cuDNN attention has no float32"),
        ("alibi", shape, {"alibi_slopes": 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)}, absent("ALiBi")),
        ("dropout", shape, {"dropout_rate": 0.1, "dropout_rng": jax.random.key(1)}, absent("dropout")),
        ("sink_tokens", shape, {"num_sink_tokens": 4, "sliding_window": args.window}, absent("sink tokens")),
        ("chunked", shape, {"chunk_size": args.chunk}, absent("chunked mask")),
        ("segments", shape, {"segment_ids": segments}, absent("segment ids")),
        ("chunked_documents", shape, {"chunk_size": args.chunk, "segment_ids": segments}, absent("chunked mask")),
        # StreamingLLM's sink tokens of each packed document beside a window
        ("sink_tokens_documents", shape, {"num_sink_tokens": 4, "sliding_window": args.window,
                                          "segment_ids": segments}, absent("sink tokens")),
        ("soft_cap", shape, {"logits_soft_cap": 30.0}, absent("logits soft cap")),
        ("window", shape, {"sliding_window": args.window}, {"local_window_size": (args.window, 0)}),
        ("learnable_sinks", shape, {"sinks": jnp.zeros((heads,), jnp.float32)}, absent("learnable sinks")),
    ]


def visible_fraction(t: int, options: dict) -> float:
    """Visible (query, key) pairs of a causal call with `options` over the causal pairs T(T+1)/2, as the cost
    model counts them (`costs.visible_pairs`: exact, within each document of the first batch row)."""
    from ringjax.dispatch import costs
    from ringjax.options import AttentionOptions, normalize_window

    seg = options.get("segment_ids")
    opts = AttentionOptions(causal=True, window=normalize_window(options.get("sliding_window"), True),
                            chunk_size=options.get("chunk_size"), num_sink_tokens=options.get("num_sink_tokens", 0),
                            has_segments=seg is not None)
    documents = None if seg is None else costs.documents_of(seg[:1], "contiguous", 1)
    return costs.visible_pairs(opts, t, documents) / (t * (t + 1) / 2)


def run_coverage(args, rec: Recorder):
    """Features one at a time on one device, causal, against the plain case (and cuDNN where it has them)."""
    for t in args.seqs:
        features = coverage_features(args.shape, t, args)
        unknown = set(args.features or ()) - {f[0] for f in features}
        if unknown:
            raise SystemExit(f"--features: unknown {sorted(unknown)}; known: {[f[0] for f in features]}")
        wanted = [f for f in features if args.features is None or f[0] in args.features]
        plain = None
        inputs_by_shape = {}
        for name, shape, options, cudnn_options in progress(wanted, f"coverage T={t}"):
            case = {"feature": name, "T": t, "causal": True, **shape.fields()}
            flops = shape.flops(t, True)
            try:
                if shape not in inputs_by_shape:
                    inputs_by_shape[shape] = random_inputs(shape, t)
                inputs = inputs_by_shape[shape]
                reports: list = []
                timing, out = timed(ringjax_attention(args.implementation, True, **options), inputs, flops, args,
                                    reports=reports)
                finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
                del out
            except Exception as e:  # noqa: BLE001 - a feature an implementation refuses is a row, not a crash
                rec.add(case, error=failure(e))
                continue
            extra = (candidates_timed(reports[-1], timing, options, inputs, flops, args)
                     if args.candidates and reports else {})
            if name == "plain":
                plain = timing
            cudnn = ({"skipped": cudnn_options} if isinstance(cudnn_options, str)
                     else timed_other("cudnn", True, inputs, flops, args, **cudnn_options))
            # masks that hide pairs are compared on the work they leave: visible pairs per second
            visible = significant(visible_fraction(t, options), 4)
            vs = {m: (significant(x * visible, 3) if x else None) for m, x in ratios(timing, plain).items()} \
                if plain else None
            rec.add(case, **timing, finite=finite, visible=visible, vs_plain=vs, cudnn=cudnn, **extra)
            base = reports[-1].config if reports else None
            for overrides in args.variant if base is not None else ():
                row_case = {**case, "variant": variant_name(overrides)}
                try:
                    config = dataclasses.replace(base, **overrides)
                    mine, _ = timed(ringjax_attention(args.implementation, True, config=config, **options), inputs,
                                    flops, args)
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                    rec.add(row_case, error=failure(e))
                    continue
                rec.add(row_case, **{**mine, "visible": visible, "vs_default": ratios(mine, timing),
                                     "config": ringjax.config_to_json(config)})
        del inputs_by_shape


PRECISION_IMPLEMENTATIONS = ("xla", "pallas_triton", "auto")


def run_precision(args, rec: Recorder):
    """float32 on one device under each jax matmul precision: ringjax's implementations and
    jax.nn.dot_product_attention, all against jax.nn's XLA attention at "highest"."""
    shape = dataclasses.replace(args.shape, dtype="float32")
    for t in args.seqs:
        inputs = random_inputs(shape, t)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                        implementation="xla"))(*inputs[:3])
        flops = shape.flops(t, True)
        for precision in progress(args.precisions, f"precision T={t}"):
            baseline = None
            for library, implementation in [("jax.nn", None)] + [("ringjax", i) for i in PRECISION_IMPLEMENTATIONS]:
                case = {"library": library, "asked": implementation or "jax.nn", "precision": precision, "T": t,
                        "causal": True, **shape.fields()}
                attn = (ringjax_attention(implementation, True) if library == "ringjax"
                        else lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
                start = time.perf_counter()
                try:
                    with jax.default_matmul_precision(precision):  # read when the calls are traced
                        timing, out = timed(attn, inputs, flops, args)
                except ValueError as e:  # an implementation that refuses this call (dtype, precision, platform)
                    rec.add(case, skipped=" ".join(str(e).split()[-60:]))  # the reason ends the message
                    continue
                except Exception as e:  # noqa: BLE001
                    rec.add(case, error=failure(e))
                    continue
                if library == "jax.nn":
                    timing = {**{k: v for k, v in timing.items() if k != "note"}, "implementation": "jax.nn"}
                    baseline = timing
                vs = ratios(timing, baseline) if baseline and library != "jax.nn" else None
                rec.add(case, **timing, **errors(out, ref), reference="jax.nn xla, highest", vs_jax_nn=vs,
                        wall_s=significant(time.perf_counter() - start, 3))
                del out
        del inputs, ref


def peak_memory(devices) -> dict:
    """Peak bytes in use over `devices` from `memory_stats()`, where the platform reports it."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    if None in peaks:
        return {"peak_gib_per_device": None, "memory_note": f"memory_stats() has no peak on {devices[0].platform}"}
    return {"peak_gib_per_device": round(max(peaks) / 2**30, 2)}


def run_million(args, rec: Recorder):
    """One long causal zigzag fwd+bwd over N devices: seconds, TFLOP/s and peak memory per device. With
    --variant: the config `--implementation` runs by itself, then each variant's, one after the other."""
    shape, n, t = args.shape, args.devices, args.tokens
    mesh = make_mesh((n,), ("sp",))
    case = {"tokens": t, "devices": n, "layout": "zigzag", "causal": True, **shape.fields()}
    base = None
    for overrides in [{}] + args.variant:
        row_case = {**case, "variant": variant_name(overrides)} if args.variant else case
        try:
            inputs = random_inputs(shape, t, NamedSharding(mesh, P(None, "sp")))
            config = dataclasses.replace(base, **overrides) if overrides else None
            fwd, fwd_bwd = attention_fns(sharded_ring(mesh, args.implementation, config=config))
            with ringjax_log() as log:
                start = time.perf_counter()
                jax.block_until_ready(fwd_bwd(*inputs))  # compiles; the first warm-up
                first_s = time.perf_counter() - start
            if args.variant and base is None:
                base = log.reports[-1].config if log.reports else None
                if base is None:
                    raise SystemExit(f"--variant: {args.implementation} logged no config to vary")
            seconds = timeit(fwd_bwd, *inputs, reps=args.reps, warmup=max(0, args.warmup - 1), budget_s=args.budget)
            memory = peak_memory(list(mesh.devices.flat))
            check = {}
            if t <= args.check_max_tokens:  # small enough for one device: the ring's output against it
                one = [natural(x, n) for x in inputs[:3]]
                whole = jax.jit(ringjax_attention(args.implementation, True))(*one)
                check = errors(natural(fwd(*inputs[:3]), n), whole)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory
            rec.add(row_case, error=failure(e))
            continue
        rec.add(row_case, **picked(log), seconds=significant(seconds), first_call_s=significant(first_s, 3),
                tflops_per_device=significant(FWD_BWD * shape.flops(t, True) / n / seconds / 1e12), **memory, **check)
        del inputs, fwd, fwd_bwd


def copy_rate(device, nbytes: int, args) -> float:
    """GB/s of one elementwise pass over `nbytes` on `device`: half read, half written (the HBM copy rate)."""
    x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.bfloat16), device)
    fn = jax.jit(lambda x: x + 1)
    seconds = timeit(fn, x, reps=args.reps, warmup=args.warmup, budget_s=args.budget)
    del x
    return nbytes / seconds / 1e9


def decode_cache(mesh, shape: Shape, batch: int, tokens: int, seed: int = 0):
    """A KVCache of `tokens` random tokens per row, full, made in place on the mesh (no appends)."""
    n = mesh.shape["sp"]
    cache = ringjax.KVCache.create(batch, tokens, shape.kv_heads, shape.head_dim, dtype=shape.dtype, mesh=mesh)
    sharding = cache.k.sharding

    @functools.partial(jax.jit, out_shardings=(sharding, sharding))
    def make(key):
        ka, kb = jax.random.split(key)
        dims = (batch, tokens, shape.kv_heads, shape.head_dim)
        return jax.random.normal(ka, dims, shape.dtype), jax.random.normal(kb, dims, shape.dtype)

    k, v = make(jax.random.key(seed))
    lengths = jax.device_put(jnp.full((batch,), tokens, jnp.int32), cache.lengths.sharding)
    return cache.replace(k=k, v=v, lengths=lengths), n


# decode calls per timed sample, dispatched back to back as a generation loop issues them: a lone call's
# launch and host round trip (~0.1-0.2 ms) would otherwise dominate a 128K-token cache read (~0.2 ms)
DECODE_BACK_TO_BACK = 20


def run_decode(args, rec: Recorder):
    """Decode against a full cache: GB/s of K/V read by ringjax's cache_attention (cache sharded over N
    devices) and by jax.nn.dot_product_attention (xla, cuDNN) on the same data on one device, against
    the HBM copy rate measured here."""
    shape, n = args.shape, args.devices
    mesh = make_mesh((n,), ("sp",))
    copy_gbps = significant(copy_rate(jax.devices()[0], args.copy_bytes, args))
    say(f"HBM copy rate: {copy_gbps} GB/s per device ({args.copy_bytes / 2**30:.3g} GiB read + written)")
    itemsize = jnp.dtype(shape.dtype).itemsize
    for cache_len in args.caches:
        for batch in args.batches:
            try:
                cache, _ = decode_cache(mesh, shape, batch, cache_len)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory
                rec.add({**shape.fields(), "batch": batch, "cache": cache_len, "t": 0,
                         "library": "ringjax", "devices": n}, error=failure(e))
                continue
            kv_bytes = batch * cache_len * shape.kv_heads * 2 * shape.head_dim * itemsize
            for t in args.ts:
                case = {**shape.fields(), "batch": batch, "cache": cache_len, "t": t, "devices": n}
                q = jax.random.normal(jax.random.key(t), (batch, t, shape.heads, shape.head_dim), shape.dtype)

                def row(seconds, **fields):
                    gbps = kv_bytes / seconds / 1e9
                    return dict(ms=significant(seconds * 1e3), gbps=significant(gbps),
                                gbps_per_device=significant(gbps / fields.pop("devices")),
                                of_copy=significant(gbps / fields.pop("over") / copy_gbps), copy_gbps=copy_gbps,
                                **fields)

                ours = None
                for variant in [args.implementation] + (["xla-reduce"] if args.reduce else []):
                    # xla-reduce: the XLA partials with QK and PV as multiply-and-reduce fusions, not dots
                    kw = (dict(implementation="xla", config=XlaCacheConfig(dots=False)) if variant == "xla-reduce"
                          else dict(implementation=variant))
                    mine = {**case, "library": "ringjax", "implementation": variant}
                    try:
                        fn = jax.jit(lambda q, cache, kw=kw: ringjax.cache_attention(q, cache, **kw))
                        out = fn(q, cache)
                        ours = out if ours is None else ours
                        seconds = timeit(fn, q, cache, reps=args.reps, warmup=args.warmup, budget_s=args.budget,
                                         back_to_back=DECODE_BACK_TO_BACK)
                        rec.add(mine, **row(seconds, devices=n, over=n))
                    except Exception as e:  # noqa: BLE001
                        rec.add(mine, error=failure(e))
                # jax.nn on the whole cache on one device (in position order), not causal: for t=1 the same
                # function; for t>1 the same bytes
                device = jax.devices()[0]
                try:
                    k, v = (jax.device_put(x, device) for x in cache.ordered())
                    qd = jax.device_put(q, device)
                except Exception as e:  # noqa: BLE001
                    rec.add({**case, "library": "jax.nn", "devices": 1}, error=failure(e))
                    continue
                for impl in ("xla", "cudnn"):
                    other = {**case, "devices": 1, "library": "jax.nn", "implementation": impl}
                    why = unavailable("cudnn") if impl == "cudnn" else None
                    if why:
                        rec.add(other, skipped=why)
                        continue
                    try:
                        fn = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=impl))
                        out = fn(qd, k, v)
                        seconds = timeit(fn, qd, k, v, reps=args.reps, warmup=args.warmup, budget_s=args.budget,
                                         back_to_back=DECODE_BACK_TO_BACK)
                        check = errors(ours, out) if t == 1 and ours is not None else {}
                        rec.add(other, **row(seconds, devices=1, over=1), **check)
                    except Exception as e:  # noqa: BLE001
                        rec.add(other, error=failure(e))
                del k, v, qd
            del cache


# ----------------------------------------------------------------------------- markdown and plots


def fmt(x) -> str:
    """A table cell: floats to 0.1 from 10 up, else 3 significant digits (ratios, errors); None as a dash."""
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"
    return str(x)


def kilo(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)


def markdown_table(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |" for r in body])


def title(rows: list[dict]) -> str:
    """Where and when: device kind and count, jax and ringjax versions, date, shape."""
    r = rows[-1]
    case = next((x["case"] for x in rows if x["case"].get("feature", "plain") == "plain"), r["case"])
    shape = Shape.of_row(case).describe()
    runs = sorted({x.get("options", {}).get("back_to_back") or 1 for x in rows})
    floors = sorted({x.get("options", {}).get("sample_ms") or 0 for x in rows} - {0})
    parts = ([] if runs == [1] else [f"timed {' / '.join(map(str, runs))} calls back to back per sample"]) + (
        [f"samples of at least {' / '.join(f'{f:g}' for f in floors)} ms"] if floors else [])
    timing = "; " + ", ".join(parts) if parts else ""
    return (f"**{r['device_kind']} x{r['device_count']}**, jax {r['jax']}, ringjax {r['ringjax']}, "
            f"{r['time'][:10]} (UTC); {shape}{timing}")


def footnotes(rows: list[dict], what: str) -> list[str]:
    """One line per distinct skip or failure, with how many cases it hit."""
    seen: dict[str, int] = {}
    for r in rows:
        for source, fields in ((r["case"].get(what, ""), r), ("cuDNN", r.get("cudnn") or {})):
            for kind in ("skipped", "error", "fwd_bwd_error"):
                if fields.get(kind):
                    line = f"{source} {kind.replace('_', ' ')}: {fields[kind]}".strip()
                    seen[line] = seen.get(line, 0) + 1
    return [f"- {line}" + (f" ({n} cases)" if n > 1 else "") for line, n in seen.items()]


def tflops(fields: dict, mode: str):
    return fields.get(f"{mode}_tflops") if fields else None


def table_step(rows):
    cudnn = {(r["case"]["T"], r["case"]["causal"]): r for r in rows if r["case"]["library"] == "cudnn"}
    body = []
    for r in rows:
        c = r["case"]
        if "fwd_tflops" not in r:
            continue
        base = cudnn.get((c["T"], c["causal"]), {})
        vs = [tflops(r, m) / tflops(base, m) if tflops(r, m) and tflops(base, m) else None for m in ("fwd", "fwd_bwd")]
        library = c["library"] + (f" [{c['variant']}]" if "variant" in c else "")
        library += f" [deterministic={c['deterministic']}]" if "deterministic" in c else ""
        body.append([kilo(c["T"]), "yes" if c["causal"] else "no", library, r.get("implementation", "—"),
                     r.get("fwd_tflops"), r.get("fwd_bwd_tflops"), r.get("bwd_tflops"), r.get("fwd_ms"),
                     r.get("fwd_bwd_ms"), vs[0], vs[1], r.get("rel_err")])
    return markdown_table(["T", "causal", "library", "implementation", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
                           "bwd TFLOP/s", "fwd ms", "fwd+bwd ms", "fwd vs cuDNN", "fwd+bwd vs cuDNN", "rel err"],
                          body)


def copies_ms(row, mode: str):
    """Time the ring's K/V copies take at the chip's measured ppermute rate, hidden or not: N - 1 shards' K/V
    forward; fwd+bwd also their K/V and float32 dK/dV again. None where the chip has no measured rate."""
    from ringjax.strategies import plan

    chip, n = plan.chip_for(row.get("device_kind", "")), row["case"]["devices"]
    shift = chip.collective("ppermute") if chip is not None else None
    if shift is None:
        return None
    moved = row["kv_bytes_per_step"] + (row["kv_bytes_per_step_bwd"] if mode == "fwd_bwd" else 0)
    return round(1e3 * shift.seconds((n - 1) * moved), 3)


def over_split_ms(row, timing: dict, mode: str):
    """A ring's time over a perfect split of the one-device time (one device's / N): what its copies did not
    hide, with its launches, merges and imbalance."""
    ring_ms, one_ms = timing.get(f"{mode}_ms"), row["one_device"].get(f"{mode}_ms")
    return round(ring_ms - one_ms / row["case"]["devices"], 3) if ring_ms and one_ms else None


def table_ring(rows):
    fused = any("fused" in r for r in rows)  # runs with --fused
    by_gpu = any("slowest_one_device" in r for r in rows)
    body = []
    for r in rows:
        if "ring" not in r:
            continue
        c, vs_own, vs_cudnn = r["case"], r["ring_over_one_device"], r["ring_over_cudnn"]
        body.append([c["devices"], kilo(c["tokens_per_device"]), kilo(c["T"]), r["implementation"],
                     tflops(r["ring"], "fwd"), tflops(r["ring"], "fwd_bwd"), tflops(r["one_device"], "fwd"),
                     tflops(r["one_device"], "fwd_bwd"), tflops(r["cudnn"], "fwd"), tflops(r["cudnn"], "fwd_bwd"),
                     vs_own["fwd"], vs_own["fwd_bwd"], vs_cudnn["fwd"], vs_cudnn["fwd_bwd"],
                     r["kv_bytes_per_step"] / 2**20, r["kv_bytes_per_step_bwd"] / 2**20,
                     copies_ms(r, "fwd"), copies_ms(r, "fwd_bwd"), over_split_ms(r, r["ring"], "fwd"),
                     over_split_ms(r, r["ring"], "fwd_bwd"), r.get("rel_err")])
        if fused:
            f, f_own = r.get("fused") or {}, r.get("fused_over_one_device") or {}
            body[-1] += [tflops(f, "fwd") if f else "—", tflops(f, "fwd_bwd") if f else "—", f_own.get("fwd"),
                         f_own.get("fwd_bwd"), over_split_ms(r, f, "fwd") if f else "—",
                         over_split_ms(r, f, "fwd_bwd") if f else "—"]
        if by_gpu:  # the one-GPU baseline timed on every GPU of the ring (rows since 2026-11-27)
            worst = r.get(f"{'fused' if fused else 'ring'}_over_slowest_one_device") or {}
            body[-1] += [worst.get("fwd"), worst.get("fwd_bwd")]
    head = ["devices", "tokens/device", "total T", "implementation", "ring fwd TFLOP/s/device", "ring fwd+bwd",
            "one device fwd", "one device fwd+bwd", "cuDNN fwd", "cuDNN fwd+bwd", "ring/one fwd", "ring/one fwd+bwd",
            "ring/cuDNN fwd", "ring/cuDNN fwd+bwd", "K/V MiB per step fwd", "bwd", "copies ms fwd",
            "copies ms fwd+bwd", "ring over split ms fwd", "ring over split ms fwd+bwd", "rel err vs one device"]
    if fused:
        head += ["fused fwd", "fused fwd+bwd", "fused/one fwd", "fused/one fwd+bwd", "fused over split ms fwd",
                 "fused over split ms fwd+bwd"]
    if by_gpu:
        which = "fused" if fused else "ring"
        head += [f"{which}/slowest GPU fwd", f"{which}/slowest GPU fwd+bwd"]
    return markdown_table(head, body)


def table_strategies(rows):
    against_one = any("over_one_device" in r for r in rows)
    body = []
    for r in rows:
        c = r["case"]
        if "fwd_tflops" not in r:
            continue
        strategy = c["strategy"] + (f" → {r['chosen']}" if r.get("chosen") else "")
        body.append([kilo(c["tokens_per_device"]), f"{c['heads']}/{c['kv_heads']}", strategy,
                     r.get("implementation"), r.get("fwd_ms"), r.get("fwd_tflops"), r.get("fwd_bwd_ms"),
                     r.get("fwd_bwd_tflops"), r.get("rel_err_vs_ring")])
        if against_one:  # rows since 2026-11-27 evening
            one, worst = r.get("over_one_device") or {}, r.get("over_slowest_one_device") or {}
            body[-1] += [one.get("fwd"), one.get("fwd_bwd"), worst.get("fwd"), worst.get("fwd_bwd")]
    return markdown_table(["tokens/device", "heads q/kv", "strategy", "implementation", "fwd ms",
                           "fwd TFLOP/s/device", "fwd+bwd ms", "fwd+bwd TFLOP/s/device", "rel err vs ring"]
                          + (["/ one GPU fwd", "/ one GPU fwd+bwd", "/ slowest GPU fwd", "/ slowest GPU fwd+bwd"]
                             if against_one else []), body)


def table_coverage(rows):
    judged = any("auto_vs_fastest" in r for r in rows)  # runs with --candidates
    body = []
    for r in rows:
        c = r["case"]
        feature = c["feature"] + (f" [{c['variant']}]" if "variant" in c else "")  # --variant: vs the config above
        if "fwd_tflops" not in r:
            body.append([kilo(c["T"]), feature, "failed (below)"] + ["—"] * (9 if judged else 7))
            continue
        vs = r.get("vs_plain") or r.get("vs_default") or {}
        body.append([kilo(c["T"]), feature, r.get("implementation"), r.get("fwd_tflops"),
                     r.get("fwd_bwd_tflops"), r.get("visible", "—"), vs.get("fwd"), vs.get("fwd_bwd"),
                     tflops(r.get("cudnn"), "fwd"), tflops(r.get("cudnn"), "fwd_bwd")]
                    + ([r.get("auto_vs_fastest", "—"), r.get("predicted_error", "—")] if judged else []))
    return markdown_table(["T", "feature", "implementation", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "visible",
                           "fwd vs plain", "fwd+bwd vs plain", "cuDNN fwd", "cuDNN fwd+bwd"]
                          + (["auto / fastest", "predicted err"] if judged else []), body)


def table_precision(rows):
    body = []
    for r in rows:
        c = r["case"]
        if "fwd_tflops" not in r:
            body.append([kilo(c["T"]), c["precision"], c["asked"], "skipped (below)" if "skipped" in r else "failed"]
                        + ["—"] * 6)
            continue
        vs = r.get("vs_jax_nn") or {}
        body.append([kilo(c["T"]), c["precision"], c["asked"], r.get("implementation"), r.get("fwd_tflops"),
                     r.get("fwd_bwd_tflops"), vs.get("fwd"), vs.get("fwd_bwd"), r.get("rel_err"), r.get("wall_s")])
    return markdown_table(["T", "precision", "asked", "ran", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "fwd vs jax.nn",
                           "fwd+bwd vs jax.nn", "rel err", "wall s"], body)


def table_million(rows):
    body = [[kilo(r["case"]["tokens"]), r["case"]["devices"], r.get("implementation"), r.get("seconds"),
             r.get("tflops_per_device"), r.get("peak_gib_per_device"), r.get("rel_err")]
            for r in rows if "seconds" in r]
    return markdown_table(["tokens", "devices", "implementation", "fwd+bwd s", "TFLOP/s per device",
                           "peak GiB per device", "rel err vs one device"], body)


def table_decode(rows):
    body = [[c["batch"], kilo(c["cache"]), c["t"], c["library"], c.get("implementation"), c["devices"], r.get("ms"),
             r.get("gbps"), r.get("gbps_per_device"), r.get("of_copy"), r.get("rel_err")]
            for r in rows if "ms" in r for c in (r["case"],)]
    return markdown_table(["batch", "cache", "t", "library", "implementation", "devices", "ms", "GB/s",
                           "GB/s per device", "of HBM copy", "rel err (t=1)"], body)


def table_prefill(rows):
    body = [[c["batch"], kilo(c["cached"]), kilo(c["t"]), c["implementation"], r.get("implementation"),
             c["strategy"], c["devices"], r.get("ms"), r.get("tflops_per_device"), r.get("rel_err_vs_xla")]
            for r in rows if "ms" in r for c in (r["case"],)]
    return markdown_table(["batch", "cached", "t", "implementation=", "ran", "strategy", "devices", "ms",
                           "TFLOP/s per device", "rel err vs xla"], body)


def render(suite: str, rows: list[dict]) -> str:
    """The markdown of one suite's rows from one device kind: a title line, the table, skips and failures."""
    notes = footnotes(rows, SUITES[suite].label)
    head = [title(rows), "", SUITES[suite].caption, ""]
    return "\n".join(head + [SUITES[suite].table(rows)] + ([""] + notes if notes else []))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def bars(path: Path, heading: str, groups: list[str], series: dict[str, list], ylabel: str,
         ratio: bool = False) -> bool:
    """A grouped bar chart: one group per label, one bar per series (None draws nothing).

    `ratio`: values are ratios to a baseline, drawn on a log axis with a line at 1.
    """
    plt = _pyplot()
    if plt is None or not groups:
        return False
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.0, 0.6 * len(groups) * len(series) ** 0.5 + 2)), 4.2))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], [v or math.nan for v in values], width, label=name)
    if ratio:
        ax.set_yscale("log")
        ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(heading, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_step(rows, path, heading):
    cases = sorted({(r["case"]["T"], r["case"]["causal"]) for r in rows}, key=lambda c: (c[0], not c[1]))
    groups = [(t, c, m) for t, c in cases for m in MODES]
    series = {}
    for lib in dict.fromkeys(r["case"]["library"] for r in rows if "fwd_tflops" in r):
        by = {(r["case"]["T"], r["case"]["causal"]): r for r in rows if r["case"]["library"] == lib}
        series[lib] = [tflops(by.get((t, c)), m) for t, c, m in groups]
    labels = [f"{kilo(t)} {'causal' if c else 'full'}\n{MODE_NAMES[m]}" for t, c, m in groups]
    return bars(path, heading, labels, series, "TFLOP/s")


def plot_ring(rows, path, heading):
    plt = _pyplot()
    rows = [r for r in rows if "ring" in r]
    if plt is None or not rows:
        return False
    x = [r["case"]["tokens_per_device"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
        for key, label in (("ring", "ring, per device"), ("fused", "fused ring (fused=True), per device"),
                           ("one_device", "ringjax, one device"), ("cudnn", "cuDNN, one device")):
            ys = [tflops(r[key], mode) if r.get(key) else None for r in rows]
            if any(ys):
                ax.plot(x, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [kilo(t) for t in x])
        ax.minorticks_off()
        ax.set_xlabel("tokens per device (one device: the same total)")
        ax.set_title(MODE_NAMES[mode], fontsize=9)
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_strategies(rows, path, heading):
    rows = [r for r in rows if "fwd_tflops" in r]
    groups = list(dict.fromkeys((r["case"]["tokens_per_device"], r["case"]["kv_heads"]) for r in rows))
    series = {}
    for strategy in dict.fromkeys(r["case"]["strategy"] for r in rows):
        by = {(r["case"]["tokens_per_device"], r["case"]["kv_heads"]): r for r in rows
              if r["case"]["strategy"] == strategy}
        series[strategy] = [r.get("fwd_bwd_tflops") if (r := by.get(g)) else None for g in groups]
    labels = [f"{kilo(tp)}/device\n{kvh} kv heads" for tp, kvh in groups]
    return bars(path, heading, labels, series, "fwd+bwd TFLOP/s per device")


def plot_coverage(rows, path, heading):
    rows = [r for r in rows if r.get("vs_plain")]
    features = list(dict.fromkeys(r["case"]["feature"] for r in rows))
    series = {}
    for t in dict.fromkeys(r["case"]["T"] for r in rows):
        by = {r["case"]["feature"]: r["vs_plain"] for r in rows if r["case"]["T"] == t}
        for mode in ("fwd", "fwd_bwd"):
            series[f"{kilo(t)} {MODE_NAMES[mode]}"] = [by.get(f, {}).get(mode) for f in features]
    return bars(path, heading, [f.replace("_", "\n") for f in features], series, "TFLOP/s over plain", ratio=True)


def replace_marked(text: str, suite: str, body: str) -> str:
    """`text` with what lies between `<!-- bench:SUITE:begin -->` and `<!-- bench:SUITE:end -->` set to `body`.

    The marker lines stay; ValueError if either is missing or they are out of order.
    """
    begin, end = f"<!-- bench:{suite}:begin -->", f"<!-- bench:{suite}:end -->"
    i = text.find(begin)
    j = text.find(end, i + len(begin)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise ValueError(f"no {begin} ... {end} markers")
    start = text.find("\n", i) + 1  # the line after the begin marker
    if start == 0 or start > j:
        raise ValueError(f"{begin} and {end} must be on lines of their own")
    end_line = text.rfind("\n", 0, j) + 1  # the end marker's line, indentation included
    return text[:start] + body.strip("\n") + "\n" + text[end_line:]


def run_report(args) -> int:
    """Markdown of the newest results per suite and device kind (README with --write-readme), and plots."""
    results = newest_results(args.out)
    if not results:
        print(f"no results under {args.out}", file=sys.stderr)
        return 1
    sections: dict[str, list[str]] = {}
    known = [(key, found) for key, found in results.items() if key[0] in SUITES and found[1]]
    for (suite, _device), (path, rows) in sorted(known, key=lambda kv: (list(SUITES).index(kv[0][0]), kv[0][1])):
        sections.setdefault(suite, []).append(render(suite, rows))
        plot = SUITES[suite].plot
        if plot is not None and not args.no_plots:
            png = path.with_suffix(".png")
            if plot(rows, png, title(rows).replace("**", "").replace("; ", "\n")):
                print(f"wrote {png}", file=sys.stderr)
    if args.write_readme:
        text = args.readme.read_text()
        for suite, parts in sections.items():
            try:
                text = replace_marked(text, suite, "\n\n".join(parts))
            except ValueError as e:
                print(f"{args.readme}: {suite}: {e}; left as it was", file=sys.stderr)
        args.readme.write_text(text)
        print(f"updated {args.readme}", file=sys.stderr)
    else:
        for suite, parts in sections.items():
            print(f"<!-- bench:{suite}:begin -->\n" + "\n\n".join(parts) + f"\n<!-- bench:{suite}:end -->\n")
    return 0


# ----------------------------------------------------------------------------- command line


@dataclasses.dataclass(frozen=True)
class Suite:
    run: object
    table: object
    plot: object
    help: str
    caption: str  # under each table: what its numbers count
    label: str  # the case field that names a row in footnotes
    devices: str  # "one" or "all": how many local devices a run uses by default
    defaults: dict  # suite options: full size, then --tiny
    tiny: dict


COUNT = "TFLOP/s: 4·B·H·T²·D forward (half when causal), ×3.5 fwd+bwd, ×2.5 bwd (fwd+bwd time − fwd time)"
SUITES = {
    "step": Suite(
        run_step, table_step, plot_step, help="one device: ringjax vs cuDNN vs tokamax, fwd, fwd+bwd, bwd",
        caption=f"{COUNT}; median of --reps calls. rel err: ringjax's output against XLA in float32 where its "
                "T×T scores fit (≤ 8K at these shapes), else against cuDNN.",
        label="library", devices="one", defaults={"seqs": [8192, 32768]}, tiny={"seqs": [256]}),
    "ring": Suite(
        run_ring, table_ring, plot_ring, help="the zigzag ring over all local devices vs the same work on one device",
        caption=f"Causal, zigzag layout. {COUNT}, per device over the total T. \"one device\": ringjax "
                "(axis_name=None) and cuDNN on the whole sequence. K/V per step: one shard's K and V (forward); "
                "K, V and the float32 dK, dV accumulators (backward). copies ms: the time those bytes of N - 1 "
                "shards take at the chip's measured ppermute rate; over split ms: the ring's time minus one "
                "device's / N, what the ring did not hide (its copies, launches, merges and imbalance): where it "
                "is below the copies' time, the rest was hidden.",
        label="devices", devices="all", defaults={"tokens_per_device": [4096, 8192, 16384, 32768]},
        tiny={"tokens_per_device": [64, 128]}),
    "strategies": Suite(
        run_strategies, table_strategies, plot_strategies,
        help="strategy ring | all_gather | ulysses | hybrid | auto over all local devices",
        caption=f"{COUNT}, per device over the total T. hybrid: ulysses over 2 devices x ring over N/2. "
                "auto → what strategy=\"auto\" chose. rel err: the output against the ring's.",
        label="strategy",
        devices="all", defaults={"tokens_per_device": [8192, 32768], "mha": True},
        tiny={"tokens_per_device": [64], "mha": False}),
    "coverage": Suite(
        run_coverage, table_coverage, plot_coverage,
        help="features (ALiBi, dropout, windows, ...) against the plain case on one device",
        caption="Causal, one device. TFLOP/s counts the dense causal work at each row's head_dim, so masks that "
                "hide more (window, chunked, segments, sink tokens) read above plain; visible: the fraction of the "
                "causal (query, key) pairs the mask leaves; vs plain: visible pairs per second over the plain "
                "row's (TFLOP/s ratio times visible). implementation: what implementation=\"auto\" ran.",
        label="feature",
        devices="one", defaults={"seqs": [8192, 32768], "window": 1024, "chunk": 2048},
        tiny={"seqs": [256], "window": 64, "chunk": 64}),
    "precision": Suite(
        run_precision, table_precision, None,
        help="float32 under jax's matmul precisions: xla, pallas_triton, auto and jax.nn on one device",
        caption=f"float32, causal, one device. {COUNT}. precision: `jax.default_matmul_precision` around the "
                "call (default: TF32 on GPUs; highest: full float32). rel err: the output against "
                "jax.nn's XLA attention at highest. wall s: the row's measurement, compiles included.",
        label="asked", devices="one", defaults={"seqs": [8192], "precisions": ["default", "highest"]},
        tiny={"seqs": [256]}),
    "million": Suite(
        run_million, table_million, None,
        help="1M tokens causal zigzag fwd+bwd over all local devices: seconds, TFLOP/s, memory",
        caption=f"Causal, zigzag layout, one forward+backward. {COUNT}, per device. Peak memory: the largest "
                "peak_bytes_in_use of memory_stats() over the devices.",
        label="tokens",
        devices="all", defaults={"tokens": 1 << 20, "reps": 1, "warmup": 1, "back_to_back": 1},
        tiny={"tokens": 2048}),
    "prefill": Suite(
        run_prefill, table_prefill, None,
        help="prefill a chunk of t tokens after t cached ones: cache_attention pass_q / pass_kv on the kernels "
             "and on the XLA partials, over all local devices",
        caption="Causal; a row's chunk of t queries attends to the t cached tokens and to itself (t² + t(t+1)/2 "
                "pairs). TFLOP/s: 4·B·H·D per visible pair over the median time, per device. ran: what "
                "implementation=\"auto\" ran. rel err: the output against the XLA partials' pass_q.",
        label="implementation", devices="all", defaults={"chunks": [16384, 32768]}, tiny={"chunks": [64]}),
    "decode": Suite(
        run_decode, table_decode, None,
        help="decode against a full KV cache: GB/s of K/V read, ringjax (cache over all local devices) vs "
             "jax.nn xla / cuDNN (one device), against the HBM copy rate",
        caption="One cache_attention call per row against a full cache (causal); jax.nn.dot_product_attention on "
                "the same K/V on one device, not causal (the same function at t=1, the same bytes at t>1). GB/s: "
                "K and V bytes of the cache over the median time; of HBM copy: GB/s per device over the rate of "
                "one elementwise pass (read + write) measured in the same process. rel err: ringjax against "
                "jax.nn xla at t=1.",
        label="library", devices="all",
        defaults={"batches": [1, 8], "caches": [1 << 17, 1 << 20], "ts": [1, 4], "copy_bytes": 4 << 30},
        tiny={"batches": [1, 2], "caches": [256, 512], "ts": [1, 4], "copy_bytes": 8 << 20}),
}
SHAPE = {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "reps": 10, "warmup": 2}
TINY_SHAPE = {"batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 32, "dtype": "bfloat16", "reps": 2, "warmup": 1}


def ints(text: str) -> list[int]:
    """Comma-separated positive ints (argparse type)."""
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def at_least(kind, low, what: str):
    """An argparse type: `kind(text)`, refused below `low` as "expected `what`"."""

    def parse(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


POSITIVE_INT, COUNT_INT = at_least(int, 1, "an integer >= 1"), at_least(int, 0, "an integer >= 0")


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--implementation", default="auto",
                        help="ringjax implementation: auto (default) or a registered name such as pallas_mosaic_gpu, "
                             "pallas_triton, xla (see `python -m ringjax implementations`)")
    common.add_argument("--reps", type=POSITIVE_INT,
                        help="timed calls per measurement, median kept (default 10; --tiny 2)")
    common.add_argument("--warmup", type=COUNT_INT, help="untimed calls first, the compiling one included (default 2; "
                                                   "--tiny 1)")
    common.add_argument("--budget", type=at_least(float, 0.0, "seconds >= 0"), default=10.0,
                        help="seconds of timed calls per measurement: slow cases get fewer reps (default 10)")
    common.add_argument("--back-to-back", type=POSITIVE_INT,
                        help="calls per timed sample, dispatched without a host sync between them as a training "
                             "loop runs them; the time per call is kept (default 5; million and --tiny 1). 1 syncs "
                             "every call, which adds the host's dispatch and wait (about 0.2 ms on an H200) to it")
    common.add_argument("--sample-ms", type=at_least(float, 0.0, "milliseconds >= 0"),
                        help="shortest timed sample: where --back-to-back calls take less, a sample takes as many "
                             "calls as last this long, so that its one wait and first dispatch (about 0.4 ms on an "
                             "H200) weigh little on short calls (default 20; --tiny 0, which keeps --back-to-back)")
    common.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    common.add_argument("--tiny", action="store_true",
                        help="CPU smoke sizes: T=256, 4 q / 2 kv heads, head_dim 32; seconds per suite")
    common.add_argument("--tag", default="", help="free text stored in every row")
    shape = common.add_argument_group("shape (default bf16, batch 1, 32 q / 8 kv heads, head_dim 128)")
    for flag, kind in (("--batch", int), ("--heads", int), ("--kv-heads", int), ("--head-dim", int), ("--dtype", str)):
        shape.add_argument(flag, type=kind)
    shape.add_argument("--v-head-dim", type=POSITIVE_INT,
                       help="v's head_dim where it differs from q's and k's (step only; e.g. --head-dim 192 "
                            "--v-head-dim 128, multi-head latent attention)")
    multi = argparse.ArgumentParser(add_help=False)
    multi.add_argument("--devices", type=POSITIVE_INT, help="local devices to use (default: all)")

    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, suite in SUITES.items():
        s = sub.add_parser(name, help=suite.help, description=suite.help,
                           parents=[common] + ([multi] if suite.devices == "all" else []))
        if "seqs" in suite.defaults:
            s.add_argument("--seqs", type=ints, help=f"sequence lengths (default {suite.defaults['seqs']})")
        if "tokens_per_device" in suite.defaults:
            s.add_argument("--tokens-per-device", type=ints,
                           help=f"tokens per device (default {suite.defaults['tokens_per_device']})")
        if name in ("step", "million", "coverage"):
            s.add_argument("--variant", type=config_overrides, action="append", default=[],
                           metavar="KEY=VALUE[,...]",
                           help="A/B configs: also time --implementation's config with these fields replaced "
                                "(repeatable; e.g. --implementation pallas_mosaic_gpu --variant persistent=false); "
                                "rows carry 'variant' (step: and 'round'), and are meant for --out "
                                "benchmarks/results/checks")
        if name == "step":
            s.add_argument("--deterministic", type=deterministic_levels, default=[False],
                           help="ringjax's deterministic levels to time, comma-separated: false, true, invariant "
                                "(default false)")
            s.add_argument("--rounds", type=POSITIVE_INT, default=2,
                           help="with --variant: interleaved rounds of the default and every variant (default 2)")
            s.add_argument("--masks", choices=tuple(STEP_MASKS), default="both",
                           help="the causal cases, the full (not causal) ones, or both (default)")
        if name == "ring":
            s.add_argument("--fused", action="store_true",
                           help="also the fused ring (Mosaic GPU, MosaicGpuConfig(fused=True)): the forward and the "
                                "backward's dK/dV as one kernel each that copies K/V (and dK/dV) between GPUs itself")
        if name == "strategies":
            s.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "striped"))
            s.add_argument("--no-mha", dest="mha", action="store_false", default=None,
                           help="only the GQA case of --kv-heads, not also MHA (the default with --tiny)")
            s.add_argument("--no-causal", dest="causal", action="store_false")
        if name == "coverage":
            s.add_argument("--features", type=lambda x: x.split(","),
                           help="comma-separated subset of plain, head_dim=<D/2>, head_dim=<3D/4>, head_dim=<3D/2>, "
                                "head_dim=<2D>, mla (q/k 3D/2, v D), float32, alibi, dropout, sink_tokens, chunked, "
                                "segments, chunked_documents, sink_tokens_documents, soft_cap, window, learnable_sinks "
                                "(default: all)")
            s.add_argument("--window", type=int, help="sliding window of 'window', 'sink_tokens' and "
                                                      "'sink_tokens_documents' (default 1024)")
            s.add_argument("--chunk", type=int, help="chunk_size of 'chunked' and 'chunked_documents' (default 2048)")
            s.add_argument("--candidates", action="store_true",
                           help="also time every implementation 'auto' could have run, beside its predicted "
                                "time: is auto the fastest, and how far off are the predictions")
        if name == "precision":
            s.add_argument("--precisions", type=lambda x: x.split(","),
                           help="comma-separated jax matmul precisions (default default,highest; also e.g. "
                                "tensorfloat32, F32_F32_F32)")
        if name == "decode":
            s.add_argument("--batches", type=ints, help="batch sizes (default 1,8)")
            s.add_argument("--caches", type=ints, help="cache lengths in tokens (default 131072,1048576)")
            s.add_argument("--ts", type=ints, help="query tokens per call (default 1,4)")
            s.add_argument("--copy-bytes", type=int, help="bytes of the HBM copy measurement (default 4 GiB)")
            s.add_argument("--no-reduce", dest="reduce", action="store_false",
                           help="skip the xla-reduce rows (XlaCacheConfig(dots=False))")
        if name == "prefill":
            s.add_argument("--chunks", type=ints, help="chunk lengths t, after as many cached tokens (default "
                                                       "16384,32768)")
        if name == "million":
            s.add_argument("--tokens", type=int, help="total tokens (default 1048576)")
            s.add_argument("--check-max-tokens", type=int, default=32768,
                           help="compare with one device up to this many tokens (default 32768)")
    report = sub.add_parser("report", help="tables (README with --write-readme) and plots from the newest results",
                            description="Render the newest results per suite and device kind under --out: markdown "
                                        "to stdout (or into README.md between <!-- bench:SUITE:begin/end --> "
                                        "markers) and a PNG beside each results file.")
    report.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    report.add_argument("--write-readme", action="store_true", help="write the tables into the README's markers")
    report.add_argument("--readme", type=Path, default=ROOT / "README.md")
    report.add_argument("--no-plots", action="store_true")
    return p


# calls per timed sample unless --back-to-back says otherwise: synced one by one, the host's wait (about 0.2 ms a
# call on an H200, 2026-11-29) read as kernel time, two fifths of an 8K masked forward
DEFAULT_BACK_TO_BACK = 5
# and at least this many milliseconds per sample (`common.timeit`): 5 back to back still read an 8K windowed forward
# 28% above its kernels' time on the GPU's timeline, 25 read it 7% above (1 H200, jax 0.11.2, 2026-12-03)
SAMPLE_MS = 20.0


def resolve(args) -> argparse.Namespace:
    """Fill options left unset from the suite's defaults (--tiny's where given) and build args.shape."""
    suite = SUITES[args.suite]
    timing = {"back_to_back": 1 if args.tiny else DEFAULT_BACK_TO_BACK, "sample_ms": 0.0 if args.tiny else SAMPLE_MS}
    for key, value in {**SHAPE, **timing, **suite.defaults, **(TINY_SHAPE | suite.tiny if args.tiny else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if getattr(args, "v_head_dim", None) is not None and args.suite != "step":
        raise SystemExit(f"--v-head-dim: only the step suite takes it (coverage has its 'mla' row), not {args.suite}")
    args.shape = Shape(args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype,
                       getattr(args, "v_head_dim", None))
    if getattr(args, "variant", None) and args.implementation == "auto":
        raise SystemExit("--variant needs --implementation naming the implementation whose config it varies")
    available = jax.local_device_count()
    args.devices = 1 if suite.devices == "one" else (args.devices or available)
    if args.devices > available:
        raise SystemExit(f"--devices {args.devices}: only {available} local devices")
    return args


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.suite == "report":
        return run_report(args)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast is off on the lent GPU machines
    args = resolve(args)
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "shape"}
    rec = Recorder(args.suite, args.out, args.devices, options, tag=args.tag, say=say)
    say(f"{args.suite}: {jax.devices()[0].device_kind} x{args.devices}, jax {jax.__version__}, "
        f"ringjax {ringjax.__version__}; {args.shape.describe()} -> {rec.path}")
    SUITES[args.suite].run(args, rec)
    if rec.rows:
        say("\n" + render(args.suite, rec.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

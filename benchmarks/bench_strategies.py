"""Context-parallel strategies on the GPUs of one host, beside the cost model's prediction.

    python benchmarks/bench_strategies.py --out results/            # every visible GPU
    python benchmarks/bench_strategies.py --devices 2 --tokens 8192 --kv-heads 8 --modes fwd

Every case compiles its own kernels; to stay within a 10-minute device call, run one
--tokens value per call (and --layout contiguous as a second pass).

For each tokens-per-GPU (default 8K and 32K) and head count (MHA 32/32 and GQA 32/8), bf16,
batch 1, head_dim 128, causal (zigzag unless --layout): every strategy (ring, all_gather,
ulysses, and hybrid with a 2 x N/2 mesh from 4 GPUs) forward and forward+backward, each
checked once against the ring's output, then what strategy="auto" picks with the cost model
alone (autotune="off") and by measurement (autotune="on"). TFLOP/s per GPU counts the causal
half of 4*B*H*T*T*D over the whole sequence T for the forward and 3.5x that for forward+backward;
ms is the median of --reps runs after warm-up, each timed around block_until_ready. Writes
strategies_<tag>.json (one JSON line per row, as it goes) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax import autotuning, plan, registry

from common import attention_flops, timeit  # benchmarks/ is on sys.path when a script runs

B, H, D = 1, 32, 128
DT = jnp.bfloat16


def flops(total_t, causal, bwd):
    return attention_flops(B, H, total_t, D, causal, bwd)


def mesh_for(strategy, n):
    devices = np.array(jax.devices()[:n])
    if strategy == "hybrid":
        return Mesh(devices.reshape(2, n // 2), ("hp", "sp")), ("hp", "sp")
    return Mesh(devices, ("sp",)), "sp"


def inputs(total_t, kv_heads, mesh, axis, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    spec = NamedSharding(mesh, P(None, axis))
    shapes = [(B, total_t, H, D), (B, total_t, kv_heads, D), (B, total_t, kv_heads, D), (B, total_t, H, D)]
    return [jax.device_put(jax.random.normal(key, shape, DT), spec) for key, shape in zip(keys, shapes)]


def functions(strategy, axis, mesh, args, autotune="off"):
    """(fwd, fwd+bwd) jitted, global arrays under `mesh`."""

    def attn(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name=axis, mesh=mesh, causal=args.causal, layout=args.layout,
                                      strategy=strategy, implementation=args.implementation, autotune=autotune)

    def loss(q, k, v, do):
        return (attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)).sum()

    return jax.jit(attn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


_ROWS = []
_STREAM = []


def record(**row):
    _ROWS.append(row)
    for f in _STREAM:
        f.write(json.dumps(row) + "\n")
        f.flush()
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def predicted(n, tokens, kv_heads, args):
    """{strategy: StrategyCost} from the cost model for this machine (None where it has no figures)."""
    chip = plan.chip_for(registry.current_device_kind())
    if chip is None:
        return {}, None
    hybrid = (2, n // 2) if n >= 4 and n % 2 == 0 else None
    costs = plan.strategy_costs(chip, devices=n, seq_len=n * tokens, heads=H, kv_heads=kv_heads, head_dim=D,
                                causal=args.causal, layout=args.layout, hybrid=hybrid)
    return {c.strategy: c for c in costs}, plan.best_strategy(costs).strategy


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def auto_choice(n, tokens, kv_heads, args, autotune):
    """What strategy="auto" runs for this call, and why (from the "ringjax.strategy" log).

    Asks the strategy chooser directly, so autotune="on" measures the strategies (with cached or
    heuristic kernel configs) without also tuning the kernels' configs, as a call would.
    """
    from ringjax import strategies
    from ringjax.options import make_options

    opts = make_options(jnp.zeros((1, 1, 1, D), DT), causal=args.causal, sliding_window=None, softmax_scale=None,
                        logits_soft_cap=None, layout=args.layout, axis_name=None, axis_size=n, has_segments=False,
                        has_sinks=False)
    base = registry.Problem(opts=opts, batch=B, seq=tokens, heads=H, kv_heads=kv_heads, head_dim=D, dtype="bfloat16",
                            platform=registry.current_platform())
    logger = logging.getLogger("ringjax.strategy")
    handler = _Capture()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        strategy = strategies.choose(base, "sp", {"sp": n}, implementation=args.implementation, autotune=autotune)
    finally:
        logger.removeHandler(handler)
    return strategy.name, handler.messages[-1] if handler.messages else "no choice logged"


def run(args):
    n = args.devices or len(jax.devices())
    strategies = [s for s in args.strategies.split(",") if s != "hybrid" or (n >= 4 and n % 2 == 0)]
    modes = args.modes.split(",")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for kv_heads in (int(h) for h in args.kv_heads.split(",")):
            total = n * tokens
            costs, model_pick = predicted(n, tokens, kv_heads, args)
            reference = None
            for strategy in strategies:
                mesh, axis = mesh_for(strategy, n)
                q, k, v, do = inputs(total, kv_heads, mesh, axis)
                base = dict(part="strategy", gpus=n, tokens_per_gpu=tokens, heads=H, kv_heads=kv_heads,
                            layout=args.layout, causal=args.causal, strategy=strategy)
                try:
                    fwd, fwd_bwd = functions(strategy, axis, mesh, args)
                    out = np.asarray(fwd(q, k, v).astype(jnp.float32))
                    if reference is None:
                        reference = out
                    err = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
                    for mode in modes:
                        fn, fn_args = (fwd, (q, k, v)) if mode == "fwd" else (fwd_bwd, (q, k, v, do))
                        ms = timeit(fn, *fn_args, reps=args.reps) * 1e3
                        cost = costs.get(strategy)
                        model_ms = None if cost is None else (cost.fwd_s if mode == "fwd" else cost.total_s) * 1e3
                        record(**base, mode=mode, ms=round(ms, 3),
                               tflops_per_gpu=round(flops(total, args.causal, mode != "fwd") / (ms / 1e3) / 1e12 / n,
                                                    1),
                               model_ms=None if model_ms is None else round(model_ms, 3), rel_err_vs_ring=err)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it and go on
                    record(**base, note=f"failed: {type(e).__name__}: {str(e)[:300]}")
                del q, k, v, do
            for policy in ("off", "on") if args.auto else ():
                try:
                    chosen, why = auto_choice(n, tokens, kv_heads, args, policy)
                except Exception as e:  # noqa: BLE001
                    chosen, why = "?", f"failed: {type(e).__name__}: {str(e)[:300]}"
                record(part="auto", gpus=n, tokens_per_gpu=tokens, heads=H, kv_heads=kv_heads, layout=args.layout,
                       causal=args.causal, autotune=policy, chosen=chosen, model_pick=model_pick, reason=why)


def table(rows):
    """Markdown: one row per (tokens, heads, strategy); fwd and fwd+bwd measured beside the model."""
    lines = ["| tokens/GPU | heads | strategy | fwd ms (model) | fwd TFLOP/s/GPU | fwd+bwd ms (model) | "
             "fwd+bwd TFLOP/s/GPU |", "|---|---|---|---|---|---|---|"]
    cells = {}
    for r in rows:
        if r.get("part") == "strategy" and "ms" in r:
            cells.setdefault((r["tokens_per_gpu"], r["kv_heads"], r["strategy"]), {})[r["mode"]] = r
    for (tokens, kvh, strategy), by_mode in sorted(cells.items()):
        def cell(mode):
            r = by_mode.get(mode)
            if r is None:
                return "-", "-"
            model = f" ({r['model_ms']})" if r.get("model_ms") is not None else ""
            return f"{r['ms']}{model}", f"{r['tflops_per_gpu']}"
        f_ms, f_tf = cell("fwd")
        b_ms, b_tf = cell("fwd+bwd")
        lines.append(f"| {tokens} | {H}/{kvh} | {strategy} | {f_ms} | {f_tf} | {b_ms} | {b_tf} |")
    for r in rows:
        if r.get("part") == "auto":
            lines.append(f"\nauto (autotune={r['autotune']}) at {r['tokens_per_gpu']} tokens/GPU, {H}/{r['kv_heads']}: "
                         f"{r['chosen']} (model: {r['model_pick']}) - {r['reason']}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, help="GPUs to use (default: all visible)")
    parser.add_argument("--tokens", default="8192,32768", help="tokens per GPU, comma-separated")
    parser.add_argument("--kv-heads", default="32,8", help="KV heads (32 query heads), comma-separated")
    parser.add_argument("--strategies", default="ring,all_gather,ulysses,hybrid")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "striped"))
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--implementation", default="auto")
    parser.add_argument("--no-auto", dest="auto", action="store_false", help="skip what strategy='auto' picks")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tag", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="directory for strategies_<tag>.json")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on these machines
    # a fresh config cache unless one is named: autotune="on" measures rather than recalls
    os.environ.setdefault("RINGJAX_CACHE_DIR", tempfile.mkdtemp(prefix="ringjax-bench-"))
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind}, "
          f"{datetime.date.today().isoformat()}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _STREAM.append(open(os.path.join(args.out, f"strategies_{args.tag}.json"), "w"))
    autotuning.clear_memory_cache()
    run(args)
    print(table(_ROWS), flush=True)


if __name__ == "__main__":
    main()

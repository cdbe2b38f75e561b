"""Where one of ringjax's Mosaic GPU kernels spends its time, from Nsight Compute (ncu) on the GPU machine.

    python3 benchmarks/ncu_kernel.py run --kernel ringjax_dkv_dq --seq 32768 --out $OUT/bwd   # under ncu
    python3 benchmarks/ncu_kernel.py summary $OUT/bwd                                         # anywhere

`run` profiles one launch of the named kernel (after one warm-up launch) in a jitted forward+backward of
`pallas_mosaic_gpu` (bf16, batch 1, 32 q / 8 kv heads, head_dim 128; `--causal`, `--alibi`, `--window N`, and `--config
KEY=VALUE,...` for a `MosaicGpuConfig` in place of the heuristic's), with the clocks left alone
(`--clock-control none`), and exports the details page and the per-instruction (SASS) page as CSV. `summary`
prints the kernel's duration, its local-memory (spill) requests, the warps' stall reasons, and the hot segments of
the SASS: runs of instructions executed equally often, so a loop body's parts show apart, with their share of
the stall samples. Kernel names: ringjax_fwd, ringjax_dq, ringjax_dkv, ringjax_dkv_dq (the fused backward).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
            "MemoryWorkloadAnalysis", "LaunchStats", "SourceCounters")
DETAILS = ("Duration", "Local Memory Spilling Requests", "Compute (SM) Throughput", "L1/TEX Cache Throughput",
           "Registers Per Thread", "Warp Cycles Per Issued Instruction")


def profiled_call(seq: int, causal: bool, alibi: bool = False, config: str | None = None,
                  window: int | None = None) -> None:
    """The program ncu runs: three jitted fwd+bwd calls."""
    import jax
    import jax.numpy as jnp

    import ringjax
    from ringjax.backends.pallas_mosaic_gpu.config import MosaicGpuConfig

    ks = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(k, (1, seq, 32, 128), jnp.bfloat16) for k in ks[:2])
    k, v = (jax.random.normal(k, (1, seq, 8, 128), jnp.bfloat16) for k in ks[2:])
    slopes = 2.0 ** (-8.0 * jnp.arange(1, 33) / 32) if alibi else None
    cfg = MosaicGpuConfig(**config_fields(config)) if config else None

    def loss(q, k, v):
        o = ringjax.ring_attention(q, k, v, axis_name=None, causal=causal, implementation="pallas_mosaic_gpu",
                                   alibi_slopes=slopes, config=cfg,
                                   sliding_window=(window, 0) if window else None)
        return jnp.vdot(o.astype(jnp.float32), do.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for _ in range(3):
        jax.block_until_ready(grads(q, k, v))


def config_fields(text: str) -> dict:
    """"bwd_fused=true,dkv_num_stages=2" -> {"bwd_fused": True, "dkv_num_stages": 2} (values read as JSON)."""
    pairs = [item.partition("=") for item in text.split(",") if item]
    if any(not sep or not key for key, sep, _ in pairs):
        raise SystemExit(f"--config: expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return {key: json.loads(value.lower() if value.lower() in ("true", "false") else value)
            for key, _, value in pairs}


def run(args) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    target = [sys.executable, __file__, "call", "--seq", str(args.seq)] + (["--causal"] if args.causal else [])
    target += (["--alibi"] if args.alibi else []) + (["--config", args.config] if args.config else [])
    target += ["--window", str(args.window)] if args.window else []
    sections = [flag for name in SECTIONS for flag in ("--section", name)]
    subprocess.run(["ncu", "--clock-control", "none", "-k", f"regex:{args.kernel}", "--launch-skip", "1",
                    "--launch-count", "1", *sections, "-f", "-o", str(out), *target], check=True)
    for page, suffix, extra in (("details", "_details.csv", []), ("source", "_sass.csv", ["--print-source", "sass"])):
        text = subprocess.run(["ncu", "-i", f"{out}.ncu-rep", "--page", page, "--csv", *extra], check=True,
                              capture_output=True, text=True).stdout
        if suffix == "_sass.csv":
            with gzip.open(f"{out}{suffix}.gz", "wt") as f:
                f.write(text)
        else:
            Path(f"{out}{suffix}").write_text(text)
    return summary(args)


def _sass_rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        next(f)  # the kernel's name
        return list(csv.DictReader(f))


def _opcode(source: str) -> str:
    words = source.strip().split()
    word = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
    return word.split(".")[0]


def summary(args) -> int:
    base = str(args.out)
    for row in csv.DictReader(open(f"{base}_details.csv")):
        if row["Metric Name"] in DETAILS:
            print(f"{row['Metric Name']}: {row['Metric Value']} {row['Metric Unit']}")
    rows = _sass_rows(Path(f"{base}_sass.csv.gz"))
    samples = [int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows]
    executed = [int(r["Instructions Executed"] or 0) for r in rows]
    total = sum(samples) or 1
    stalls = collections.Counter()
    for r in rows:
        for key, value in r.items():
            if key.startswith("stall_") and "Not Issued" not in key:
                stalls[key[6:]] += int(value or 0)
    print("stall reasons (share of samples):", ", ".join(f"{k} {v / total:.1%}" for k, v in stalls.most_common(8)))
    print(f"segments with at least {args.min_share:.1%} of the samples (instructions executed equally often):")
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and executed[i] == executed[start]:
            continue
        share = sum(samples[start:i]) / total
        if share >= args.min_share:
            ops = collections.Counter(_opcode(r["Source"]) for r in rows[start:i])
            print(f"  {start:5}-{i:5}  executed {executed[start]:>11,}  {share:6.1%}  "
                  + ", ".join(f"{op} {n}" for op, n in ops.most_common(6)))
        start = i
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "call"):
        p = sub.add_parser(name)
        p.add_argument("--seq", type=int, default=32768)
        p.add_argument("--causal", action="store_true")
        p.add_argument("--alibi", action="store_true", help="with ALiBi slopes")
        p.add_argument("--config", help="MosaicGpuConfig fields KEY=VALUE,... (default: the heuristic's config)")
        p.add_argument("--window", type=int, help="a sliding window of this many keys to the left")
        if name == "run":
            p.add_argument("--kernel", default="ringjax_dkv_dq", help="kernel name (a regular expression)")
            p.add_argument("--out", required=True, help="report path, without suffix")
            p.add_argument("--min-share", type=float, default=0.005)
    p = sub.add_parser("summary")
    p.add_argument("out", help="the path given to run --out")
    p.add_argument("--min-share", type=float, default=0.005)
    args = parser.parse_args(argv)
    if args.command == "call":
        profiled_call(args.seq, args.causal, args.alibi, args.config, args.window)
        return 0
    return run(args) if args.command == "run" else summary(args)


if __name__ == "__main__":
    sys.exit(main())

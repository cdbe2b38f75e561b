"""The GPU's own timeline of ringjax's forward on the coverage suite's masks: kernel time per call, by kernel.

    python3 benchmarks/gpu_timeline.py --seqs 8192,32768 --out timeline.jsonl

For each feature (the `coverage` suite's keywords, bf16, batch 1, 32 q / 8 kv heads, head_dim 128, causal): 3
warm-up calls, then 10 calls back to back under `jax.profiler.trace`; from its Perfetto trace, the span from the
first kernel's start to the last one's end and the summed kernel time, per call, and the longest kernels by name.
Host clocks (`bench.py`) add each sample's wait and first dispatch; this is what the GPU spent. Beside it, each
row has the host's time per call of the same calls timed as `bench.py` times them (`host_us_per_call`: samples
of at least 20 ms, without the profiler) and the GPU's SM clock before and after (`sm_mhz`, from nvidia-smi where
there is one), so a gap between the two clocks can be told from the clock speed. Before both, the calls run back
to back for `--settle-s` seconds, so the clock is the one the call's sustained load holds, as in `bench.py`'s
rows, not an idle GPU's boost. `--variant
KEY=VALUE,...` (repeatable) also times the config the call ran with those fields replaced, default and variants
alternating for `--rounds` rounds. `--backward` times forward and backward together (the gradients `bench.py`
times, against a random cotangent), so the backward's kernels and what XLA runs around them show by name.
`--implementation xla --seqs 512` checks the script on CPU (its "device" is then the host's thread pool).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

from common import Shape, attention_fns, random_inputs, ringjax_log, sm_mhz, timeit  # noqa: E402

FEATURES = ("plain", "window", "segments", "chunked", "sink_tokens", "chunked_documents")
CALLS = 10
# an idle H100 boosts its SM to 1980 MHz, and one under a call's sustained load settles lower within a second or
# two: plain causal's fwd+bwd at 32K at 1470-1605, a window's at 1700-1800 (1 H100, jax 0.11.2, 2026-12-07). A
# timeline from idle read the window's 32K fwd+bwd at 4.36 ms, `bench.py coverage` (2 s of samples) at 4.71-4.75
SETTLE_S = 2.0


def kernel_times(trace: Path) -> tuple[float, float, collections.Counter]:
    """(span us, busy us, us by kernel name) of the device events of a Perfetto trace, over `CALLS` calls."""
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:" in name}
    device = device or {pid for pid, name in names.items() if "python" not in name.lower()}  # CPU: the host pool
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in device]
    by_name: collections.Counter = collections.Counter()
    for e in spans:
        by_name[e["name"]] += e.get("dur", 0) / CALLS
    start, end = min(e["ts"] for e in spans), max(e["ts"] + e.get("dur", 0) for e in spans)
    return (end - start) / CALLS, sum(by_name.values()), by_name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="8192", help="comma-separated lengths (default 8192)")
    p.add_argument("--features", default=",".join(FEATURES), help=f"default {','.join(FEATURES)}")
    p.add_argument("--implementation", default="pallas_mosaic_gpu")
    p.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    p.add_argument("--variant", type=bench.config_overrides, action="append", default=[],
                   help="config fields KEY=VALUE,... to time beside the config the call runs (repeatable)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of default and variants, alternating")
    p.add_argument("--backward", action="store_true", help="time forward and backward (the call's vjp)")
    p.add_argument("--settle-s", type=float, default=SETTLE_S,
                   help=f"seconds of calls before each row's timing, for the SM clock to settle (default {SETTLE_S})")
    args = p.parse_args(argv)
    shape = Shape(1, 32, 8, 128, "bfloat16")
    for t in map(int, args.seqs.split(",")):
        features = {f[0]: f for f in bench.coverage_features(shape, t, argparse.Namespace(window=1024, chunk=2048))}
        q, k, v, do = random_inputs(shape, t)
        inputs = (q, k, v, do) if args.backward else (q, k, v)
        for name in args.features.split(","):
            base, fwds = None, []
            for overrides in [{}] + args.variant:
                config = dataclasses.replace(base, **overrides) if overrides else None
                fwd = attention_fns(bench.ringjax_attention(args.implementation, True, config=config,
                                                            **features[name][2]))[args.backward]
                with ringjax_log() as log:
                    for _ in range(3):
                        jax.block_until_ready(fwd(*inputs))
                if base is None and log.reports:
                    base = log.reports[-1].config  # the config the call ran, which the variants vary
                if base is None and args.variant:
                    raise SystemExit(f"--variant: {args.implementation} logged no config to vary")
                fwds.append((overrides, fwd))
            for round_ in range(args.rounds):
                for overrides, fwd in fwds:
                    row = {"variant": bench.variant_name(overrides), "round": round_} if args.variant else {}
                    timeline(args, fwd, inputs, {"feature": name, "T": t, **row}, shape)
    return 0


def timeline(args, fwd, inputs, case: dict, shape: Shape) -> None:
    """Time `CALLS` calls of the warm `fwd` on the GPU's timeline, and on the host's clock as `bench.py` does,
    and write the row."""
    settle_until = time.perf_counter() + args.settle_s
    while time.perf_counter() < settle_until:
        jax.block_until_ready([fwd(*inputs) for _ in range(bench.DEFAULT_BACK_TO_BACK)])
    clocks = [sm_mhz()]
    host = timeit(fwd, *inputs, reps=5, warmup=0, back_to_back=bench.DEFAULT_BACK_TO_BACK,
                  min_sample_s=bench.SAMPLE_MS / 1e3)
    clocks.append(sm_mhz())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            outs = [fwd(*inputs) for _ in range(CALLS)]
            jax.block_until_ready(outs)
        span, busy, by_name = kernel_times(next(Path(d).rglob("perfetto_trace.json.gz")))
    row = {"exp": "timeline", **case, "backward": args.backward, "causal": True, "implementation": args.implementation,
           "shape": shape.describe(), "span_us_per_call": round(span, 1), "busy_us_per_call": round(busy, 1),
           "host_us_per_call": round(host * 1e6, 1), "sm_mhz": clocks, "settle_s": args.settle_s,
           "top": [[round(us, 1), kernel[:60]] for kernel, us in by_name.most_common(6)],
           "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    print(json.dumps(row), flush=True)
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())

"""Measuring and recording for `benchmarks/bench.py`: timing, FLOP counts, inputs, results files.

Conventions (docs/performance.md): TFLOP/s counts the matmuls of attention, 4*B*H*T*T*D for the
forward (half when causal), 3.5x that for forward+backward and 2.5x for the backward alone
(forward+backward time minus forward time); times are medians of `reps` calls after warm-up, each
waited for with `block_until_ready`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import ringjax

RESULTS = Path(__file__).resolve().parent / "results"
FWD, FWD_BWD, BWD = 1.0, 3.5, 2.5  # FLOPs of each mode in units of the forward's


def timeit(fn, *args, reps: int = 10, warmup: int = 2, budget_s: float = float("inf"), back_to_back: int = 1,
           min_sample_s: float = 0.0) -> float:
    """Median wall time (s) of `fn(*args)` over `reps` samples after `warmup` calls; a sample dispatches
    `back_to_back` calls and waits for the last (as a decode loop does), and counts its time per call.

    `min_sample_s`: a first sample that lasts less takes more calls per sample, as many as make it last that
    long (at most `MAX_CALLS_PER_SAMPLE`), so that each sample's one wait and first dispatch, a fixed cost, weigh
    little on short calls. Timing stops early once the timed samples add up to `budget_s` (one sample is always
    timed).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))

    def sample(calls: int) -> float:
        start = time.perf_counter()
        out = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(out)
        return time.perf_counter() - start

    calls = back_to_back
    first = sample(calls)
    if 0 < first < min_sample_s:
        calls = min(MAX_CALLS_PER_SAMPLE, max(calls, math.ceil(calls * min_sample_s / first)))
        first = sample(calls)
    times = [first / calls]
    while len(times) < reps and sum(times) * calls < budget_s:
        times.append(sample(calls) / calls)
    return statistics.median(times)


# each timed sample's wait and first dispatch cost about 0.4 ms on an H200 (jax 0.11.2, 2026-12-03: 5 calls of an 8K
# windowed forward took 0.338 ms each, 25 took 0.281, its kernels 0.263 on the GPU's own timeline); samples of at
# least 20 ms (`--sample-ms`) keep that within 2%
MAX_CALLS_PER_SAMPLE = 1000


def sm_mhz() -> int | None:
    """The first GPU's current SM clock (MHz) by nvidia-smi, None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def attention_flops(batch: int, heads: int, tokens: int, head_dim: int, causal: bool, bwd: bool,
                    v_head_dim: int | None = None) -> float:
    """Matmul FLOPs of attention over `tokens`: 2 B H T^2 (D + Dv) forward (QK^T and PV; 4 B H T^2 D where v's
    head_dim Dv is q's), half when causal, x3.5 with the backward."""
    dv = head_dim if v_head_dim is None else v_head_dim
    f = 2.0 * batch * heads * tokens * tokens * (head_dim + dv) * (0.5 if causal else 1.0)
    return f * (FWD_BWD if bwd else FWD)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Everything about q, k, v but their length; `v_head_dim` None: v's head_dim is q's and k's."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    v_head_dim: int | None = None

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def flops(self, tokens: int, causal: bool) -> float:
        """Forward FLOPs over `tokens`."""
        return attention_flops(self.batch, self.heads, tokens, self.head_dim, causal, bwd=False,
                               v_head_dim=self.v_head_dim)

    def fields(self) -> dict:
        """The shape as a results row's fields (`v_head_dim` only where it differs from q's)."""
        row = dataclasses.asdict(self)
        if self.v_head_dim is None:
            del row["v_head_dim"]
        return row

    @classmethod
    def of_row(cls, row: dict) -> Shape:
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})

    def describe(self) -> str:
        v = "" if self.v_head_dim is None else f", v {self.v_head_dim}"
        return (f"{self.dtype}, batch {self.batch}, {self.heads} q / {self.kv_heads} kv heads, "
                f"head_dim {self.head_dim}{v}")


def random_inputs(shape: Shape, tokens: int, sharding=None, seed: int = 0):
    """Normal q, k, v and an output cotangent `do`, made in place on `sharding` (default: one device).

    jax.random gives the same values for any sharding, so runs on different meshes see one problem.
    """
    return _generator(shape, tokens, sharding)(jax.random.key(seed))


@functools.cache
def _generator(shape: Shape, tokens: int, sharding):
    """One compiled generator per (shape, length, sharding): compiling it costs more than running it."""
    # q, k, v, do: heads and head_dim of each
    dims = ((shape.heads, shape.head_dim), (shape.kv_heads, shape.head_dim), (shape.kv_heads, shape.value_dim),
            (shape.heads, shape.value_dim))

    def make(key):
        keys = jax.random.split(key, 4)
        return tuple(jax.random.normal(k, (shape.batch, tokens, h, d), shape.dtype) for k, (h, d) in zip(keys, dims))

    return jax.jit(make, out_shardings=sharding)


def attention_fns(attn):
    """(forward, forward+backward) jitted from `attn(q, k, v) -> out`; the latter returns dq, dk, dv."""

    def loss(q, k, v, do):
        return (attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)).sum()

    return jax.jit(attn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def rates(fwd_ms: float | None, fwd_bwd_ms: float | None, fwd_flops: float, devices: int = 1) -> dict:
    """Times and TFLOP/s (per device) of the forward, forward+backward and the backward alone."""
    out = {}
    bwd_ms = None if fwd_ms is None or fwd_bwd_ms is None else fwd_bwd_ms - fwd_ms
    for mode, ms, factor in (("fwd", fwd_ms, FWD), ("fwd_bwd", fwd_bwd_ms, FWD_BWD), ("bwd", bwd_ms, BWD)):
        if ms is not None:
            out[f"{mode}_ms"] = significant(ms)
            out[f"{mode}_tflops"] = significant(factor * fwd_flops / devices / ms / 1e9) if ms > 0 else None
    return out


def significant(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits: 612.3 TFLOP/s on a GPU and 0.004213 on a CPU alike."""
    return float(f"{x:.{digits}g}")


def measure(attn, q, k, v, do, fwd_flops: float, *, reps: int, warmup: int, budget_s: float, devices: int = 1,
            back_to_back: int = 1, min_sample_s: float = 0.0):
    """Time `attn` forward and forward+backward: (rates(...) fields, forward output).

    Each mode's first call compiles and counts as a warm-up; a mode whose first call takes longer
    than `budget_s` gets no further warm-up, and timing stops once `budget_s` is spent. A forward
    that fails raises; a backward that fails is recorded as `fwd_bwd_error`. `back_to_back`: calls per
    sample without a host sync between them, more where a sample would last less than `min_sample_s` (`timeit`).
    On an NVIDIA GPU the fields also hold its SM clock right after each mode's timed samples (`sm_mhz`: after
    the forward's, then after the forward+backward's), so that a ratio between rows of one run can be told from
    clock drift.
    """
    fwd, fwd_bwd = attention_fns(attn)
    on_gpu = True  # no further nvidia-smi call where the first found none

    def mode_ms(fn, *args):
        """(ms a call, first output, SM clock after the timed samples)."""
        nonlocal on_gpu
        start = time.perf_counter()
        first = jax.block_until_ready(fn(*args))
        more = 0 if time.perf_counter() - start > budget_s else max(0, warmup - 1)
        ms = timeit(fn, *args, reps=reps, warmup=more, budget_s=budget_s, back_to_back=back_to_back,
                    min_sample_s=min_sample_s) * 1e3
        clock = sm_mhz() if on_gpu else None
        on_gpu = clock is not None
        return ms, first, clock

    fwd_ms, out, fwd_clock = mode_ms(fwd, q, k, v)
    clocks = {"sm_mhz": [fwd_clock]} if fwd_clock is not None else {}
    try:
        fwd_bwd_ms, _, fwd_bwd_clock = mode_ms(fwd_bwd, q, k, v, do)
    except Exception as e:  # noqa: BLE001 - e.g. a library without this backward: keep the forward
        return {**rates(fwd_ms, None, fwd_flops, devices), "fwd_bwd_error": failure(e), **clocks}, out
    if clocks:
        clocks["sm_mhz"].append(fwd_bwd_clock)
    return {**rates(fwd_ms, fwd_bwd_ms, fwd_flops, devices), **clocks}, out


@jax.jit
def _errors(out, ref):
    diff = out.astype(jnp.float32) - ref.astype(jnp.float32)
    return jnp.max(jnp.abs(diff)), jnp.linalg.norm(diff) / jnp.linalg.norm(ref.astype(jnp.float32))


def errors(out, ref) -> dict:
    """max_abs_err and rel_err (Frobenius) of `out` against `ref`, computed on ref's first device."""
    device = next(iter(ref.devices()))
    max_abs, rel = _errors(jax.device_put(out, device), jax.device_put(ref, device))
    return {"max_abs_err": float(max_abs), "rel_err": float(rel)}


def failure(e: BaseException) -> str:
    """One line naming an exception, short enough for a table footnote."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}"


# ----------------------------------------------------------------------------- what ringjax ran


class Messages(list):
    """Log lines (str), with the `ringjax.implementation` reports they render in `.reports`."""

    def __init__(self):
        super().__init__()
        self.reports: list = []


class _Collect(logging.Handler):
    def __init__(self, messages: Messages):
        super().__init__(logging.DEBUG)
        self.messages = messages

    def emit(self, record):
        self.messages.append(record.getMessage())
        if record.name == "ringjax.implementation" and record.args:
            self.messages.reports.append(record.args[0])


@contextlib.contextmanager
def ringjax_log():
    """Collect what the loggers under "ringjax" say, DEBUG included, while the block runs (traces log)."""
    messages = Messages()
    logger, handler = logging.getLogger("ringjax"), _Collect(messages)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# "ring_attention/<name>: <source> config ...", "cache_attention/<name>: <config>; strategy ..."
_IMPLEMENTATION = re.compile(r"^(?:ring|cache)_attention/([\w.-]+): ")
_STRATEGY = re.compile(r"strategy='auto' chose (\w+)")


def picked(messages: list[str]) -> dict:
    """What ringjax logged running: {"implementation": name} ("auto" with a note when none was logged),
    the "config" it ran and its "config_source" (heuristic, shipped, persistent, ...), {"fused": True} when its
    config ran the fused ring, plus {"chosen": strategy, "reason": the log line} when strategy="auto" chose one."""
    names = [found.group(1) for found in map(_IMPLEMENTATION.match, messages) if found]
    out = {"implementation": names[0]} if names else {"implementation": "auto",
                                                      "note": "ringjax logged no implementation for this call"}
    report = messages.reports[-1] if getattr(messages, "reports", None) else None
    if getattr(report, "config", None) is not None:
        try:
            out["config"] = ringjax.config_to_json(report.config)
        except TypeError:  # a config of an implementation outside ringjax's registry: its repr
            out["config"] = repr(report.config)
        out["config_source"] = report.config_source
    if any(_IMPLEMENTATION.match(m) and '"fused": true' in m for m in messages):  # a ring in one kernel per pass
        out["fused"] = True
    for m in messages:
        found = _STRATEGY.search(m)
        if found:
            return {**out, "chosen": found.group(1), "reason": m}
    return out


# ----------------------------------------------------------------------------- results files

_FILE = re.compile(r"^(?P<device>.+)_(?P<date>\d{4}-\d{2}-\d{2})_(?P<suite>[a-z_]+)\.jsonl$")


def device_slug(device_kind: str, devices: int) -> str:
    """'NVIDIA H200', 2 -> 'nvidia-h200_x2' (no suffix for one device)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"
    return slug + (f"_x{devices}" if devices > 1 else "")


def results_file(out_dir: Path, device_kind: str, devices: int, date: str, suite: str) -> Path:
    return Path(out_dir) / f"{device_slug(device_kind, devices)}_{date}_{suite}.jsonl"


class Recorder:
    """Appends one JSON line per case to the run's results file, stamped with what ran where and how."""

    def __init__(self, suite: str, out_dir: Path, devices: int, options: dict, tag: str = "", say=print):
        first = jax.devices()[0]
        now = datetime.datetime.now(datetime.timezone.utc)
        self.suite, self.say, self.rows = suite, say, []
        self.path = results_file(out_dir, first.device_kind, devices, now.date().isoformat(), suite)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stamp = {
            "device_kind": first.device_kind,
            "platform": first.platform,
            "device_count": devices,
            "local_device_count": jax.local_device_count(),
            "jax": jax.__version__,
            "ringjax": ringjax.__version__,
            "run_started": now.isoformat(timespec="seconds"),
            "tag": tag,
            "options": options,
            "command": shlex.join(["python", *sys.argv]),
        }

    def add(self, case: dict, **fields) -> dict:
        """Write {suite, case, fields..., stamp, time} as one line (at once: a killed run keeps its rows)."""
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        row = {"suite": self.suite, "case": case, **fields, **self.stamp, "time": now}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)
        shown = {k: v for k, v in fields.items() if not isinstance(v, dict)}
        self.say(" ".join(f"{k}={v}" for k, v in {**case, **shown}.items()))
        return row


def newest_results(results_dir: Path) -> dict[tuple[str, str], tuple[Path, list[dict]]]:
    """{(suite, device slug): (newest file, its rows, a re-measured case keeping its last row)}."""
    newest: dict[tuple[str, str], Path] = {}
    for path in sorted(Path(results_dir).glob("*.jsonl")):
        m = _FILE.match(path.name)
        if m:
            key = (m["suite"], m["device"])
            if key not in newest or _FILE.match(newest[key].name)["date"] < m["date"]:
                newest[key] = path
    out = {}
    for key, path in newest.items():
        rows: dict[str, dict] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[json.dumps(row.get("case"), sort_keys=True)] = row  # dicts keep first-insertion order
        out[key] = (path, list(rows.values()))
    return out

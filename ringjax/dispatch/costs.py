"""How long each implementation takes on a problem, from measurements shipped per device kind.

A calibration file (`ringjax/configs/calibration/<device kind>.json`, or the user's own in
`<cache dir>/calibration/`, which wins) holds measured kernel times (implementation, dtype, matmul
precision, shape, features; forward and forward+backward milliseconds) and collective times. This
module fits rates to them and predicts:

- work: the visible (query, key) pairs of the slowest device, counted exactly from the mask rules
  (causal, window, chunks, sink tokens, layout, ring size; the sink tokens' key block whole where a query walks
  it apart from its window), times 2 * batch * heads * (head_dim +
  v_head_dim) FLOPs forward (QK^T over q/k's head_dim, PV over v's) and 3.5x that forward + backward
  (FlashAttention's convention);
- per implementation and dtype class: seconds = overhead * calls + row_s * rows + work / rate (rows: batch x
  queries x heads x head_dim, times `row_share`: 30%, and the rest by the longest walk of a query row
  over the call's keys, which a packed document, a window or a chunk bounds; row_s only where lengths spanning
  8x were measured, then fitted on the relative errors; the forward's fixed terms capped at the
  forward+backward's), fitted to the plain rows, causal and not causal apart; calls: one per ring step (a
  fused ring's pass is one launch), the rate scaled by the measured head_dim nearest to the problem's and
  slowed by each feature's measured factor; a head_dim or feature one implementation was not measured at
  borrows the geometric mean of the factors measured for the others (a kernel's relative cost of a feature is
  closer to its peers' than to nothing; a feature's at least 1), and one nobody measured is priced as plain;
  the prediction says which;
- packed segments: the visible pairs counted within each document where the problem knows them
  (`Problem.documents`: concrete segment ids when the call was traced, `explain --documents`, calibration
  rows' equal documents), their measured factors on top; traced ids are priced as if no block were skipped.

Rows say how they were timed: `back_to_back` calls per sample, as a training step dispatches them (absent: each
call synced with the host, whose wait then sits in the row's time); a prediction from rows of both notes it.
`python -m ringjax calibrate` measures (5 calls back to back) and writes a file; `calibrate.from_results` builds
one from `benchmarks/results/*.jsonl`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ringjax.core import precision as precisions
from ringjax.core.features import FEATURES
from ringjax.core.problem import Problem
from ringjax.dispatch import cache

FORMAT = "ringjax-calibration"
SCHEMA = 1
BACKWARD_FACTOR = 3.5  # forward + backward FLOPs over forward FLOPs (the benchmarks' convention)
REFERENCE_HEAD_DIM = 128
# data-dependent: what segments skip depends on the ids, priced only where a problem knows its documents
_SEGMENTS = frozenset({"segment_ids", "chunk_size_segments", "num_sink_tokens_segments"})
# schedules, not per-pair costs of a kernel (the invariant ring runs the same kernels on granule pairs)
_UNPRICED = frozenset({"all_gather", "ulysses", "invariant"})
# calibration rows with segments (`bench.py coverage`, `python -m ringjax calibrate`) pack this many documents
# of equal length in every batch row
MEASURED_DOCUMENTS = 4
_MAX_READ_IDS = 1 << 24  # concrete segment ids read to price a call, at most (64 MiB of int32)
MODES = ("fwd", "fwd_bwd")


# ---------------------------------------------------------------------------- where calibrations live


def shipped_dir() -> Path:
    return cache.shipped_dir() / "calibration"


def user_dir() -> Path:
    return cache.cache_dir() / "calibration"


def path_for(device_kind: str, *, shipped: bool = False) -> Path:
    return (shipped_dir() if shipped else user_dir()) / f"{cache.file_stem(device_kind)}.json"


# ---------------------------------------------------------------------------- work


def _reach(opts, x: np.ndarray, length: int, of_keys: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] of the positions in [0, length) that position x pairs with under the causal, window and chunk
    rules (no sinks, no segments): the keys query x sees, or with `of_keys` the queries that see key x."""
    lo = np.zeros_like(x)
    hi = np.zeros_like(x) + (length - 1)  # `length` may be one per position (`_packed_keys`)
    if opts.causal:
        lo, hi = (np.maximum(lo, x), hi) if of_keys else (lo, np.minimum(hi, x))
    if opts.window is not None:
        left, right = opts.window[::-1] if of_keys else opts.window
        lo, hi = np.maximum(lo, x - left), np.minimum(hi, x + right)
    if opts.chunk_size is not None:
        start = x // opts.chunk_size * opts.chunk_size
        lo, hi = np.maximum(lo, start), np.minimum(hi, start + opts.chunk_size - 1)
    return lo, hi


def _visible_keys(opts, q: np.ndarray, length: int) -> np.ndarray:
    """Keys of [0, length) each query position in `q` sees, by masks.visible_pairs' rules without segments."""
    lo, hi = _reach(opts, q, length)
    count = np.maximum(hi - lo + 1, 0)
    if opts.num_sink_tokens:  # keys [0, top): the first s tokens, not in the query's future; less those seen
        top = np.minimum(opts.num_sink_tokens, q + 1 if opts.causal else length)
        overlap = np.maximum(np.minimum(top - 1, hi) - lo + 1, 0)
        count = count + top - overlap
    return count


def _packed_keys(opts, runs: tuple[int, ...]) -> np.ndarray:
    """Keys each natural position of one batch row packed as `runs` (`Problem.documents`) sees: the rules
    within its own run (chunks and sink tokens restart at the run's first token); padding sees nothing.
    Runs that share an id see each other too; counted per run, they are priced below their work."""
    lengths = np.abs(np.asarray(runs, np.int64))
    size = np.repeat(lengths, lengths)
    offset = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.where(np.repeat(np.asarray(runs) > 0, lengths), _visible_keys(opts, offset, size), 0)


@functools.lru_cache(maxsize=256)
def visible_pairs(opts, seq: int, documents: tuple[tuple[int, ...], ...] | None = None) -> float:
    """Visible (query, key) pairs of the busiest device: `seq` local queries against the whole axis; with
    `documents` (`Problem.documents`) those within each document, averaged over its batch rows."""
    return max(_visible_by_shard(opts, seq, documents))


def _shard_positions(opts, seq: int) -> list[np.ndarray]:
    """The natural positions each shard of the axis holds, in storage order."""
    from ringjax.layouts import local_positions

    n = opts.axis_size
    return [local_positions(opts.layout, shard, n, seq, np, opts.subshards).astype(np.int64) for shard in range(n)]


def _visible_by_shard(opts, seq: int, documents=None) -> list[float]:
    positions = _shard_positions(opts, seq)
    if documents is None:
        return [int(_visible_keys(opts, pos, seq * opts.axis_size).sum()) for pos in positions]
    keys = [_packed_keys(opts, row) for row in documents]
    return [sum(int(k[pos].sum()) for k in keys) / len(keys) for pos in positions]


def documents_of(segment_ids, layout: str, axis_size: int) -> tuple[tuple[int, ...], ...] | None:
    """`Problem.documents` of global segment ids [batch, seq] stored in `layout` over `axis_size` shards, or
    None where they are traced (their values are known only when the call runs), partly in other processes, or
    more than 16M ids."""
    from ringjax import _compat
    from ringjax.layouts import local_positions

    # at most _MAX_READ_IDS: an eager call copies them to the host every time
    ids = _compat.host_value(segment_ids, _MAX_READ_IDS)
    if ids is None:
        return None
    batch, t = ids.shape
    if axis_size > 1:  # storage order -> natural order
        pos = np.concatenate([local_positions(layout, d, axis_size, t // axis_size, np) for d in range(axis_size)])
        natural = np.empty_like(ids)
        natural[:, pos] = ids
        ids = natural
    rows = []
    for row in ids:
        edges = np.concatenate([[0], np.flatnonzero(np.diff(row)) + 1, [t]])
        rows.append(tuple(int(n) for n in np.diff(edges) * np.where(row[edges[:-1]] < 0, -1, 1)))
    return tuple(rows)


def equal_documents(count: int, length: int) -> tuple[tuple[int, ...], ...]:
    """`Problem.documents` of rows of `length` tokens packed with `count` documents of equal length (the last
    takes what does not divide), as the calibration rows with segments were measured."""
    size = length // count
    return ((size,) * (count - 1) + (length - size * (count - 1),),)


def known_documents(problem: Problem) -> tuple[tuple[int, ...], ...] | None:
    """The problem's documents where they price it: segments on, and runs that cover the whole sequence."""
    docs = problem.documents
    if docs is None or not problem.opts.has_segments or problem.q_seq is not None:
        return None
    length = problem.seq * problem.opts.axis_size
    return docs if all(sum(map(abs, row)) == length for row in docs) else None


def _hidden_in_walk(opts, rows: np.ndarray, cols: np.ndarray, length: int, of_keys: bool) -> int:
    """Hidden pairs a kernel visits when each row (query, or key `of_keys`) walks the columns from its first
    visible one to its last in storage order: nonzero only where `cols` is not ascending."""
    starts = np.flatnonzero(np.diff(cols) < 0) + 1
    if starts.size == 0:  # ascending: the rules' reach is one contiguous run
        return 0
    lo, hi = _reach(opts, rows, length, of_keys)
    first, last, seen = np.full_like(rows, cols.size), np.zeros_like(rows), np.zeros_like(rows)
    for begin, run in zip([0, *starts], np.split(cols, starts)):  # ascending runs of positions
        a = begin + np.searchsorted(run, lo, "left")
        b = begin + np.searchsorted(run, hi, "right")
        some = b > a
        first, last = np.where(some, np.minimum(first, a), first), np.where(some, np.maximum(last, b), last)
        seen += np.maximum(b - a, 0)
    return int((np.maximum(last - first, 0) - seen).sum())


# keys of the block holding the sink tokens, which a query walks whole (the GPU kernels' block_kv)
SINK_BLOCK = 128


def _sink_block_pairs(opts, seq: int) -> float:
    """Pairs the busiest device computes and hides for its sink tokens: a query whose walk starts past the
    first block visits the sinks' block as a prefix of its own (`core/visits.sink_range_table`), SINK_BLOCK
    keys for the few the sinks show."""
    if not opts.num_sink_tokens:
        return 0
    length, base = seq * opts.axis_size, dataclasses.replace(opts, num_sink_tokens=0)
    extra = []
    for pos in _shard_positions(opts, seq):
        lo, hi = _reach(base, pos, length)
        top = np.minimum(opts.num_sink_tokens, pos + 1 if opts.causal else length)
        shown = top - np.maximum(np.minimum(top - 1, hi) - lo + 1, 0)
        extra.append(int(np.where((shown > 0) & (lo >= SINK_BLOCK), SINK_BLOCK - shown, 0).sum()))
    return max(extra)


@functools.lru_cache(maxsize=256)
def visited_pairs(opts, seq: int, of_keys: bool = False, documents=None) -> float:
    """(query, key) pairs the busiest device's kernels compute: the visible ones, and the hidden ones that
    each query tile (each key tile `of_keys`: the dK/dV walk) passes between its first and last visible
    block, as ringjax's GPU kernels walk [lo, hi) (`core/visits.py`). Storage order is ascending on every
    layout shard, so this is `visible_pairs` except with subshards: a hybrid's all-to-all over contiguous or
    zigzag, or Ulysses with `Strategy.sort_tokens` off (zigzag over 2 devices then holds chunks 0, 3, 1, 2: a
    causal walk crosses the hidden chunk 3, a third more pairs). With `documents`, the visible pairs within
    them, and the subshards' hidden pairs in the same proportion."""
    if opts.subshards == 1:
        return visible_pairs(opts, seq, documents) + (0 if documents is not None else _sink_block_pairs(opts, seq))
    if documents is not None:
        return visited_pairs(opts, seq, of_keys) * visible_pairs(opts, seq, documents) / visible_pairs(opts, seq)
    n, pos = opts.axis_size, _shard_positions(opts, seq)
    base = dataclasses.replace(opts, num_sink_tokens=0)  # sink tokens are walked as a prefix of their own
    # every shard's K/V visit every device (a ring over subshards is never shortened: schedule.ring_plan)
    return max(visible + sum(_hidden_in_walk(base, *((pos[src], pos[shard]) if of_keys else (pos[shard], pos[src])),
                                             seq * n, of_keys) for src in range(n))
               for shard, visible in enumerate(_visible_by_shard(opts, seq)))


def forward_flops(problem: Problem) -> float:
    """Matmul FLOPs of the busiest device's forward: 2 * batch * heads * (head_dim + v_head_dim) per visible
    pair (QK^T contracts q/k's head_dim, PV produces v's)."""
    return _pair_flops(problem) * visible_pairs(problem.opts, problem.seq, known_documents(problem))


def _pair_flops(problem: Problem) -> float:
    return 2.0 * problem.batch * problem.heads * (problem.head_dim + problem.v_head_dim)


def kernel_flops(problem: Problem) -> tuple[float, float]:
    """Matmul FLOPs the busiest device's kernels compute (forward, forward + backward) on the visited pairs;
    the backward (BACKWARD_FACTOR - 1 forwards) walks query tiles for dQ and key tiles for dK/dV: half each."""
    opts, pair, docs = problem.opts, _pair_flops(problem), known_documents(problem)
    rows, cols = visited_pairs(opts, problem.seq, False, docs), visited_pairs(opts, problem.seq, True, docs)
    fwd = pair * rows
    bwd = pair * (BACKWARD_FACTOR - 1) * (rows + cols) / 2
    return fwd, fwd + bwd


def row_units(problem: Problem) -> float:
    """batch x queries x heads x head_dim of one kernel call (q's and v's head_dims averaged), times `row_share`."""
    return (problem.batch * problem.seq * problem.heads * (problem.head_dim + problem.v_head_dim) / 2
            * row_share(problem.opts, problem.seq, known_documents(problem)))


# the share of a causal line's per-row term that does not shrink with the walk of a query row (see `row_share`)
ROW_FLOOR = 0.3


@functools.lru_cache(maxsize=256)
def row_share(opts, seq: int, documents: tuple[tuple[int, ...], ...] | None = None) -> float:
    """The share of a line's per-row term a call pays: ROW_FLOOR always, the rest in proportion to the most keys
    one query sees (over the whole axis, within its document where `documents` are known) over the call's `seq`
    keys, at most 1. A causal kernel's time is not affine in its FLOPs: fitted from 1K to 32K tokens its per-row
    term is a quarter of an 8K call, and it behaves as a fixed cost per query and key block plus a tail that
    grows with the longest walk. Measured on one H100 (jax 0.11.2, 2026-11-27/28; windows 256 to 4096, chunks
    512 to 8192, 4 documents, 8K to 32K), masks that bound the walk left 25-80% of the term: priced in full per
    row, four 8K documents in 32K (16.4 ms fwd+bwd, 4 x the 8K call) were predicted 37% low with every fitted
    factor and the window, chunk and segment factors fitted to 0.0001-0.4; priced by the walk alone, windows of
    256 and chunks of 512 read 35-50% low. A floor of 0.3 predicts those masks best (0.2 or 0.25: 24% and 20%
    at worst, 0.3: 16%, 0.35: 24%)."""
    if documents is not None:
        most = max(int(_packed_keys(opts, row).max(initial=0)) for row in documents)
    else:
        length = seq * opts.axis_size
        most = int(_visible_keys(opts, np.arange(length, dtype=np.int64), length).max(initial=0))
    return ROW_FLOOR + (1 - ROW_FLOOR) * min(1.0, most / seq)


def calls(problem: Problem) -> int:
    """Kernel calls a device makes: one per ring step it visits (one with K/V gathered)."""
    from ringjax.core.schedule import ring_plan

    if problem.opts.gather_kv or problem.opts.axis_size == 1:
        return 1
    return ring_plan(problem.opts, problem.seq).num_steps


def dtype_class(dtype: str, precision: str = precisions.DEFAULT) -> str:
    """What a rate is measured for: the dtype, and for float32 how its products are computed."""
    if dtype != "float32":
        return dtype
    if precision in precisions.FULL_FLOAT32:
        return "float32:full"
    if precision in precisions.TF32:
        return "float32:tf32"
    return f"float32:{precision}"


def cost_features(opts, segments: bool = False) -> tuple[str, ...]:
    """Feature-table names a call uses that may cost per visible pair: causal excluded, and segments unless
    `segments` (their documents are known: `priced_features`)."""
    return tuple(f.name for f in FEATURES if f.used(opts) and f.name != "causal" and f.name not in _UNPRICED
                 and (segments or f.name not in _SEGMENTS))


def priced_features(problem: Problem) -> tuple[str, ...]:
    """`cost_features` of the problem, its segments' among them where its documents are known."""
    return cost_features(problem.opts, known_documents(problem) is not None)


# ---------------------------------------------------------------------------- rates


@dataclasses.dataclass(frozen=True)
class Line:
    """time = overhead_s * calls + row_s * rows + work / (tflops * 1e12), per mode (fwd, fwd_bwd); rows:
    batch x queries x heads x head_dim over every call (`row_units`)."""

    tflops: Mapping[str, float]  # visible-work FLOP rate of the plain kernel at REFERENCE_HEAD_DIM
    overhead_s: Mapping[str, float]  # fixed cost per kernel call
    # cost linear in the queries (loading q, writing out, a causal kernel's diagonal tiles computed whole):
    # fitted where lengths spanning 8x or more were measured, else 0
    row_s: Mapping[str, float] = dataclasses.field(default_factory=lambda: {m: 0.0 for m in MODES})
    # the shortest call measured on this line at up to FLOOR_SEQ tokens (0 where none was): no call is priced below
    # it. The terms above extrapolate to nothing: on one H100 (2026-12-05) a 256-token call was priced 3 us by
    # XLA's line (fitted at 1K tokens and more) and 17 us by Mosaic's, where all three implementations took
    # 50-150 us, as long as their 1K calls (launch-bound)
    floor_s: Mapping[str, float] = dataclasses.field(default_factory=lambda: {m: 0.0 for m in MODES})

    def fixed_s(self, mode: str, calls: int, rows: float) -> float:
        """The part of a call's time that is not its FLOPs."""
        return self.overhead_s[mode] * calls + self.row_s[mode] * rows


@dataclasses.dataclass(frozen=True)
class Rates:
    """Fitted times of one implementation at one dtype class: a line for causal calls and one for the
    others (a causal kernel's rate per visible pair differs, most at short lengths: its diagonal tiles
    and uneven rows), head_dim and feature factors on top."""

    lines: Mapping[bool, Line]  # by causal; one of them may be missing, the other stands in
    head_dims: Mapping[int, Mapping[str, float]]  # rate at that head_dim over the reference rate
    features: Mapping[str, Mapping[str, float]]  # time per visible FLOP over plain's
    rows: int  # measurements behind it
    note: str = ""
    borrowed: frozenset[str] = frozenset()  # features and "head_dim N" priced by other implementations' factors

    def line(self, causal: bool) -> Line:
        return self.lines.get(causal) or self.lines[not causal]

    @property
    def tflops(self) -> Mapping[str, float]:
        """The causal line's rates (the one most calls use)."""
        return self.line(True).tflops

    def seconds(self, mode: str, flops: float, calls: int, head_dim: float, features: Sequence[str],
                causal: bool = True, rows: float = 0.0) -> float:
        factor = 1.0
        for name in features:
            factor *= self.features.get(name, {}).get(mode, 1.0)
        line = self.line(causal)
        rate = line.tflops[mode] * 1e12 * self._head_dim_factor(head_dim, mode)
        return max(line.fixed_s(mode, calls, rows) + flops / rate * factor, line.floor_s[mode] * calls)

    def _head_dim_factor(self, head_dim: float, mode: str) -> float:
        dims = {REFERENCE_HEAD_DIM: {m: 1.0 for m in MODES}, **self.head_dims}
        nearest = min(dims, key=lambda d: (abs(math.log2(d / head_dim)), d))
        return dims[nearest].get(mode, 1.0)

    def unmeasured(self, features: Sequence[str]) -> list[str]:
        return [name for name in features if name not in self.features]

    def lent(self, head_dim: float, features: Sequence[str]) -> list[str]:
        """What of (head_dim, features) this prediction prices by other implementations' factors."""
        dims = {REFERENCE_HEAD_DIM, *self.head_dims}
        nearest = min(dims, key=lambda d: (abs(math.log2(d / head_dim)), d))
        return [x for x in (f"head_dim {nearest}", *features) if x in self.borrowed]


@dataclasses.dataclass(frozen=True)
class Collective:
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The rates of one device kind, and where they came from."""

    device_kind: str
    rates: Mapping[tuple[str, str], Rates]  # (implementation, dtype class) -> Rates
    collectives: Mapping[str, Collective]  # ppermute | all_gather | reduce_scatter | all_to_all
    path: str = ""
    hbm_bytes: float = 0.0

    @property
    def where(self) -> str:
        """The file, shipped ones relative to the package."""
        path = Path(self.path)
        return f"ringjax/configs/calibration/{path.name}" if path.parent == shipped_dir() else self.path

    def rates_for(self, implementation: str, dtype: str, precision: str = precisions.DEFAULT) -> Rates | None:
        found = self.rates.get((implementation, dtype_class(dtype, precision)))
        if found is None and dtype == "float16":  # the same tensor-core rate as bfloat16
            found = self.rates.get((implementation, "bfloat16"))
        return found

    def collective(self, kind: str) -> tuple[Collective, str] | None:
        """The fitted `kind`, or the ring shift's rate standing in for it (with a note)."""
        if kind in self.collectives:
            return self.collectives[kind], ""
        if "ppermute" in self.collectives:
            return self.collectives["ppermute"], f"{kind} priced at the measured ppermute rate"
        return None


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one implementation on one problem (one device's kernels, no collectives)."""

    implementation: str
    fwd_s: float
    fwd_bwd_s: float
    note: str = ""

    def describe(self) -> str:
        return f"{self.fwd_s * 1e3:.3g} ms fwd, {self.fwd_bwd_s * 1e3:.3g} ms fwd+bwd" + (
            f" ({self.note})" if self.note else "")


def predict(calibration: Calibration | None, implementation: str, problem: Problem,
            launches: int | None = None) -> Prediction | None:
    """`implementation`'s predicted time on `problem`, or None where the calibration has no rates for it.
    `launches`: kernel launches that pay the per-call overhead (None: one per ring step; a fused ring's one
    kernel per pass walks every step in one launch)."""
    if calibration is None:
        return None
    rates = calibration.rates_for(implementation, problem.dtype, problem.precision)
    if rates is None:
        return None
    (flops, flops_bwd), n, feats = kernel_flops(problem), calls(problem), priced_features(problem)
    # the causal line where one causal kernel does a triangle of work; a ring's steps, and an all-gather's
    # local queries against every key, are mostly whole blocks (2 H100, 2026-11-25: the all_gather rows at 8K
    # and 32K tokens per GPU within 2% on the plain line, 8K 7% high on the causal one,
    # benchmarks/results/nvidia-h100-80gb-hbm3_x2_2026-11-25_strategies.jsonl)
    causal = problem.opts.causal and n == 1 and not (problem.opts.gather_kv and problem.opts.axis_size > 1)
    # measured at one head_dim for q, k and v: a v of another width is priced at their mean (the FLOPs'
    # average matmul width)
    dim = (problem.head_dim + problem.v_head_dim) / 2
    rows = n * row_units(problem)
    paid = n if launches is None else launches
    fwd = rates.seconds("fwd", flops, paid, dim, feats, causal, rows)
    fwd_bwd = rates.seconds("fwd_bwd", flops_bwd, paid, dim, feats, causal, rows)
    notes = [rates.note] if rates.note else []
    if rates.lent(dim, feats):
        notes.append("priced by other implementations' factors: " + ", ".join(rates.lent(dim, feats)))
    if rates.unmeasured(feats):
        notes.append("unmeasured, priced as plain: " + ", ".join(rates.unmeasured(feats)))
    if problem.opts.has_segments and known_documents(problem) is None:
        notes.append("segment ids not known when traced: priced as if no block were skipped")
    return Prediction(implementation, fwd, fwd_bwd, "; ".join(notes))


# ---------------------------------------------------------------------------- fitting


def problem_of(row: Mapping[str, Any], platform: str = "gpu", device_kind: str = "") -> Problem:
    """The one-device Problem a kernel measurement ran (its features as `ringjax.options.TUNABLE` keywords)."""
    from ringjax.options import TUNABLE, make_options

    features = dict(row.get("features", {}))
    unknown = sorted(set(features) - set(TUNABLE))
    if unknown:
        raise ValueError(f"calibration row has unknown feature(s) {unknown}; features are {sorted(TUNABLE)}")
    if "sliding_window" in features and isinstance(features["sliding_window"], list):
        features["sliding_window"] = tuple(features["sliding_window"])
    opts = make_options(row["head_dim"], axis_name=None, axis_size=1,
                        **{TUNABLE[k].option_name: v for k, v in features.items()})
    return Problem(opts=opts, batch=row["batch"], seq=row["seq"], heads=row["heads"], kv_heads=row["kv_heads"],
                   head_dim=row["head_dim"], dtype=row["dtype"], platform=platform, device_kind=device_kind,
                   precision=precisions.canonical(row.get("precision", "default")) if row["dtype"] == "float32"
                   else precisions.DEFAULT,
                   documents=equal_documents(MEASURED_DOCUMENTS, row["seq"]) if opts.has_segments else None)


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(overhead s, FLOP/s) of time = overhead + flops / rate, least squares, overhead >= 0."""
    if len({f for f, _ in points}) > 1:
        f, t = np.array(points).T
        slope, intercept = np.polyfit(f, t, 1)
        if intercept >= 0 and slope > 0:
            return float(intercept), float(1.0 / slope)
    return 0.0, sum(f for f, _ in points) / sum(t for _, t in points)


# a row whose time the line's fixed costs take more of than this prices no feature: the H200 lines, fitted to
# 8K and 32K alone, have a 0.49 ms forward intercept that took all of the 8K masks' 0.48-0.59 ms, so their
# factors fitted to 0-0.002 and 32K masks were predicted 69-87% low
_MOST_FIXED = 0.8
# calls this short are launch-bound on Hopper (one H100, 2026-12-05: Mosaic's causal forward took 87 us at 256, 1K
# and 88-95 us at 2K tokens): the shortest of them measured is each line's floor (`Line.floor_s`); a longer row
# would price every shorter call at its own time
FLOOR_SEQ = 2048
# where too few lengths were measured, the per-row term may raise the line's rate over the intercept's by at most
# this: fitted to 8K and 32K it moved the H100's Mosaic forward 16% (right, by 1K-32K rows); to 1K-4K rows synced
# with the host, which grow with the length, it put all the time in the rows and the H100's Triton forward (not
# causal) at 3400 TFLOP/s, pricing a 32K call 10 ms where it takes about 40
_MOST_ROW_GAIN = 1.25
# lengths a kernel line needs for its per-row term: at least this many, the longest this many times the shortest
_ROW_FIT_LENGTHS, _ROW_FIT_SPAN = 4, 8


def _fit_kernel_line(points: list[tuple[int, float, float, float]]) -> tuple[float, float, float]:
    """(overhead s, FLOP/s, s per row unit) of time = overhead + rows * row_s + flops / rate from (length, flops,
    rows, seconds) points, least squares on the relative error (a 1K call's miss counts as much as a 32K
    one's). Measured on one H100 from 1K to 32K tokens (2026-11-26), a causal kernel's time is not affine in
    its FLOPs (its diagonal tiles are whole): two terms missed 1K by 80% or 32K by 13%, three are within 7%
    fwd+bwd. Every term stays >= 0, the best fitting subset kept: the H200's forward+backward (2026-11-28)
    costs 0.5 ms at any length, and all three terms then asked for a negative per-row cost. Fewer lengths
    than `_ROW_FIT_LENGTHS` spanning `_ROW_FIT_SPAN` x cannot tell the terms apart: two terms, least squares
    on the absolute error, the fixed one per row where it is positive (fitted to 8K and 32K alone, the H100's
    Mosaic forward then gets the 1K-32K line's rate within 1%, where an intercept put it 16% low; the H200's
    intercept of 0.49 ms was above its 8K masks' whole time)."""
    lengths = sorted({n for n, *_ in points})
    if len(lengths) >= _ROW_FIT_LENGTHS and lengths[-1] >= _ROW_FIT_SPAN * lengths[0]:
        _, f, r, t = np.array(points, dtype=float).T
        design = np.stack([np.ones_like(f), f, r], 1) / t[:, None]
        best = None  # the fixed terms that fit best with every coefficient >= 0 (the FLOP term always)
        for terms in ([0, 1, 2], [0, 1], [1, 2]):
            coef = np.zeros(3)
            coef[terms] = np.linalg.lstsq(design[:, terms], np.ones_like(t), rcond=None)[0]
            miss = float(np.sum((design @ coef - 1) ** 2))
            if coef.min() >= 0 and coef[1] > 0 and (best is None or miss < best[0]):
                best = (miss, coef)
        if best is not None:
            return float(best[1][0]), float(1.0 / best[1][1]), float(best[1][2])
    overhead, rate = _fit_line([(f, t) for _, f, _, t in points])
    if overhead > 0:  # so at two lengths or more
        _, f, r, t = np.array(points, dtype=float).T
        per_flop, row_s = np.linalg.lstsq(np.stack([f, r], 1), t, rcond=None)[0]
        if per_flop > 0 and row_s >= 0 and 1.0 / per_flop <= _MOST_ROW_GAIN * rate:
            return 0.0, float(1.0 / per_flop), float(row_s)
    return overhead, rate, 0.0


def _fit_rate(points: list[tuple[int, float, float, float]], overhead: float, row_s: float) -> float:
    """FLOP/s of time = overhead + rows * row_s + flops / rate with the fixed terms given, least squares on the
    relative error, from (length, flops, rows, seconds) points."""
    _, f, r, t = np.array(points, dtype=float).T
    work = np.maximum(t - overhead - r * row_s, 1e-9 * t)  # what the FLOPs take
    return float(np.sum((f / t) ** 2) / np.sum(f * work / t ** 2))


# lengths, relative to each fitted one, at which a forward must be priced below its forward+backward
_BELOW_SCALES = (1 / 64, 1 / 16, 1 / 4, 1.0, 4.0, 32.0)


def _forward_below(fitted: Mapping[str, list], overhead: Mapping[str, float], per_row: Mapping[str, float],
                   tflops: Mapping[str, float]) -> bool:
    """Whether the forward line prices every fitted call, and each at 1/64 to 32 x its length (FLOPs by the
    square, rows by the length), below the forward+backward line. Asked term by term instead, the H200's Mosaic
    forward (2026-11-28) lost its per-row term to a forward+backward line that has none (0.48 ms fixed):
    32K forwards then read 10-28% high and 1K-4K ones 15-23% low."""
    for _, flops, rows, _ in fitted["fwd"]:
        for x in _BELOW_SCALES:
            f, r = flops * x * x, rows * x
            fwd = overhead["fwd"] + per_row["fwd"] * r + f / (tflops["fwd"] * 1e12)
            both = overhead["fwd_bwd"] + per_row["fwd_bwd"] * r + f * BACKWARD_FACTOR / (tflops["fwd_bwd"] * 1e12)
            if fwd >= both:
                return False
    return True


def _row_units(row: Mapping[str, Any]) -> float:
    return row_units(problem_of(row))


def fit_rates(rows: Sequence[Mapping[str, Any]]) -> Rates:
    """Rates of one implementation at one dtype class from its measurements (see the module docstring)."""
    measured = []  # (row, forward FLOPs its kernels compute, priced features, head_dim, causal)
    for row in rows:
        p = problem_of(row)
        measured.append((row, kernel_flops(p)[0], frozenset(priced_features(p)), p.head_dim, p.opts.causal))
    if not measured:
        raise ValueError("no measurement to fit rates to")
    fewest = min(len(m[2]) for m in measured)
    dims = [m[3] for m in measured if len(m[2]) == fewest]
    ref_dim = REFERENCE_HEAD_DIM if REFERENCE_HEAD_DIM in dims else max(set(dims), key=dims.count)
    note = "" if fewest == 0 else "no plain measurement: fitted to rows with features, priced as plain"
    if ref_dim != REFERENCE_HEAD_DIM:
        note = "; ".join(filter(None, [note, f"measured at head_dim {ref_dim} only"]))
    # calls per timed sample (1: each synced with the host, which adds its wait to every call; rows written before
    # the field existed were synced); rates fitted to both mix the host's wait into some rows' kernel time
    timings = sorted({row.get("back_to_back", 1) for row in rows})
    if len(timings) > 1:
        note = "; ".join(filter(None, [note, "rows timed synced and back to back mixed ("
                                       + " / ".join(map(str, timings)) + " calls per sample)"]))
    lines = {}
    for causal in (True, False):
        base = [(row, flops) for row, flops, f, d, c in measured if len(f) == fewest and d == ref_dim and c == causal]
        if not base:
            continue
        tflops, overhead, per_row, fitted = {}, {}, {}, {}
        for mode, scale in (("fwd", 1.0), ("fwd_bwd", BACKWARD_FACTOR)):
            points = [(row["seq"], flops * scale, _row_units(row), row[f"{mode}_ms"] * 1e-3) for row, flops in base
                      if row.get(f"{mode}_ms")]
            if not points and mode == "fwd_bwd":  # forward only: assume the convention's ratio
                points = [(row["seq"], flops * scale, _row_units(row), row["fwd_ms"] * 1e-3 * scale)
                          for row, flops in base]
            overhead[mode], rate, per_row[mode] = _fit_kernel_line(points)
            tflops[mode] = rate / 1e12
            fitted[mode] = points
        if not _forward_below(fitted, overhead, per_row, tflops):
            # a forward+backward runs the forward; lines fitted to two lengths can say otherwise (XLA on one H100:
            # 3.0 ms forward, 1.2 forward+backward, which priced small calls' forwards above their
            # forward+backward): the forward's fixed costs take the backward's
            overhead["fwd"], per_row["fwd"] = min(overhead["fwd"], overhead["fwd_bwd"]), min(per_row["fwd"],
                                                                                                per_row["fwd_bwd"])
            tflops["fwd"] = _fit_rate(fitted["fwd"], overhead["fwd"], per_row["fwd"]) / 1e12
        floor = {mode: min((t for n, *_, t in fitted[mode] if n <= FLOOR_SEQ), default=0.0) for mode in fitted}
        lines[causal] = Line(tflops, overhead, per_row, floor)
    fallback = lines.get(True) or lines[False]

    def factor(row, flops, causal, mode, scale):
        """Time per FLOP of `row` over its line's (above 1: slower); None where the line's fixed costs take
        nearly all of the row's time, so that what is left would price the line's intercept, not the feature."""
        t, line = row.get(f"{mode}_ms"), lines.get(causal, fallback)
        if not t:
            return None
        fixed = line.fixed_s(mode, 1, _row_units(row))
        if fixed > _MOST_FIXED * t * 1e-3:
            return None
        return (t * 1e-3 - fixed) * line.tflops[mode] * 1e12 / (flops * scale)

    modes = (("fwd", 1.0), ("fwd_bwd", BACKWARD_FACTOR))
    # with no plain row the base rows' features are in the line: priced 1.0, not lent by other implementations
    features: dict[str, dict[str, float]] = {name: {m: 1.0 for m in MODES} for m_ in measured
                                            if len(m_[2]) == fewest for name in m_[2]}
    # a pass prices the features of rows whose other features earlier passes priced (geometric mean of rows)
    for _ in range(3):
        found: dict[str, dict[str, list[float]]] = {}
        for row, flops, feats, d, causal in measured:
            unknown = [name for name in feats if name not in features]
            if len(feats) <= fewest or len(unknown) != 1 or d != ref_dim:
                continue
            for mode, scale in modes:
                x = factor(row, flops, causal, mode, scale)
                if x is not None:
                    for known in feats - {unknown[0]}:
                        x /= features[known].get(mode, 1.0)
                    found.setdefault(unknown[0], {}).setdefault(mode, []).append(x)
        features.update({name: {mode: _geomean(xs) for mode, xs in by_mode.items()} for name, by_mode in found.items()})
    # head_dims from every row whose features are priced: its rate over the line's, those features divided out
    def plain_factor(row, flops, feats, causal, mode, scale):
        x = factor(row, flops, causal, mode, scale)
        if x is None or len(feats) == fewest:  # the base rows' own features are priced as plain
            return x
        if any(name not in features for name in feats):
            return None
        return x / math.prod(features[name].get(mode, 1.0) for name in feats)

    head_dims: dict[int, dict[str, float]] = {}
    for d in sorted({m[3] for m in measured} - {ref_dim}):
        for mode, scale in modes:
            found_d = [plain_factor(row, flops, feats, c, mode, scale)
                       for row, flops, feats, dd, c in measured if dd == d]
            found_d = [x for x in found_d if x]
            if found_d:
                head_dims.setdefault(d, {})[mode] = 1.0 / _geomean(found_d)
    return Rates(lines, head_dims, features, len(rows), note)


def _lend(rates: Mapping[tuple[str, str], Rates]) -> dict[tuple[str, str], Rates]:
    """Each implementation's rates with the head_dims and features it lacks priced by the geometric mean of
    the factors the others of its dtype class measured."""

    def borrow(mine: Mapping, theirs: list[Mapping], label: str, borrowed: set[str], floor: float = 0.0) -> dict:
        table = dict(mine)
        for key in sorted({k for t in theirs for k in t} - set(mine) - {REFERENCE_HEAD_DIM}, key=str):
            found = [t[key] for t in theirs if key in t]
            table[key] = {m: max(floor, _geomean([f[m] for f in found if m in f])) for m in MODES
                          if any(m in f for f in found)}
            borrowed.add(label.format(key))
        return table

    out = {}
    for (name, dtype), own in rates.items():
        peers = [r for (n, d), r in rates.items() if d == dtype and n != name]
        borrowed = set(own.borrowed)
        head_dims = borrow(own.head_dims, [r.head_dims for r in peers], "head_dim {}", borrowed)
        # a lent feature never prices a visible pair below the borrower's plain rate: a factor below 1 is the
        # lender's own line at work (the Mosaic line's per-row term, fitted to plain calls, takes nearly all of
        # a 32K window's time, leaving its FLOPs a factor of 1e-6), which the borrower's line does not share.
        # Lent as it was, it priced XLA's 32K window at 1.2 ms (measured 150 ms with sink tokens) and auto ran
        # XLA there (1 H100, 2026-11-27)
        features = borrow(own.features, [r.features for r in peers], "{}", borrowed, floor=1.0)
        out[(name, dtype)] = dataclasses.replace(own, head_dims=head_dims, features=features,
                                                 borrowed=frozenset(borrowed))
    return out


def _geomean(xs: Sequence[float]) -> float:
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs)))


def fit_collective(rows: Sequence[Mapping[str, Any]]) -> Collective:
    latency, rate = _fit_line([(float(r["bytes"]), r["ms"] * 1e-3) for r in rows])
    return Collective(latency, rate)


# ---------------------------------------------------------------------------- files


def empty_document(device_kind: str) -> dict[str, Any]:
    return {"format": FORMAT, "schema": SCHEMA, "device_kind": device_kind, "kernels": [], "collectives": []}


def check_document(doc: Any, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("schema") != SCHEMA:
        raise ValueError(f"{where} is not a {FORMAT} file of schema {SCHEMA}")
    for name in ("kernels", "collectives"):
        if not isinstance(doc.get(name), list):
            raise ValueError(f"{where}: {name!r} must be a list of measurements")
    return doc


def from_document(doc: Mapping[str, Any], path: str = "") -> Calibration:
    """Fit a calibration document's measurements (rows that cannot be fitted are an error naming them)."""
    doc = check_document(doc, path or "calibration")
    groups: dict[tuple[str, str], list] = {}
    for row in doc["kernels"]:
        key = (row["implementation"], dtype_class(row["dtype"], precisions.canonical(row.get("precision", "default"))
                                                  if row["dtype"] == "float32" else precisions.DEFAULT))
        groups.setdefault(key, []).append(row)
    kinds: dict[str, list] = {}
    for row in doc["collectives"]:
        kinds.setdefault(row["collective"], []).append(row)
    return Calibration(
        device_kind=doc["device_kind"],
        rates=_lend({key: fit_rates(rows) for key, rows in groups.items()}),
        collectives={kind: fit_collective(rows) for kind, rows in kinds.items()},
        path=path,
        hbm_bytes=float(doc.get("hbm_bytes", 0.0)),
    )


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime: float) -> Calibration:
    return from_document(json.loads(Path(path).read_text()), path)


def load(device_kind: str) -> Calibration | None:
    """The calibration of `device_kind`: the user's file, else the shipped one, else None."""
    if not device_kind:
        return None
    for path in (path_for(device_kind), path_for(device_kind, shipped=True)):
        if path.is_file():
            try:
                return _load(str(path), path.stat().st_mtime)
            except (OSError, ValueError, KeyError, TypeError) as e:
                cache._warn_once(path, f"ignoring calibration {path}: {e}")
    return None


def for_problem(problem: Problem) -> Calibration | None:
    """The calibration of the device kind `problem` runs on (None if unknown, e.g. no such device here)."""
    kind = problem.device_kind
    if not kind:
        try:
            kind = problem.resolved().device_kind
        except RuntimeError:  # a platform this host does not have, and no device kind named
            return None
    return load(kind)

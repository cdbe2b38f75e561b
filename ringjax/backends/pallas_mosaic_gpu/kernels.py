"""One ring step as Pallas Mosaic GPU kernels for Hopper (sm90): TMA, wgmma, warp specialisation.

Every kernel has three warpgroups: two consumers, each owning a 64-row tile in registers,
and one producer that streams the other operand's tiles by TMA into a ring of shared-memory
slots (`*_stages` deep), guarded by one "loaded" barrier per slot and buffer and one
"consumed" barrier per slot that both consumers arrive on.

- forward: a consumer owns 64 queries of one head; K/V blocks stream. With GQA the two
  consumers take two query heads of one group on the same rows, so both use each K/V tile
  and see the same mask; otherwise they take two adjacent row tiles of one head. The two
  consumers alternate their matmuls and their softmax (a schedule barrier, FlashAttention-3's
  ping-pong); logits are scaled into base 2 once so the softmax runs on exp2.
- dQ: the forward's layout; per K/V block S = QK^T, dP = dO V^T, dQ += dS K.
- dK/dV: a consumer owns 64 keys of one KV head; (q, dO, lse, delta) tiles of every query
  head of the group stream, so dK/dV come out reduced over the group: S^T = K Q^T,
  dV += P^T dO, dP^T = V dO^T, dK += dS^T Q.
- head_dim > 128 in the backward: the two float32 accumulators of a 256-wide row do not fit a
  thread's registers, so both consumers take the same row tile and each accumulates one half
  of the head_dim; every d-wide tile is stored as two halves, and S and dP sum a wgmma per half
  (each consumer computes them whole: the price of the split).
- v may have a head_dim of its own (multi-head latent attention): q, k, dQ and dK tiles are d wide,
  v, dO, out and dV tiles dv wide; the backward splits when either exceeds 128, halving each.

Visiting: per 64-row tile the producer and consumers walk the blocks [lo, hi) of a table
built in XLA (`visits.range_table`): fully visible blocks take no mask, the others get the
element mask from `masks.visible_pairs` on global positions, hidden blocks are skipped.
The producer streams the union of its two consumers' ranges; a consumer outside its own
range only waits and releases the slot, so the barrier phases stay in step. A step the
mask empties streams nothing and writes zeros (out) and -inf (lse).

Positions inside a block are affine, base + stride * i (stride = ring size for the striped
layout, 1 otherwise), as `layouts.local_positions` makes them; blocks never straddle a zigzag
chunk. Results leave through shared memory by TMA in chunks of a 128-byte swizzled row: float32, or
in the inputs' dtype where they are final (`out_dtype`: the forward's output, a lone step's gradients).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ringjax import _compat
from ringjax.backends.pallas_mosaic_gpu.config import (
    ROWS,
    MosaicGpuConfig,
    dq_k_copy,
    epilogue_slots,
    sinks_apart,
    split_head_dim,
)
from ringjax.core.dense import few_keys_grads
from ringjax.core.masks import (
    Extras,
    StepOptions,
    TokenInfo,
    array_module,
    flag_sink_ids,
    is_sink_step,
    may_skip,
    tile_ids,
    visible_pairs,
)
from ringjax.core.modifiers import (
    LOG2E,
    alibi_distance_pairs,
    cap_slope,
    dropout_keep_terms,
    dropout_key,
    dropout_terms,
    folded_scores,
    logit_factor,
    logits2,
)
from ringjax.core.schedule import reach
from ringjax.core.tiles import block_stride
from ringjax.core.visits import block_starts, half_flags, on_device, range_table, sink_range_table
from ringjax.options import AttentionOptions

_LN2 = math.log(2.0)
# per-thread registers after setmaxnreg: the consumers take what the producer gives up (a block of 384
# threads starts with 168 each); the dK/dV consumer holds two accumulators and gets the most
_REGS = {"fwd": (232, 40), "dq": (232, 40), "dkv": (240, 24)}


@dataclasses.dataclass(frozen=True)
class _Walk:
    """Static shape of one launch's visiting: blocks, strides and pairing of the two consumers."""

    block: int  # streamed block (keys for forward and dQ, queries for dK/dV)
    n_blocks: int  # streamed blocks in the step
    stages: int
    ranged: bool  # False: the mask hides nothing, every block is fully visible, no table
    pair_heads: bool  # the consumers take two heads of one group (else two row tiles)
    heaviest_last: bool  # causal forward/dQ: the last row tiles see the most keys; launch them first
    row_stride: int  # position step inside a row tile
    col_stride: int  # position step inside a streamed block
    n_ctas: int  # CTAs along the rows
    prefix: bool = False  # the table starts with a range of sink-token blocks visited before [lo, hi)
    # backward with head_dim > 128: both consumers take the same row tile, each accumulates half of the
    # head_dim (the two float32 accumulators of a whole 256-wide row do not fit a thread's registers) and
    # scores half of each streamed block (the dK/dV kernel's consumers exchange P^T and dS^T each block through
    # shared memory, the dQ kernel's sum their dQ once at the end); tiles are stored as two halves
    # [2, rows, d / 2] and the scores sum a wgmma per half
    split: bool = False
    # the main range's blocks walked last first (dK/dV under a causal mask: `MosaicGpuConfig.bwd_reverse`)
    reverse: bool = False
    # the table's rows end with `visits.half_flags`: a masked block at either end of the main range (or at the end
    # of the prefix) whose other half the tile cannot see is scored half-wide (`MosaicGpuConfig.half_blocks`)
    halves: bool = False

    @property
    def columns(self) -> int:
        """Bounds per row of the visit table, the half flags aside."""
        return 6 if self.prefix else 4


# --------------------------------------------------------------------------- shared pieces


class _Refs:
    """A kernel's refs in order (inputs, outputs, scratch); optional ones are taken only when present."""

    def __init__(self, refs):
        self._refs = list(refs)

    def take(self, n: int = 1, present: bool = True):
        if not present:
            return None if n == 1 else [None] * n
        out, self._refs = self._refs[:n], self._refs[n:]
        return out[0] if n == 1 else out


def _transforms(cols: int, dtype, widest: int = 128):
    """Tiling + the widest swizzle (128, 64 or 32 bytes, at most `widest`) that tiles a row of a [rows, cols]
    shared-memory tile (what wgmma and TMA want): 96 bf16 columns take 64-byte swizzles."""
    item = jnp.dtype(dtype).itemsize
    swizzle = next(w for w in (128, 64, 32) if w <= widest and (cols * item) % w == 0)
    return (plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle))


def _zeros(shape, layout=None):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout or plgpu.Layout.WGMMA)


def _segments(seg_ref, smem, bar, b, block, size: int, wg, axis: int, part=None):
    """Segment ids of block `block` of `size` tokens of batch row b, loaded through this consumer's shared
    memory in the wgmma layout of a tile's rows (axis 1) or columns (axis 0); None without segments.
    `part`: only those of the block's tokens (a half block, `_Keys.part`)."""
    if seg_ref is None:
        return None  # before any index arithmetic: kernels without segments trace none of it
    plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(block * size, size)], smem.at[wg], bar.at[wg])
    plgpu.barrier_wait(bar.at[wg])
    ids = smem.at[wg] if part is None else smem.at[wg, part]
    return plgpu.load(ids, layout=plgpu.Layout.WGMMA.reduce(axis))


class _Keys(NamedTuple):
    """The rows of a streamed block that one visit scores: all (`part` None), or one half (`_block_keys`)."""

    start: int
    width: int
    part: slice | None

    def of(self, ref):
        """ref (one slot of a streamed block's rows), cut to these rows."""
        return ref if self.part is None else ref.at[self.part]


def _block_keys(kind: str, block: int) -> _Keys:
    """What a visit of `kind` scores of a `block`-row streamed block: all of it, or (the forward's half blocks,
    "half0" / "half1", `_walk_tile`) its first or second half."""
    if kind not in ("half0", "half1"):
        return _Keys(0, block, None)
    half = block // 2
    start = half if kind == "half1" else 0
    return _Keys(start, half, pl.ds(start, half))


class _Pos(NamedTuple):
    """Global positions of a [rows, cols] tile: int32 vectors in the wgmma layouts of its rows and columns."""

    rows: jax.Array
    cols: jax.Array

    def full(self):
        """(row, column) positions of every element, in the tile's wgmma layout."""
        shape = (self.rows.shape[0], self.cols.shape[0])
        return lax.broadcast_in_dim(self.rows, shape, [0]), lax.broadcast_in_dim(self.cols, shape, [1])


def _tile_positions(shape, row0, col0, walk: _Walk) -> _Pos:
    """The positions of a [rows, cols] tile's rows and columns (per-element arithmetic stays per vector)."""
    rows = row0 + walk.row_stride * plgpu.broadcasted_iota(jnp.int32, shape[:1], 0,
                                                           layout=plgpu.Layout.WGMMA.reduce(1))
    return _Pos(rows, _tile_columns(shape[1], col0, walk))


def _tile_columns(cols: int, col0, walk: _Walk):
    """The positions of a tile's `cols` columns, in the wgmma layout of its columns."""
    return col0 + walk.col_stride * plgpu.broadcasted_iota(jnp.int32, (cols,), 0,
                                                           layout=plgpu.Layout.WGMMA.reduce(0))


def _reads_positions(opts) -> bool:
    """Whether the mask rules read token positions; without them only segment ids decide."""
    return opts.causal or opts.window is not None or opts.chunk_size is not None or opts.num_sink_tokens > 0


def _needs_positions(opts, kind: str, alibi_by_column: bool = False) -> bool:
    """Whether a visit of `kind` ("full", "masked" or a half block; skips score nothing) reads its tile's
    positions (`alibi_by_column`: ALiBi reads only the columns, `_Mods.column_bias`). Mosaic GPU's layout
    inference gives up on vectors nobody reads, so a tile builds its positions only where something uses them."""
    alibi = opts.has_alibi and not alibi_by_column
    return (kind != "full" and _reads_positions(opts)) or alibi or opts.dropout_rate > 0


def _mask(opts, shape, pos: "_Pos | None", rows_are_queries: bool, row_seg=None, col_seg=None):
    """masks.visible_pairs on a [rows, cols] tile: its positions (None when the rules read none) and segment
    ids (rows [rows], columns [cols])."""
    rpos, cpos = pos.full() if _reads_positions(opts) else (None, None)
    rseg = cseg = None
    if row_seg is not None:
        rseg = lax.broadcast_in_dim(row_seg, shape, [0])
        cseg = lax.broadcast_in_dim(col_seg, shape, [1])
    qpos, kpos, qseg, kseg = (rpos, cpos, rseg, cseg) if rows_are_queries else (cpos, rpos, cseg, rseg)
    return visible_pairs(opts, qpos, kpos, *tile_ids(opts, qpos, kpos, qseg, kseg))  # ids: `_segment_tables`


@dataclasses.dataclass(frozen=True)
class _Mods:
    """The score modifiers of one (batch row, head): ALiBi's slope and dropout's key."""

    slope: jax.Array | None  # this head's ALiBi slope (natural units)
    key: jax.Array | None  # dropout's uint32 key of (seed, b * heads + h in global heads)

    @classmethod
    def read(cls, opts, refs, b, head):
        slopes_ref, seed_ref, bh_ref = refs
        slope = slopes_ref[head] if opts.has_alibi else None
        key = None
        if opts.dropout_rate > 0:
            key = dropout_key(seed_ref[0], seed_ref[1], b * bh_ref[0] + bh_ref[1] + head)
        return cls(slope, key)

    def distance(self, pos: "_Pos | None"):
        """-|i - j| of the tile at positions `pos` (ALiBi's factor), or None without ALiBi."""
        return None if self.slope is None else alibi_distance_pairs(*pos.full())

    def bias2(self, offsets):
        """slope log2(e) times positions' `_Offsets` from a tile's origin: causal ALiBi's base-2 part of them."""
        return (self.slope * LOG2E) * offsets

    def column_bias(self, cols, row0):
        """The forward's causal ALiBi: the keys' part (`_Offsets`) of a tile whose first query, row0, is the origin,
        so the shifted logits stay within slope * (rows - 1) * row stride of the true ones."""
        return plgpu.layout_cast(self.bias2(_offsets(cols, row0)), plgpu.Layout.WGMMA.reduce(0))

    def row_bias(self, walk: "_Walk"):
        """slope (i - row0) of a row tile's rows (natural units): the queries' part, which the forward puts back
        into each row's lse."""
        rows = walk.row_stride * plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
        return plgpu.layout_cast(self.slope * rows.astype(jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def keep(self, opts, pos: _Pos, rows_are_queries: bool):
        """Dropout's keep mask of the tile (core/modifiers' hash), or None without dropout."""
        if self.key is None:
            return None
        qpos, kpos = (pos.rows, pos.cols) if rows_are_queries else (pos.cols, pos.rows)
        qterm, kterm = dropout_terms(self.key, qpos, kpos)  # per vector; only the mixing is per element
        shape = (pos.rows.shape[0], pos.cols.shape[0])
        q_axis, k_axis = (0, 1) if rows_are_queries else (1, 0)
        return dropout_keep_terms(opts.dropout_rate, lax.broadcast_in_dim(qterm, shape, [q_axis]),
                                  lax.broadcast_in_dim(kterm, shape, [k_axis]))


def _mod_refs(opts, refs: _Refs):
    """The modifier inputs (slopes, seeds, (batch, head) counter) of a kernel, None where unused."""
    slopes = refs.take(1, opts.has_alibi)
    seed, bh = refs.take(2, opts.dropout_rate > 0)
    return slopes, seed, bh


def _mod_args(opts, extras, heads: int):
    """The kernel inputs `_mod_refs` reads, from a step's extras."""
    args = []
    if opts.has_alibi:
        args.append(extras.alibi_slopes.astype(jnp.float32))
    if opts.dropout_rate > 0:
        hs = extras.head_slice
        bh = jnp.array([heads, 0], jnp.int32) if hs is None else jnp.stack([hs[1], hs[0]]).astype(jnp.int32)
        args += [extras.dropout_seed.astype(jnp.uint32), bh]
    return args


def _scores2(raw, opts, dist, mods: _Mods):
    """Base-2 logits of a raw q.k tile: scale, soft cap, ALiBi; and the soft cap's tanh (or None)."""
    s2, t = logits2(raw, opts)
    if dist is not None:
        s2 = s2 + (mods.slope * LOG2E) * dist
    return s2, t


def _probs(s, opts, mods: _Mods, pos, lse, rows_are_queries: bool, segments=None, origin=None):
    """The backward's recomputed softmax of a raw score tile (rows queries, or keys: transposed): P = exp2 of the
    base-2 logits less the rows' (or columns') base-2 lse, masked where `segments` (row ids, column ids) is
    given; with the dropout keep mask, the soft cap's tanh and ALiBi's distances (each None where unused).

    Causal ALiBi with `origin` (a position within the tile's rows) is kept separable (`_Offsets`): the keys'
    part joins the scores and the queries' part the lse, and the distances come back as the two offset vectors
    (`_slope_grad` reads either form)."""
    q_axis, k_axis = (0, 1) if rows_are_queries else (1, 0)
    if origin is not None and mods.slope is not None and opts.causal:
        qv, kv = (pos.rows, pos.cols) if rows_are_queries else (pos.cols, pos.rows)
        dist = _Offsets(*(_offsets(v, origin) for v in (qv, kv)))
        s2, t = logits2(s, opts)
        s2 = s2 + lax.broadcast_in_dim(mods.bias2(dist.keys), s2.shape, [k_axis])
        lse = lse + mods.bias2(dist.queries)
    else:
        dist = mods.distance(pos)
        s2, t = _scores2(s, opts, dist, mods)
    p = jnp.exp2(s2 - lax.broadcast_in_dim(lse, s2.shape, [q_axis]))
    if segments is not None:
        p = jnp.where(_mask(opts, p.shape, pos, rows_are_queries, *segments), p, 0.0)
    keep = mods.keep(opts, pos, rows_are_queries) if opts.dropout_rate > 0 else None
    return p, keep, t, dist


class _Lag(NamedTuple):
    """The fused backward's loop state for dQ, computed a visit late: the visits whose dS^T was stored (their
    parity picks the buffer), and the query block and head of the last one, whose dQ is still to be written."""

    visits: jax.Array
    block: jax.Array
    head: jax.Array


class _Offsets(NamedTuple):
    """Query and key positions less a tile's origin o (float32 vectors): causal ALiBi's distances kept separable.
    Causal, every visible pair has j <= i, so -slope |i - j| = slope (j - o) - slope (i - o): the queries' term
    is one per row, which the softmax drops and the lse carries, and the keys' term costs an add per score in
    place of a distance per score (the forward, `_Mods.column_bias` / `row_bias`; the backward, `_probs`)."""

    queries: jax.Array
    keys: jax.Array


def _offsets(positions, origin):
    """`positions` less `origin`, as float32 (one vector of `_Offsets`)."""
    return (positions - origin).astype(jnp.float32)


def _slope_grad(ds, dist, rows_are_queries: bool = True):
    """Per row of `ds` (queries, or keys: dS^T), the sum of dS times the distance: ALiBi's slope gradient, from a
    distance tile or from `_Offsets` (row i: sum_j dS_ij (j - o) - (i - o) sum_j dS_ij, keys j - o less queries
    i - o; transposed, the keys' offsets are the rows')."""
    if not isinstance(dist, _Offsets):
        return (ds * dist).sum(axis=1)
    if rows_are_queries:
        return (ds * lax.broadcast_in_dim(dist.keys, ds.shape, [1])).sum(axis=1) - dist.queries * ds.sum(axis=1)
    return dist.keys * ds.sum(axis=1) - (ds * lax.broadcast_in_dim(dist.queries, ds.shape, [1])).sum(axis=1)


def _bounds(rng_ref, row, tile, n_blocks: int, walk: _Walk):
    """(plo, phi, lo, flo, fhi, hi, lo_half, hi_half, prefix_half) of one tile; an empty range gets its bounds at
    n_blocks. The half flags (0 or 1, 0 unless `walk.halves`): block lo / hi - 1 / phi - 1 is scored half-wide."""
    big, z = jnp.int32(n_blocks), jnp.int32(0)
    if not walk.ranged:
        return z, z, z, z, big, big, z, z, z
    vals = [rng_ref[row, tile, c] for c in range(walk.columns)]
    prefix = vals[:2] if walk.prefix else [big, big]
    lo, flo, fhi, hi = vals[-4:]
    empty = hi <= lo
    main = [jnp.where(empty, big, x) for x in (lo, flo, fhi, hi)]
    pempty = prefix[1] <= prefix[0]
    halves = [rng_ref[row, tile, walk.columns + c] for c in range(3 if walk.prefix else 2)] if walk.halves else []
    halves += [z] * (3 - len(halves))
    return (*[jnp.where(pempty, big, x) for x in prefix], *main, *halves)


def _span(b0, b1, lo_i: int, hi_i: int):
    """First block and number of blocks of the union of two tiles' ranges [b[lo_i], b[hi_i])."""
    lo = jnp.minimum(b0[lo_i], b1[lo_i])
    hi = jnp.maximum(jnp.where(b0[hi_i] > b0[lo_i], b0[hi_i], 0), jnp.where(b1[hi_i] > b1[lo_i], b1[hi_i], 0))
    return lo, jnp.maximum(hi - lo, 0)


@dataclasses.dataclass(frozen=True)
class _Span:
    """What the producer streams for a CTA: blocks [plo, plo + pn) (sink prefix), then [lo, lo + n)."""

    plo: jax.Array
    pn: jax.Array
    lo: jax.Array
    n: jax.Array
    reverse: bool = False  # [lo, lo + n) streamed last first

    @classmethod
    def union(cls, b0, b1, reverse: bool = False):
        return cls(*_span(b0, b1, 0, 1), *_span(b0, b1, 2, 5), reverse)

    @property
    def steps(self):
        return self.pn + self.n

    def block(self, i):
        """The block streamed at visit i."""
        main = self.lo + self.n - 1 - (i - self.pn) if self.reverse else self.lo + i - self.pn
        return jnp.where(i < self.pn, self.plo + i, main)

    def visit(self, i):
        """(head within the group, block) of visit i of a walk that takes each head of the group in turn."""
        gi = lax.div(i, jnp.maximum(self.steps, 1))
        return gi, self.block(i - gi * self.steps)


def _walk_tile(span: _Span, bounds, body, carry, walk: _Walk):
    """carry = body(visit, block, carry, kind) over the CTA's visits; kind: "skip", "masked" or "full"
    for this tile (blocks outside its own ranges are skipped: waited for and released)."""

    def run(start, stop, kind, first, offset, carry):
        def one(blk, c):
            return body(blk - first + offset, blk, c, kind)

        return lax.fori_loop(start, stop, one, carry)

    def run_main(runs, carry):
        """The main range's runs in order, or (`span.reverse`) the runs last first, each block last first."""
        last = span.lo + span.n - 1
        for start, stop, kind in reversed(runs) if span.reverse else runs:
            if not span.reverse:
                carry = run(start, stop, kind, span.lo, span.pn, carry)
                continue

            def one(k, c, stop=stop, kind=kind):
                blk = stop - 1 - k
                return body(last - blk + span.pn, blk, c, kind)

            carry = lax.fori_loop(jnp.int32(0), jnp.maximum(stop - start, 0), one, carry)
        return carry

    if not walk.ranged:  # the mask hides nothing: one loop, no masked or skipped bodies in the code
        return run_main([(span.lo, span.lo + span.n, "full")], carry)
    plo, phi, lo, flo, fhi, hi, lo_half, hi_half, prefix_half = bounds
    if walk.prefix:
        end = span.plo + span.pn
        a, z = (jnp.clip(x, span.plo, end) for x in (plo, phi))
        z = jnp.maximum(z, a)
        runs = [(span.plo, a, "skip"), (a, z, "masked"), (z, end, "skip")]
        if walk.halves:  # the sink tokens' last block scored on its first half
            y = z - jnp.where(z > a, prefix_half, 0)
            runs[1:2] = [(a, y, "masked"), (y, z, "half0")]
        for start, stop, kind in runs:
            carry = run(start, stop, kind, span.plo, 0, carry)
    end = span.lo + span.n
    tlo, flo, fhi, thi = (jnp.clip(x, span.lo, end) for x in (lo, flo, fhi, hi))
    thi = jnp.maximum(thi, tlo)
    if not walk.halves:
        return run_main([(span.lo, tlo, "skip"), (tlo, flo, "masked"), (flo, fhi, "full"), (fhi, thi, "masked"),
                         (thi, end, "skip")], carry)
    # block lo scored on its second half ("half1"), block hi - 1 on its first ("half0"), each as a run of its
    # own; the masked runs give them up (never a fully visible block: a half of it is hidden)
    a, z = tlo + lo_half, thi - hi_half
    assert not span.reverse, "half blocks: the forward's walk, in order"
    return run_main([(span.lo, tlo, "skip"), (tlo, a, "half1"), (a, jnp.minimum(flo, z), "masked"),
                     (flo, fhi, "full"), (jnp.maximum(fhi, a), z, "masked"), (z, thi, "half0"), (thi, end, "skip")],
                    carry)


def _write_rows(acc, smem, wg, dst, first: int = 0, add: bool = False) -> int:
    """Store a float32 [64, D] register tile to GMEM `dst` (in the dtype of `smem`) in chunks of the slot's
    columns via the SMEM slots of `_epilogue_smem`; returns the chunk count to pass as `first` to the next
    call, so slots keep alternating (a copy still reading a slot is never overwritten, whatever D). A `dst`
    of fewer rows (a multiple of 8) takes the tile's first rows. `add`: TMA reduce-add into `dst` instead of
    overwriting it. Where the slots hold every chunk, all are stored before one commit: each commit is a
    fence and warpgroup barriers, which the fused backward's per-visit dQ paid twice (docs/performance.md)."""
    (rows, _), (d, slots, cols) = dst.shape, (acc.shape[1], smem.shape[1], smem.shape[-1])
    n = d // cols
    group = n if n <= slots else 1
    for c0 in range(0, n, group):
        chunks = [(c, (first + c) % slots) for c in range(c0, c0 + group)]
        # the previous copies out of these slots have read them: copies are numbered across calls by `first`,
        # so the last use of a slot was `slots` copies before this one
        plgpu.wait_smem_to_gmem(slots - group, wait_read_only=True)
        for c, slot in chunks:
            smem[wg, slot] = acc[:, c * cols:(c + 1) * cols].astype(smem.dtype)
        plgpu.commit_smem()
        for c, slot in chunks:
            src = smem.at[wg, slot] if rows == acc.shape[0] else smem.at[wg, slot, pl.ds(0, rows)]
            plgpu.copy_smem_to_gmem(src, dst.at[:, pl.ds(c * cols, cols)], reduction_op="add" if add else None)
    return first + n


def _write_vector(x, smem, dst):
    """Store a register vector to its shared-memory row `smem` and copy that to GMEM `dst`."""
    smem[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)


def _drain(steps, stages: int, *free):
    """The producer observes the consumers' last releases, so no barrier phase goes unseen."""

    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(i):
        for bar in free:
            plgpu.barrier_wait(bar.at[lax.rem(i, jnp.int32(stages))])


def _stream_smem(stages: int, rows: int, d: int, dtype, split: bool, widest: int = 128):
    """Shared-memory slots of a streamed [rows, d] operand: [stages, rows, d], or [stages, 2, rows, d / 2];
    swizzled by at most `widest` bytes."""
    if split:
        return plgpu.SMEM((stages, 2, rows, d // 2), dtype, transforms=_transforms(d // 2, dtype, widest))
    return plgpu.SMEM((stages, rows, d), dtype, transforms=_transforms(d, dtype, widest))


def _tile_smem(d: int, dtype, split: bool, widest: int = 128):
    """The two consumers' [64, d] row tiles, or (split) the two halves of the tile they share."""
    cols = d // 2 if split else d
    return plgpu.SMEM((2, ROWS, cols), dtype, transforms=_transforms(cols, dtype, widest))


def _half(rows, walk: _Walk, wg, d: int):
    """Index of the part of a d-wide row tile at `rows` that consumer `wg` loads: all of it, or (split) half wg."""
    return (*rows, pl.ds(wg * (d // 2), d // 2)) if walk.split else rows


def _epilogue_smem(head_dim: int, consumers: int = 2, slots: int | None = None, dtype=jnp.float32,
                   width: int | None = None):
    """Per consumer, [64, cols] slots of `dtype` for `_write_rows`: two to overlap the copies, one when the
    head_dim leaves no room (`config.epilogue_slots`) or `slots` says so. cols: one 128-byte swizzled row
    (32 float32 or 64 bf16 columns), narrower where the `width` written (default head_dim) is no multiple
    of it; never more bytes than the float32 slots `config.smem_bytes` counts."""
    slots = epilogue_slots(head_dim) if slots is None else slots
    cols = _epilogue_cols(head_dim if width is None else width, dtype)
    return plgpu.SMEM((consumers, slots, ROWS, cols), dtype, transforms=_transforms(cols, dtype))


def _epilogue_cols(width: int, dtype) -> int:
    item = jnp.dtype(dtype).itemsize
    return next(w // item for w in (128, 64, 32) if width % (w // item) == 0)


def _dot(a, b, transpose_b: bool):
    b = b.T if transpose_b else b
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), preferred_element_type=jnp.float32)


def _operand(x):
    return x[...] if not isinstance(x, jax.Array) and hasattr(x, "at") else x


def _mma_fresh(shape, a, b, *, transpose_b: bool = False, between=None, emulate: bool = False):
    """a @ b (b^T) into a fresh float32 accumulator; `between` runs while the wgmma is in flight.

    `emulate`: jnp.dot instead of wgmma, for jax's GPU interpreter (which runs these kernels'
    TMA copies, barriers, masks and softmax on CPU, but not accumulator scopes or wgmma
    operands in registers).
    """
    if emulate:
        out = _dot(_operand(a), b[...], transpose_b)
        if between is not None:
            between()
        return out

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if transpose_b else b)
        if between is not None:
            between()
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


class _T(NamedTuple):
    """A shared-memory wgmma lhs read transposed: `ref` holds [K, M], the product takes its [M, K]."""

    ref: object


def _mma(accs, terms, emulate: bool = False, between=None):
    """[acc + a @ b (b^T) for each acc and (a, b, transpose_b)], issued together, awaited once; a term may
    be a list of such triples, summed into its accumulator (the halves of a split head_dim); `a` may be
    a `_T` (a transposed shared-memory lhs)."""
    terms = [t if isinstance(t, list) else [t] for t in terms]
    if emulate:
        def lhs(a):
            return a.ref[...].T if isinstance(a, _T) else _operand(a)

        out = [acc + sum(_dot(lhs(a), b[...], tb) for a, b, tb in parts) for acc, parts in zip(accs, terms)]
        if between is not None:
            between()
        return out

    def body(refs):
        for ref, parts in zip(refs, terms):
            for a, b, tb in parts:
                a = a.ref.transpose((1, 0)) if isinstance(a, _T) else a
                plgpu.wgmma(ref, a, b.transpose((1, 0)) if tb else b)
        if between is not None:
            between()

    return list(pl.run_state(body)(tuple(plgpu.ACC.init(acc) for acc in accs)))


def _mma_early(accs, terms, early: int, then, emulate: bool = False, before=None):
    """`_mma` that issues every term, then reads accumulator `early` as soon as its products (and those issued
    before them) are done and runs `then(value)` while the later ones are still in flight: FlashAttention-3's
    overlap of a softmax or a store with the next matmuls. `before[i]()` runs just before term i is issued.
    An acc is an array to add to, or a shape for a fresh zero one. Returns `then`'s result and every
    accumulator's final value; with any acc an array `then` may only act, and returns None (a value cannot
    leave `pl.run_state`)."""
    terms = [t if isinstance(t, list) else [t] for t in terms]
    before = before or {}
    fresh = all(isinstance(a, tuple) for a in accs)
    if emulate:
        out = []
        for i, (acc, parts) in enumerate(zip(accs, terms)):
            if i in before:
                before[i]()
            out += _mma([_zeros(acc) if isinstance(acc, tuple) else acc], [parts], emulate)
        return then(out[early]), out
    later = sum(len(parts) for parts in terms[early + 1:])  # wgmma groups still in flight when it is read

    def body(*refs):
        for i, (ref, parts) in enumerate(zip(refs, terms)):
            if i in before:
                before[i]()
            for a, b, tb in parts:
                a = a.ref.transpose((1, 0)) if isinstance(a, _T) else a
                plgpu.wgmma(ref, a, b.transpose((1, 0)) if tb else b)
        got = then(plgpu.wgmma_accumulator_load(refs[early], wait_n=later))
        if fresh:
            return got, [ref[...] for ref in refs]
        assert got is None, "then() of an accumulating _mma_early returns nothing"

    if fresh:
        return pl.run_scoped(body, *(plgpu.ACC(a, jnp.float32) for a in accs))
    out = pl.run_state(lambda refs: body(*refs))(
        tuple(plgpu.ACC.init(_zeros(a) if isinstance(a, tuple) else a) for a in accs))
    return None, list(out)


def _interpret(config: MosaicGpuConfig) -> dict:
    return {"interpret": plgpu.InterpretGPUParams()} if config.interpret else {}


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _row_tile(walk: _Walk, cta, wg):
    """(row tile index, head offset within the CTA's pair) of consumer `wg`."""
    if walk.heaviest_last:
        cta = walk.n_ctas - 1 - cta
    if walk.split:
        return cta, 0
    if walk.pair_heads:
        return cta, wg
    return 2 * cta + wg, 0


def _row_tiles_of_cta(walk: _Walk, rng_ref, has_seg: bool, first_row: int = 0, where=None):
    """This CTA's batch, its consumers' (row tile, head offset) and heads, their visit bounds and the
    span the producer streams. Shared by the forward and dQ kernels, whose CTAs own 64-row query tiles;
    `first_row`: grid rows in front of the first such CTA (the fused ring's copy CTAs); `where`: the
    (batch, head, row) of a persistent CTA's work item (`_Persist.at`), else the CTA's grid position."""
    if where is None:
        where = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
    b, hx, cta = where[0], where[1], where[2] - first_row
    row = b if has_seg else 0  # the visit table has a batch axis only with segments
    tiles = [_row_tile(walk, cta, w) for w in (0, 1)]
    heads = [(2 * hx + off) if walk.pair_heads else hx for _, off in tiles]
    bounds = [_bounds(rng_ref, row, t, walk.n_blocks, walk) for t, _ in tiles]
    return b, tiles, heads, bounds, _Span.union(*bounds)


def _consumer_share(wg, tiles, heads, bounds):
    """Consumer `wg`'s row tile, head and visit bounds, selected without a branch."""
    pick = functools.partial(jnp.where, wg == 0)
    return pick(tiles[0][0], tiles[1][0]), pick(heads[0], heads[1]), [pick(a, c) for a, c in zip(*bounds)]


def _per_consumer(body):
    """body(wg) in each consumer warpgroup, its index a constant there: traced (Mosaic GPU's lowering rejects
    constant indices into a transformed shared-memory ref inside a wgmma) but folded by the compiler, so the
    tiles a consumer indexes by wg sit at constant addresses and their wgmma descriptors are constants. With
    wg unknown, LLVM hoists every descriptor (64 bits per 16-wide step of each tile) out of the loop and ptxas
    spills them, reloading them before each wgmma (1 H200, 2026-12-02, docs/performance.md)."""
    wg = lax.axis_index("wg")
    for w in (0, 1):
        pl.when(wg == w)(lambda w=w: body(wg * 0 + w))


def _parts(wg):
    """Indices 0 and 1 of a split tile's halves, as traced values (Mosaic GPU's lowering rejects constant
    indices into a transformed shared-memory ref inside a wgmma)."""
    zero = wg - wg
    return zero, zero + 1


def _halves(split: bool, d: int):
    """(column index, part) of each stored part of a d-wide tile: the whole, or two halves (`_Walk.split`)."""
    if not split:
        return [((), ())]
    return [((pl.ds(j * (d // 2), d // 2),), (j,)) for j in (0, 1)]


def _load(ref, idx, dst, bar, split: bool):
    """TMA copy of the [rows, d] tile ref[idx] into `dst`, whole or as two halves (one arrival each)."""
    for cols, part in _halves(split, ref.shape[-1]):
        plgpu.copy_gmem_to_smem(ref.at[(*idx, *cols)], dst.at[part], bar)


def _stream_kv(b, kvh, span: _Span, bk: int, stages: int, refs, smem, loaded, free, split: bool = False,
               base=0, drain: bool = True):
    """Producer of the forward and dQ kernels: the K and V blocks of `span`, KV head `kvh`, by TMA.

    Visit i goes to slot (base + i) % stages once both consumers have released that slot's last use
    (`base`: visits streamed before, by earlier calls of a fused ring pass); `refs`, `smem`, `loaded`
    and `free` are (K, V) pairs. `drain`: observe the last releases (the caller does after its last call).
    """

    @pl.loop(0, span.steps)
    def _(i):
        g = base + i
        slot = lax.rem(g, jnp.int32(stages))
        rows = (b, pl.ds(span.block(i) * bk, bk), kvh)
        for ref, buf, bar, released in zip(refs, smem, loaded, free):  # K first: the consumers need it first

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(released.at[slot])

            _load(ref, rows, buf.at[slot], bar.at[slot], split)

    if drain:
        _drain(span.steps, stages, *free)


def _keep_scale(opts) -> float:
    """Kept probabilities are scaled by 1 / (1 - rate) (dropout's expectation)."""
    return 1.0 / (1.0 - opts.dropout_rate)


# --------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static shape of a fused ring pass: the forward kernel visits the K/V of `steps` source shards in
    order, sub-step `local` being this device's own; the others arrive by remote TMA into receive slots
    (sub-step j in slot j, or j - 1 after `local`), sent by the copy CTAs.

    The copy CTAs are the first `copy_rows` rows of head 0, every batch row: the first CTAs CUDA
    dispatches (Pallas hands the grid (heads, rows, batch) to CUDA reversed, batch fastest), so they run
    before attention CTAs, which wait for the other devices' copies, can fill the SMs. The same rows of
    the other heads do nothing. In a persistent pass (`_Persist`, every CTA resident at once) the first
    `copy_ctas` CTAs copy in place of their first work item."""

    axis_name: str
    axis_size: int
    steps: int
    local: int
    copy_rows: int
    copy_ctas: int  # copy_rows times the batch
    signal: bool = True  # False: a broken handshake, for the test that shows one is caught
    row_axis: str = "q"  # the grid axis whose first `copy_rows` rows are the copy CTAs

    def slot(self, j):
        """Receive slot of sub-step j (a traced or a Python int; not the local one)."""
        return j - (j > self.local)

    def source(self, j):
        """Device whose K/V this device visits at sub-step j (the owner of their dK/dV)."""
        n = jnp.int32(self.axis_size)
        return lax.rem(lax.axis_index(self.axis_name) + self.local - j + n, n)

    def sends(self):
        """(sub-step, slot) of each destination: device me - local + j takes this device's K/V at sub-step j."""
        return [(j, self.slot(j)) for j in range(self.steps) if j != self.local]

    def copy_cta(self):
        """Of a CTA of a grid with copy rows: whether it is in a copy row, and its index among the copy CTAs."""
        row = lax.axis_index(self.row_axis)
        return row < self.copy_rows, row * (self.copy_ctas // self.copy_rows) + lax.axis_index("b")


def _send_kv(ring: _Ring, kv_refs, recv_refs, smem, loaded, sem, cid):
    """Copy CTA `cid` of a fused ring pass: this device's K and V, cut into streamed-block chunks spread over
    the copy CTAs, staged through the stage slots (`loaded`: barriers that no stream waits on, so that the
    stream's barriers keep their phases) and stored by TMA into every destination's receive slot; once every
    store has landed, each destination's semaphore of that slot is signalled once. Copy CTA 0 then waits
    until every source's copies into this device have landed."""
    k_ref = kv_refs[0]
    b, s, kvh, _ = k_ref.shape
    stages, bk = smem[0].shape[:2]
    nb = s // bk
    me = lax.axis_index(ring.axis_name)
    n = jnp.int32(ring.axis_size)
    dsts = [(lax.rem(me - ring.local + j + n, n), slot) for j, slot in ring.sends()]
    remotes = [[plgpu.remote_ref(ref, {ring.axis_name: dst}) for ref in recv_refs] for dst, _ in dsts]
    count = lax.div(b * kvh * nb - cid + ring.copy_ctas - 1, jnp.int32(ring.copy_ctas))
    # a slot is reloaded only once the stores of `stages` chunks ago (2 per destination) have read it
    pending = (stages - 1) * 2 * len(dsts)

    @pl.loop(0, count)
    def _(i):
        c = cid + i * ring.copy_ctas
        bi, rest = lax.div(c, jnp.int32(kvh * nb)), lax.rem(c, jnp.int32(kvh * nb))
        kh, blk = lax.div(rest, jnp.int32(nb)), lax.rem(rest, jnp.int32(nb))
        st = lax.rem(i, jnp.int32(stages))
        rows = (bi, pl.ds(blk * bk, bk), kh)
        plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
        for ref, buf, bar in zip(kv_refs, smem, loaded):
            plgpu.copy_gmem_to_smem(ref.at[rows], buf.at[st], bar.at[st])
        for w, (buf, bar) in enumerate(zip(smem, loaded)):
            plgpu.barrier_wait(bar.at[st])
            for remote, (_, slot) in zip(remotes, dsts):
                plgpu.copy_smem_to_gmem(buf.at[st], remote[w].at[(slot, *rows)])

    plgpu.wait_smem_to_gmem(0)  # landed, not only read: the signal tells the destination it may read
    for dst, slot in dsts if ring.signal else ():
        pl.semaphore_signal(sem.at[slot], device_id={ring.axis_name: dst})

    # Every peer sends into every receive slot here, needed or not (a causal contiguous ring's first device
    # visits no later source). The kernel must not end while such stores are in flight: XLA hands the
    # slots' memory to the next op, which they would overwrite (see docs/pallas_mosaic_gpu.md, Copies).
    @pl.when(cid == 0)
    def _():
        for slot in range(ring.steps - 1):
            pl.semaphore_wait(sem.at[slot], ring.copy_ctas, decrement=False)


def _fwd_kernel(*refs, opts, walk: _Walk, groups: int, has_seg: bool, emulate: bool, ring: _Ring | None = None,
                persist: _Persist | None = None):
    r = _Refs(refs)
    q_ref, k_ref, v_ref, rng_ref, qstart_ref, kstart_ref = r.take(6)
    qseg_ref, kseg_ref = r.take(2, has_seg)
    mod_refs = _mod_refs(opts, r)
    order_ref = r.take(1, persist is not None)
    out_ref, lse_ref = r.take(2)
    k_recv, v_recv = r.take(2, ring is not None)
    q_smem, k_smem, v_smem, o_smem, lse_smem = r.take(5)
    qseg_smem, kseg_smem = r.take(2, has_seg)
    q_bar, k_bar, v_bar, k_free, v_free, sched = r.take(6)
    seg_bar = r.take(1, has_seg)
    copy_bars = r.take(2, ring is not None)

    bk, stages = walk.block, walk.stages
    first_row = 0 if ring is None or persist is not None else ring.copy_rows
    wg = lax.axis_index("wg")
    sem = None if ring is None else pl.get_global(plgpu.SemaphoreType.REGULAR((ring.steps - 1,)))
    # without ALiBi the logits' factor (the scale, or the soft cap's) stays out of the max and joins exp2 as one
    # FMA: a multiply per score less, which the soft cap's tanh, on the exp2's unit, makes count
    fold = not opts.has_alibi
    # causal ALiBi as a bias per key column (`_Mods.column_bias`), its per-row part added to the lse at the end
    separable = opts.has_alibi and opts.causal
    scale = logit_factor(opts) if fold else 1.0

    of_step, sub_steps = functools.partial(_of_step, ring), functools.partial(_sub_steps, ring)
    base0 = 0 if persist is None else jnp.int32(0)

    def schedule():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def cta(where, j=0):
        return _row_tiles_of_cta(walk, of_step(rng_ref, j), has_seg, first_row, where)

    def attention():
        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(_REGS["fwd"][0], action="increase")

            def load_q(where):
                b, tiles, heads, bounds, _ = cta(where)
                tile, head, _ = _consumer_share(wg, tiles, heads, bounds)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(tile * ROWS, ROWS), head], q_smem.at[wg], q_bar.at[wg])

            def item(n, where, base):
                b, tiles, heads, bounds, _ = cta(where)
                tile, head, _ = _consumer_share(wg, tiles, heads, bounds)
                mods = _Mods.read(opts, mod_refs, b, head)
                q0 = tile * ROWS
                qpos0 = qstart_ref[tile]
                qseg = _segments(qseg_ref, qseg_smem, seg_bar, b, tile, ROWS, wg, 1)
                plgpu.barrier_wait(q_bar.at[wg])

                def sub_step(j, carry):
                    *state, base = carry
                    _, _, _, j_bounds, span = cta(where, j)
                    my = _consumer_share(wg, tiles, heads, j_bounds)[2]
                    kstart, kseg_j = of_step(kstart_ref, j), of_step(kseg_ref, j)

                    def wait_next_k(i):
                        """Wait for the K of visit i + 1 (consumers wait for each K once, in order)."""

                        @pl.when(i + 1 < span.steps)
                        def _():
                            plgpu.barrier_wait(k_bar.at[lax.rem(base + i + 1, jnp.int32(stages))])

                    def step(i, blk, carry, kind):
                        acc, m, row_sum = carry
                        slot = lax.rem(base + i, jnp.int32(stages))
                        if kind == "skip":
                            schedule()
                            plgpu.barrier_arrive(k_free.at[slot])
                            plgpu.barrier_arrive(sched)
                            plgpu.barrier_wait(v_bar.at[slot])
                            plgpu.barrier_wait(sched)
                            plgpu.barrier_arrive(v_free.at[slot])
                            wait_next_k(i)
                            return carry

                        # a half block ("half0" / "half1", `_walk_tile`): only that half's keys, `width` of them
                        keys = _block_keys(kind, bk)
                        width, masked = keys.width, kind != "full"
                        col0 = kstart[blk] + keys.start * walk.col_stride
                        # the other consumer's softmax runs while this matmul does
                        s = _mma_fresh((ROWS, width), q_smem.at[wg], keys.of(k_smem.at[slot]), transpose_b=True,
                                       between=schedule, emulate=emulate)
                        plgpu.barrier_arrive(k_free.at[slot])
                        pos = None
                        if _needs_positions(opts, kind, alibi_by_column=separable):
                            pos = _tile_positions(s.shape, qpos0, col0, walk)
                        if separable:
                            cols = pos.cols if pos is not None else _tile_columns(width, col0, walk)
                            bias = mods.column_bias(cols, qpos0)
                            s = logits2(s, opts)[0] + lax.broadcast_in_dim(bias, s.shape, [1])
                        elif fold:
                            s = folded_scores(s, opts)
                        else:
                            s, _ = _scores2(s, opts, mods.distance(pos), mods)
                        if masked:
                            kseg = _segments(kseg_j, kseg_smem, seg_bar, b, blk, bk, wg, 0, keys.part)
                            s = jnp.where(_mask(opts, s.shape, pos, True, qseg, kseg), s, -jnp.inf)
                        m_new = jnp.maximum(m, s.max(axis=1) * scale)
                        # rows that have seen no key keep m = -inf; shift them by 0 so exp2 gives exact zeros
                        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                        alpha = jnp.exp2(m - m_use)
                        p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        row_sum = row_sum * alpha + p.sum(axis=1)  # dropout leaves the normaliser whole
                        keep = mods.keep(opts, pos, True) if opts.dropout_rate > 0 else None
                        if keep is not None:
                            p = jnp.where(keep, p, 0.0)  # 1 / (1 - rate) joins the final normalisation
                        p16 = p.astype(q_ref.dtype)
                        acc, row_sum, m_new, p16 = lax.optimization_barrier((acc, row_sum, m_new, p16))
                        plgpu.barrier_arrive(sched)
                        plgpu.barrier_wait(v_bar.at[slot])
                        plgpu.barrier_wait(sched)

                        # the next K's barrier is awaited while this matmul runs
                        (acc,) = _mma([acc], [(p16, keys.of(v_smem.at[slot]), False)], emulate,
                                      between=lambda: wait_next_k(i))
                        plgpu.barrier_arrive(v_free.at[slot])
                        return acc, m_new, row_sum

                    @pl.when(span.steps > 0)
                    def _():
                        plgpu.barrier_wait(k_bar.at[lax.rem(base, jnp.int32(stages))])

                    state = _walk_tile(span, my, step, tuple(state), walk)
                    return (*state, base + span.steps)

                init = (_zeros((ROWS, v_ref.shape[-1])),
                        plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                        _zeros((ROWS,), plgpu.Layout.WGMMA.reduce(1)))
                pl.when(wg == 1)(schedule)
                acc, m, row_sum, base = sub_steps(sub_step, init, base)
                pl.when(wg == 0)(schedule)
                if persist is not None:  # the next item's Q loads during this one's epilogue (its last QK^T is done)
                    pl.when(n + 1 < persist.count())(lambda: load_q(persist.at(n + 1, order_ref)))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's lse store has read its row

                seen = row_sum > 0.0
                l_safe = jnp.where(seen, row_sum, 1.0)
                norm = 1.0 / l_safe if opts.dropout_rate == 0 else _keep_scale(opts) / l_safe
                acc = acc * lax.broadcast_in_dim(norm, acc.shape, [0])
                lse = m * _LN2 + jnp.log(l_safe)
                if separable:
                    lse = lse - mods.row_bias(walk)
                lse_smem.at[wg][...] = jnp.where(seen, lse, -jnp.inf)
                _write_rows(acc, o_smem, wg, out_ref.at[b, pl.ds(q0, ROWS), head])
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, pl.ds(q0, ROWS)])
                return base

            if persist is None:
                load_q(None)
            else:  # a copy CTA of a tiny fused pass may have no item
                pl.when(persist.count() > 0)(lambda: load_q(persist.at(0, order_ref)))
            _items(persist, order_ref, item, base0)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(_REGS["fwd"][1], action="decrease")

            def item(n, where, base):
                b, _, heads, _, _ = cta(where)
                kvh = lax.div(heads[0], jnp.int32(groups))
                stream = functools.partial(_stream_kv, b, kvh, smem=(k_smem, v_smem), loaded=(k_bar, v_bar),
                                           free=(k_free, v_free), drain=False)

                def sub_step(j, carry):
                    (base,) = carry
                    span = cta(where, j)[4]
                    if ring is None:
                        stream(span, bk, stages, (k_ref, v_ref), base=base)
                    else:
                        @pl.when(j == ring.local)
                        def _():
                            stream(span, bk, stages, (k_ref, v_ref), base=base)

                        @pl.when((j != ring.local) & (span.steps > 0))
                        def _():
                            slot = ring.slot(j)
                            # every copy CTA of the source signals once its stores have landed
                            pl.semaphore_wait(sem.at[slot], ring.copy_ctas, decrement=False)
                            stream(span, bk, stages, (k_recv.at[slot], v_recv.at[slot]), base=base)
                    return (base + span.steps,)

                return sub_steps(sub_step, (), base)[0]

            _drain(_items(persist, order_ref, item, base0), stages, k_free, v_free)

    if ring is None:
        attention()
        return
    send = functools.partial(_send_kv, ring, (k_ref, v_ref), (k_recv, v_recv), (k_smem, v_smem), copy_bars, sem)
    if persist is not None:
        # every CTA is resident: a copy CTA's producer sends, then streams; its consumers wait for the stream
        pl.when((lax.axis_index("h") < ring.copy_ctas) & (wg == 2))(lambda: send(lax.axis_index("h")))
        attention()
        return
    copy_row, cid = ring.copy_cta()
    pl.when(jnp.logical_not(copy_row))(attention)
    pl.when(copy_row & (lax.axis_index("h") == 0) & (wg == 2))(lambda: send(cid))


def _keys_natural(opts: AttentionOptions) -> bool:
    """Keys in natural order: the whole gathered sequence, or the sink step's sink tokens."""
    return opts.gather_kv or is_sink_step(opts)


def _walk_for(opts: AttentionOptions, t: int, s: int, block: int, stages: int, groups: int, *, transpose: bool,
              pair_heads: bool = True, prefix: bool = False, split: bool = False, halves: bool = False) -> _Walk:
    """Pairing and strides of one launch: `t // 64` row tiles against `s // block` streamed blocks."""
    q_len, k_len, bq, bk = (s, t, block, ROWS) if transpose else (t, s, ROWS, block)
    strides = (block_stride(opts, q_len, bq), block_stride(opts, k_len, bk, natural=_keys_natural(opts)))
    pair_heads = pair_heads and not transpose and not split and groups % 2 == 0
    n_tiles = t // ROWS
    return _Walk(block=block, n_blocks=s // block, stages=stages, ranged=may_skip(opts), pair_heads=pair_heads,
                 heaviest_last=opts.causal and not transpose, row_stride=strides[transpose],
                 col_stride=strides[not transpose],
                 # two row tiles per CTA; the dK/dV kernel's last CTA may have one (`_dkv_kernel`'s `spare`)
                 n_ctas=n_tiles if pair_heads or split else -(-n_tiles // 2) if transpose else n_tiles // 2,
                 prefix=prefix, split=split, halves=halves and may_skip(opts))


def _unify(args):
    return [_compat.match_vma(x, *args) for x in args]


def _unify_with(args, *outs):
    """Outputs varying over the mesh axes of the inputs (a Mosaic GPU kernel's outputs carry none)."""
    return [_compat.match_vma(x, *args) for x in outs]


def _launch(kernel, args, out_type, scratch, *, grid, rows: str, walk: _Walk, groups: int, has_seg: bool,
            opts: AttentionOptions, config: MosaicGpuConfig, added=None, **static):
    """Run `kernel` on a (heads, `rows` tiles, batch) grid of CTAs of one producer and two consumer
    warpgroups; outputs come back with the inputs' varying axes.

    `added` (a shape/dtype): the kernel also takes a zero-initialised float32 array as its last input ref and
    adds into it in place (TMA reduce-add); it comes back first among the outputs.
    """
    names = ("h", rows, "b")
    if config.bwd_tile_major and kernel is not _fwd_kernel and "ring" not in static:
        # CUDA starts CTAs in the order of the grid's last axis fastest, the first slowest: a row tile's CTA of
        # every head before any head's next tile, instead of every tile of a head before the next head
        grid, names = (grid[1], grid[0], grid[2]), (rows, "h", "b")
    body = functools.partial(kernel, opts=opts, walk=walk, groups=groups, has_seg=has_seg, emulate=config.interpret,
                             **static)
    # what profiles show (as NAME_mosaic_gpu_kernel): ringjax_fwd, _dq, _dkv, _dkv_dq (fused), _ring when fused
    name = "ringjax_" + kernel.__name__.strip("_").removesuffix("_kernel") + ("_dq" if added is not None else "")
    name += "_ring" if "ring" in static else ""
    if added is None:
        outs = plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=names,
                            num_threads=3, thread_name="wg", compiler_params=_compiler_params(), kernel_name=name,
                            **_interpret(config))(*args)
        return _unify_with(args, *outs)
    # a Ref argument is aliased in and out of the kernel; pl.kernel (not plgpu.kernel, whose vmap wrapper
    # rejects Ref arguments in jax 0.10) with the same mesh and scoped scratch as plgpu.kernel builds
    # the Ref is invariant over the mesh axes (pl.kernel rejects varying Refs); its value varies like the args
    acc = jax.new_ref(jnp.zeros(added.shape, added.dtype))
    mesh = plgpu.Mesh(grid=grid, grid_names=names, num_threads=3, thread_name="wg")

    def scoped(*refs):
        pl.run_scoped(functools.partial(body, *refs), *scratch, collective_axes="wg")

    with _compat.unchecked_vma():
        outs = pl.kernel(scoped, out_type=tuple(out_type), mesh=mesh, compiler_params=_compiler_params(), name=name,
                         **_interpret(config))(*args, acc)
    return _unify_with(args, acc[...], *outs)


def _sink_rows(opts: AttentionOptions, transpose: bool) -> bool:
    """Whether the visit table is `visits.sink_range_table`'s: sink tokens outside the sink step, queries as rows."""
    return bool(opts.num_sink_tokens) and not transpose and not is_sink_step(opts)


def _has_prefix(opts: AttentionOptions) -> bool:
    """Whether the forward and dQ visit tables' rows start with a prefix range: sink tokens, and a mask that hides
    something besides (else `sink_range_table` has no table)."""
    return _sink_rows(opts, False) and may_skip(dataclasses.replace(opts, num_sink_tokens=0))


def _visit_table(opts: AttentionOptions, rows: TokenInfo, cols: TokenInfo, row_size: int, col_size: int,
                 transpose: bool = False, halves: bool = False):
    """`visits.range_table`, or with sink tokens (queries as rows) `visits.sink_range_table` whose rows start
    with a prefix range, each row ending with `visits.half_flags` where `halves`; a placeholder the kernel never
    reads when the mask hides nothing."""
    xp = array_module(rows.pos)
    if _sink_rows(opts, transpose):
        rng = sink_range_table(opts, rows, cols, row_size, col_size)
    else:
        rng = range_table(opts, rows, cols, row_size, col_size, transpose=transpose)
    if rng is None:
        return xp.zeros((1, 1, 8), np.int32)
    return xp.concatenate([rng, half_flags(opts, rows, cols, row_size, col_size, rng)], axis=-1) if halves else rng


def _step_tables(opts: AttentionOptions, q_info: TokenInfo, k_infos: list[TokenInfo], q_block: int, k_block: int,
                 fused: bool, transpose: bool = False, order_walk: "_Walk | None" = None, halves: bool = False):
    """A launch's inputs that follow from positions: (visit tables per source, queries as rows or with
    `transpose` keys; query block starts; key block starts per source; a persistent launch's item order for
    `order_walk`, else None). Constants where the positions are static (`visits.on_device`): a 1K causal
    forward launched 8 small XLA kernels for them beside its own (1 H200, jax 0.11.2, 2026-12-04)."""

    def build(q_info, *k_infos):
        if transpose:
            visits = [_visit_table(opts, x, q_info, k_block, q_block, transpose=True) for x in k_infos]
        else:
            visits = [_visit_table(opts, q_info, x, q_block, k_block, halves=halves) for x in k_infos]
        order = None
        if order_walk is not None:
            order = _persistent_order(visits if order_walk.ranged else None, order_walk, array_module(q_info.pos))
        kstarts = _per_source([block_starts(x, k_block) for x in k_infos], fused)
        return _per_source(visits, fused), block_starts(q_info, q_block), kstarts, order

    return on_device(build, opts, q_info, *k_infos)


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, extras: Extras, opts: AttentionOptions,
              config: MosaicGpuConfig, out_dtype=jnp.float32):
    return _forward(q, k, v, q_info, [k_info], extras, opts, config, out_dtype=out_dtype)


# copy CTAs of a fused ring pass: enough to keep NVLink busy, few enough to leave the SMs to attention
_COPY_CTAS = 16


def fused_ring_fwd(q, k, v, q_info: TokenInfo, k_infos: list[TokenInfo], axis_name: str, axis_size: int,
                   local: int, extras: Extras, opts: AttentionOptions, config: MosaicGpuConfig,
                   signal: bool = True, out_dtype=jnp.float32):
    """A whole ring pass in one kernel: q against the K/V of the sources whose `TokenInfo`s are `k_infos`
    (one per sub-step; sub-step `local` is this device's own k, v), the others copied in by remote TMA
    from the device of each. Returns (out, lse) merged over every source. `signal=False` (tests only)
    breaks the handshake: the copies are never announced, so the kernel waits forever."""
    return _forward(q, k, v, q_info, k_infos, extras, opts, config, ring=(axis_name, axis_size, local, signal),
                    out_dtype=out_dtype)


def _forward(q, k, v, q_info: TokenInfo, k_infos: list[TokenInfo], extras: Extras, opts: AttentionOptions,
             config: MosaicGpuConfig, ring=None, out_dtype=jnp.float32):
    """(out, lse float32): out in `out_dtype` (float32 where a merge follows; the inputs' dtype where this
    call's output is final, which spares a float32 store and a cast over it)."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bk = _fit(s, config.block_kv, opts, natural=_keys_natural(opts))
    # half a block is the K of a P V product: at least one 128-byte swizzled row of V (64 bf16 keys); a fused
    # ring pass keeps whole blocks until it has run on GPUs with them (its per-source tables would carry the flags)
    halves = config.half_blocks and bk >= 128 and ring is None
    walk = _walk_for(opts, t, s, bk, config.num_stages, g, transpose=False, pair_heads=config.pair_heads,
                     prefix=_has_prefix(opts), halves=halves)
    has_seg = q_info.seg is not None
    # a fused pass's row tiles visit the blocks of every source; it persists only up to 64 blocks: its copy
    # CTAs start their items late, which cost 2% at 8K tokens per GPU (128 blocks) and gained 3% at 4K
    # (2 H100, 2026-11-27, benchmarks/results/checks/)
    persist = config.persistent and _short_rows(opts, s * len(k_infos), bk, most=128 if ring is None else 64)
    rng, qstarts, kstarts, order = _step_tables(opts, q_info, k_infos, ROWS, bk, ring is not None,
                                                order_walk=walk if persist else None, halves=walk.halves)
    args = _unify([q, k, v, rng, qstarts, kstarts, *_segment_tables(opts, q_info, k_infos, ring is not None),
                   *_mod_args(opts, extras, h)])
    dt, dv = q.dtype, v.shape[3]
    scratch = [
        plgpu.SMEM((2, ROWS, d), dt, transforms=_transforms(d, dt)),
        plgpu.SMEM((walk.stages, bk, d), dt, transforms=_transforms(d, dt)),
        plgpu.SMEM((walk.stages, bk, dv), dt, transforms=_transforms(dv, dt)),
        _epilogue_smem(max(d, dv), dtype=out_dtype, width=dv),
        plgpu.SMEM((2, ROWS), jnp.float32),
    ]
    if has_seg:
        scratch += [plgpu.SMEM((2, ROWS), jnp.int32), plgpu.SMEM((2, bk), jnp.int32)]
    scratch += [
        plgpu.Barrier(num_barriers=2),  # q loaded
        plgpu.Barrier(num_barriers=walk.stages),  # k loaded
        plgpu.Barrier(num_barriers=walk.stages),  # v loaded
        plgpu.Barrier(num_arrivals=2, num_barriers=walk.stages),  # k consumed
        plgpu.Barrier(num_arrivals=2, num_barriers=walk.stages),  # v consumed
        plgpu.Barrier(num_arrivals=2),  # schedule (ping-pong)
    ]
    if has_seg:
        scratch.append(plgpu.Barrier(num_barriers=2))
    if ring is not None:
        scratch += [plgpu.Barrier(num_barriers=walk.stages)] * 2  # the copy's K, V staged
    out_type = [_compat.struct_like((b, t, h, dv), out_dtype, args[0]),
                _compat.struct_like((b, h, t), jnp.float32, args[0])]
    grid = (h // 2 if walk.pair_heads else h, walk.n_ctas, b)
    static = {}
    if ring is not None:
        static["ring"] = _make_ring(ring, len(k_infos), b, "q")
        # the receive slots: one per source but this device's own
        out_type += [_compat.struct_like((len(k_infos) - 1, *x.shape), x.dtype, args[0]) for x in (k, v)]
    if persist:
        skip = 0 if ring is None else static["ring"].copy_ctas
        static["persist"] = _Persist(min(_sm_count(config), math.prod(grid) + skip), grid, skip)
        args.append(_unify_with(args, order)[0])
        grid = (static["persist"].ctas, 1, 1)
    elif ring is not None:
        grid = (grid[0], grid[1] + static["ring"].copy_rows, b)
    outs = _launch(_fwd_kernel, args, out_type, scratch, grid=grid, rows="q", walk=walk, groups=g,
                   has_seg=has_seg, opts=opts, config=config, **static)
    return outs[0], outs[1]


# a persistent forward lost 2% to the grid's launch at 32K causal (256 blocks; 1 H100, 2026-11-26), where the
# grid's heads-last order keeps one KV head's blocks in L2; it gained 1-15% at 2K-16K and on windows
def _short_rows(opts: AttentionOptions, s: int, bk: int, most: int = 128) -> bool:
    """Whether no row tile can visit more than `most` blocks of `bk` keys of `s` (static: the mask's reach)."""
    span = reach(opts)
    keys = s if span is None else min(s, span[0] + span[1] + 1 + ROWS)
    return -(-keys // bk) + bool(opts.num_sink_tokens) <= most


def _sm_count(config: MosaicGpuConfig) -> int:
    """CTAs of a persistent launch: one per SM of the GPU (132 on H100 and H200 SXM), or a few in the
    interpreter, so that CTAs there walk several items, unevenly."""
    if config.interpret:
        return 3
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _make_ring(ring, steps: int, batch: int, row_axis: str) -> _Ring:
    """The `_Ring` of a fused kernel: `ring` is (axis_name, axis_size, local, signal)."""
    axis_name, axis_size, local, signal = ring
    copy_rows = -(-_COPY_CTAS // batch)
    return _Ring(axis_name, axis_size, steps, local, copy_rows, copy_rows * batch, signal, row_axis)


def _of_step(ring: _Ring | None, ref, j):
    """A per-source table (visits, key starts, key segments) of sub-step j: the table itself outside a
    fused ring pass."""
    return ref if ring is None or ref is None else ref.at[j]


def _sub_steps(ring: _Ring | None, body, carry, base=0):
    """carry = body(j, carry) over a kernel's sources; carry ends with the visits streamed before sub-step j
    (from `base`: a persistent CTA's earlier work items). One source starts from a Python 0 (Mosaic GPU
    cannot lower a constant array as a loop index)."""
    if ring is None or ring.steps == 1:
        return body(0, (*carry, base))
    return lax.fori_loop(0, ring.steps, body, (*carry, jnp.asarray(base, jnp.int32)))


@dataclasses.dataclass(frozen=True)
class _Persist:
    """A persistent launch: `ctas` CTAs (grid axis "h") walk the work items of a (heads, rows, batch) grid.

    Items are ordered rows first, the rows by the visits they make, most first (`_persistent_order`, an
    input), and dealt out in rounds that alternate direction (CTA c takes item c of round 0, item
    ctas - 1 - c of round 1, ...), so every CTA gets heavy and light tiles in turn. Each CTA's producer
    streams the next item's blocks while its consumers finish the last, so short items (windows, chunks,
    short sequences) do not each pay a pipeline fill and an epilogue alone.

    `skip`: the first `skip` CTAs have other work first (a fused ring pass's copies), which takes the place
    of their item of round 0, the heaviest."""

    ctas: int
    grid: tuple[int, int, int]
    skip: int = 0

    def _slot(self, r):
        c = lax.axis_index("h")
        return jnp.where(lax.rem(r, jnp.int32(2)) == 0, c, jnp.int32(self.ctas - 1) - c)

    def _skips(self):
        return (lax.axis_index("h") < self.skip).astype(jnp.int32)

    def count(self):
        """Work items of this CTA."""
        full, rest = divmod(self.grid[0] * self.grid[1] * self.grid[2] + self.skip, self.ctas)
        return jnp.int32(full) + (self._slot(jnp.int32(full)) < rest).astype(jnp.int32) - self._skips()

    def at(self, i, order_ref):
        """(batch, head, row) of this CTA's item i; `order_ref` holds the grid rows in visiting order."""
        heads, _, batch = self.grid
        i = i + self._skips()
        w = i * self.ctas + self._slot(i) - self.skip
        row, rest = lax.div(w, jnp.int32(heads * batch)), lax.rem(w, jnp.int32(heads * batch))
        return lax.rem(rest, jnp.int32(batch)), lax.div(rest, jnp.int32(batch)), order_ref[row]


def _items(persist: _Persist | None, order_ref, body, carry):
    """carry = body(i, where, carry) over this CTA's work items (`_Persist`), or once at its grid position."""
    if persist is None:
        return body(0, None, carry)
    return lax.fori_loop(0, persist.count(), lambda i, c: body(i, persist.at(i, order_ref), c), carry)


def _persistent_order(tables, walk: _Walk, xp=jnp):
    """int32 [n_ctas]: the grid rows of a persistent launch, the most visits first (ties in grid order), from
    the visit tables of its sources (None: every row visits every block), each summed over its batch rows;
    `xp` numpy or jax.numpy, as the tables."""
    if tables is None:
        return xp.arange(walk.n_ctas, dtype=np.int32)
    steps = 0
    for rng in tables:
        rng = rng[..., :walk.columns].sum(axis=0)  # [tiles, 4 or 6]
        steps = steps + xp.maximum(rng[:, -1] - rng[:, -4], 0)
        if walk.prefix:
            steps = steps + xp.maximum(rng[:, 1] - rng[:, 0], 0)
    cta = xp.arange(walk.n_ctas)
    tiles = [_row_tile(walk, cta, w)[0] for w in (0, 1)]
    work = xp.maximum(steps[tiles[0]], steps[tiles[1]])
    order = np.argsort(-work, kind="stable") if xp is np else jnp.argsort(-work, stable=True)
    return order.astype(np.int32)


def _per_source(xs, fused: bool):
    """A launch's per-source tables: one source's as it is, a fused ring pass's stacked by sub-step."""
    return array_module(xs[0]).stack(xs) if fused else xs[0]


def _segment_tables(opts: AttentionOptions, q_info: TokenInfo, k_infos: list[TokenInfo], fused: bool):
    """[query segment ids, the sources' key segment ids], or none without segments; with sink tokens flagged
    (`masks.flag_sink_ids`, read back in `_mask`): one vector per block, as without them."""
    if q_info.seg is None:
        return []
    if not opts.num_sink_tokens:
        return [q_info.seg.astype(jnp.int32), _per_source([x.seg.astype(jnp.int32) for x in k_infos], fused)]
    keys = [flag_sink_ids(x.seg, x.segpos, opts.num_sink_tokens, keys=True) for x in k_infos]
    return [flag_sink_ids(q_info.seg, None, opts.num_sink_tokens, keys=False), _per_source(keys, fused)]


def _fit(length: int, want: int, opts: AttentionOptions, natural: bool = False) -> int:
    """Largest block <= want (64, 128 or 256) whose blocks each hold positions base + stride * i."""
    for blk in (256, 128, 64):
        if blk <= want and block_stride(opts, length, blk, natural=natural) is not None:
            return blk
    raise ValueError(f"pallas_mosaic_gpu needs blocks of 64 tokens with evenly spaced positions; {length} tokens "
                     f"of layout {opts.layout!r} (subshards {opts.subshards}) have none")


# --------------------------------------------------------------------------- backward


def _dq_kernel(*refs, opts, walk: _Walk, groups: int, has_seg: bool, emulate: bool, ring: _Ring | None = None):
    r = _Refs(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, rng_ref, qstart_ref, kstart_ref = r.take(9)
    qseg_ref, kseg_ref = r.take(2, has_seg)
    mod_refs = _mod_refs(opts, r)
    # fused ring: the other sources' K/V, received by the dK/dV kernel (sub-step j in slot ring.slot(j))
    k_recv, v_recv = r.take(2, ring is not None)
    dq_ref = r.take()
    dslope_ref = r.take(1, opts.has_alibi)
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, o_smem = r.take(7)
    qseg_smem, kseg_smem = r.take(2, has_seg)
    q_bar, k_bar, v_bar, k_free, v_free = r.take(5)
    seg_bar = r.take(1, has_seg)
    # split: consumer 1's float32 slot for handing its dQ over; barriers: it handed a piece over, consumer 0 took it
    hand_smem, hand = r.take(2, walk.split)

    bk, stages, d = walk.block, walk.stages, q_ref.shape[-1]
    half = bk // 2  # split: the keys of a block whose scores each consumer computes
    of_step, sub_steps = functools.partial(_of_step, ring), functools.partial(_sub_steps, ring)

    b, tiles, heads, bounds, _ = _row_tiles_of_cta(walk, of_step(rng_ref, 0), has_seg)
    wg = lax.axis_index("wg")

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(_REGS["dq"][0], action="increase")
        tile, head, _ = _consumer_share(wg, tiles, heads, bounds)
        mods = _Mods.read(opts, mod_refs, b, head)
        q0 = tile * ROWS
        qpos0 = qstart_ref[tile]
        rows = (b, pl.ds(q0, ROWS), head)
        # split: consumer wg loads half wg of the shared q and dO tiles, and waits for both halves
        mine, mine_do = (_half(rows, walk, wg, width) for width in (d, do_ref.shape[-1]))
        plgpu.copy_gmem_to_smem(q_ref.at[mine], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[mine_do], do_smem.at[wg], q_bar.at[2 + wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, head, pl.ds(q0, ROWS)], lse_smem.at[wg], q_bar.at[4 + wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, head, pl.ds(q0, ROWS)], delta_smem.at[wg], q_bar.at[6 + wg])
        qseg = _segments(qseg_ref, qseg_smem, seg_bar, b, tile, ROWS, wg, 1)
        for i in range(4):
            plgpu.barrier_wait(q_bar.at[2 * i + wg])
        if walk.split:
            plgpu.barrier_wait(q_bar.at[1 - wg])
            plgpu.barrier_wait(q_bar.at[3 - wg])
        lse = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

        def source(j, carry):
            *acc, base = carry
            _, _, _, j_bounds, span = _row_tiles_of_cta(walk, of_step(rng_ref, j), has_seg)
            my = _consumer_share(wg, tiles, heads, j_bounds)[2]
            kstart, kseg_j = of_step(kstart_ref, j), of_step(kseg_ref, j)
            step = functools.partial(visit, base, kstart, kseg_j)
            return (*_walk_tile(span, my, step, tuple(acc), walk), base + span.steps)

        def visit(base, kstart, kseg_j, i, blk, carry, kind):
            dq, dslope = carry
            slot = lax.rem(base + i, jnp.int32(stages))
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            if kind == "skip":
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            # split: both consumers share the row tile; each scores its half of the block's keys over both halves
            # of the head_dim (no score is computed twice) and adds their share of dQ, both head_dim halves;
            # consumer 0 sums the two after the walk
            keys, cols = (pl.ds(pl.multiple_of(wg * half, half), half), half) if walk.split else ((), bk)
            if walk.split:
                terms = [[(q_smem.at[j], k_smem.at[slot].at[j].at[keys], True) for j in _parts(wg)],
                         [(do_smem.at[j], v_smem.at[slot].at[j].at[keys], True) for j in _parts(wg)]]
            else:
                terms = [(q_smem.at[wg], k_smem.at[slot], True), (do_smem.at[wg], v_smem.at[slot], True)]
            s, dp = _mma([_zeros((ROWS, cols)), _zeros((ROWS, cols))], terms, emulate)
            plgpu.barrier_arrive(v_free.at[slot])
            pos = None
            if _needs_positions(opts, kind):
                pos = _tile_positions(s.shape, qpos0, kstart[blk] + (wg * half * walk.col_stride if walk.split else 0),
                                      walk)
            segs = None
            if kind == "masked":
                blk_part, size = (2 * blk + wg, half) if walk.split else (blk, bk)
                segs = qseg, _segments(kseg_j, kseg_smem, seg_bar, b, blk_part, size, wg, 0)
            p, keep, t, dist = _probs(s, opts, mods, pos, lse, True, segs, origin=qpos0)
            if keep is not None:
                dp = jnp.where(keep, dp * _keep_scale(opts), 0.0)
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))  # d loss / d logit
            if dist is not None:
                dslope = dslope + _slope_grad(ds, dist)
            if t is not None:
                ds = ds * cap_slope(t)
            ds16 = ds.astype(q_ref.dtype)

            if walk.split:  # dQ's halves: this consumer's keys' rows of each half of K
                dq = tuple(_mma(list(dq), [(ds16, k_smem.at[slot].at[j].at[keys], False) for j in _parts(wg)], emulate))
            else:
                (dq,) = _mma([dq], [(ds16, k_smem.at[slot], False)], emulate)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq, dslope

        dq0 = _zeros((ROWS, d // 2 if walk.split else d))
        init = ((dq0, dq0) if walk.split else dq0, _zeros((ROWS,), plgpu.Layout.WGMMA.reduce(1)) if opts.has_alibi
                else None)
        dq, dslope, _ = sub_steps(source, init)

        def write_dslope(total, w=wg):  # lse is in registers: its shared-memory row carries the slope's gradient out
            _write_vector(total, lse_smem.at[w], dslope_ref.at[b, head, pl.ds(q0, ROWS)])

        if not walk.split:
            _write_rows(dq * opts.softmax_scale, o_smem, wg, dq_ref.at[rows])
            if opts.has_alibi:
                write_dslope(dslope)
        else:
            # each consumer holds the rows' dQ (and slope gradient) over its half of the keys: consumer 1 hands its
            # own over a piece at a time through shared memory, consumer 0 writes the sums (through its epilogue slot,
            # whose width the pieces share)
            width, half_d = hand_smem.shape[-1], dq[0].shape[1]

            def dq_piece(c):
                x, c0 = dq[c * width // half_d], (c * width) % half_d
                return x[:, c0:c0 + width] * opts.softmax_scale

            def write_piece(c, x):
                _write_rows(x, o_smem, 0, dq_ref.at[(*rows, pl.ds(c * width, width))], first=c)

            pieces = [(lse_smem.at[1], lambda: dslope, plgpu.Layout.WGMMA.reduce(1),
                       functools.partial(write_dslope, w=0))] if opts.has_alibi else []
            pieces += [(hand_smem, functools.partial(dq_piece, c), plgpu.Layout.WGMMA,
                        functools.partial(write_piece, c)) for c in range(2 * half_d // width)]
            for i, (buf, value, layout, write) in enumerate(pieces):

                @pl.when(wg == 1)
                def _():
                    if i:
                        plgpu.barrier_wait(hand.at[1])  # consumer 0 has read the last piece
                    buf[...] = value()
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(hand.at[0])

                @pl.when(wg == 0)
                def _():
                    plgpu.barrier_wait(hand.at[0])
                    other = plgpu.load(buf, layout=layout)
                    plgpu.barrier_arrive(hand.at[1])
                    write(value() + other)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(_REGS["dq"][1], action="decrease")
        stream = functools.partial(_stream_kv, b, lax.div(heads[0], jnp.int32(groups)), smem=(k_smem, v_smem),
                                   loaded=(k_bar, v_bar), free=(k_free, v_free), split=walk.split, drain=False)

        def source(j, carry):
            (base,) = carry
            span = _row_tiles_of_cta(walk, of_step(rng_ref, j), has_seg)[4]
            if ring is None:
                stream(span, bk, stages, (k_ref, v_ref), base=base)
            else:
                pl.when(j == ring.local)(lambda: stream(span, bk, stages, (k_ref, v_ref), base=base))
                slot = ring.slot(j)
                pl.when(j != ring.local)(lambda: stream(span, bk, stages, (k_recv.at[slot], v_recv.at[slot]),
                                                        base=base))
            return (base + span.steps,)

        _drain(sub_steps(source, ())[0], stages, k_free, v_free)


def _dkv_kernel(*refs, opts, walk: _Walk, groups: int, has_seg: bool, emulate: bool, with_dq: bool = False,
                dq_first: bool = False, ring: _Ring | None = None):
    r = _Refs(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, rng_ref, qstart_ref, kstart_ref = r.take(9)
    qseg_ref, kseg_ref = r.take(2, has_seg)
    mod_refs = _mod_refs(opts, r)
    dq_ref = r.take(1, with_dq)  # zeros in; the fused backward adds every (key tile, query block)'s dQ into it
    dk_ref, dv_ref = r.take(2)
    # fused, ALiBi: per (batch row, query head, key) the slope's gradient over this key's queries, times the scale
    slopes = with_dq and opts.has_alibi
    dslope_ref = r.take(1, slopes)
    # fused ring: the K/V received from each other source, and the dK/dV partials of ours other devices computed
    k_recv, v_recv, dk_recv, dv_recv = r.take(4, ring is not None)
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, o_smem = r.take(7)
    kseg_smem, qseg_smem = r.take(2, has_seg)
    # a visit's q and lse landed; its dO and delta (two waits a visit, not four: each barrier waited on costs the
    # consumers a phase word, which ptxas keeps in local memory at this register pressure)
    kv_bar, q_bar, do_bar, free = r.take(4)
    seg_bar = r.take(1, has_seg)
    staged = r.take(2, ring is not None)  # the fused ring's copy CTAs: K and V staged through q and dO's slots
    ds_smem, ds_bar = r.take(2, with_dq)  # [visit % 2, consumer] dS^T tiles (lhs of dQ = dS K); both stored
    # head_dim 64: the K tiles again, 64-byte swizzled, so that a consumer's half of the columns (32, 64 bytes) is
    # whole swizzled rows, as wgmma wants its operands
    kdq_smem = r.take(1, with_dq and dq_k_copy(q_ref.shape[-1], jnp.dtype(q_ref.dtype).itemsize))
    slope_smem = r.take(1, slopes)  # [consumer, 64]: a key tile's slope gradient on its way out
    # split: each consumer's P^T and dS^T over its half of a block's queries, in the epilogue's memory; barriers:
    # both stored them, both have read them
    stored, read = r.take(2, walk.split)
    if walk.split:
        (pt_smem, dst_smem), o_smem = o_smem

    bq, stages, d = walk.block, walk.stages, q_ref.shape[-1]
    half = bq // 2  # split: the queries of a block whose scores each consumer computes
    # fused: the dQ product of a visit sums both consumers' dS^T, each consumer half of its columns, and is issued
    # a visit late (with the next visit's dK), so a consumer waits for the other's dS^T of the visit before its
    # own, and the two may drift a visit apart instead of meeting every visit: 2-7% faster backward at head_dim
    # 128 on 1 H200 (docs/performance.md); at 64 half the reduce-adds of each consumer adding its own keys' share
    dq_cols = d // 2
    kdq = kdq_smem if kdq_smem is not None else k_smem
    b = lax.axis_index("b")
    wg = lax.axis_index("wg")
    kvh, cta = lax.axis_index("h"), lax.axis_index("k")
    if ring is not None:
        # grid axis "h" walks (sub-step in ring order from this device's own, KV head): CUDA dispatches every
        # CTA on local K/V before any that waits for a copy
        kv_heads = k_ref.shape[2]
        j = lax.rem(ring.local + lax.div(kvh, jnp.int32(kv_heads)), jnp.int32(ring.steps))
        kvh, cta = lax.rem(kvh, jnp.int32(kv_heads)), cta - ring.copy_rows
        rng_ref, kstart_ref, kseg_ref = (_of_step(ring, x, j) for x in (rng_ref, kstart_ref, kseg_ref))

    def key_tiles(kv_src, store):
        """Key tiles of CTA `cta`, KV head `kvh`: K/V tiles read from the refs `kv_src()` gives; `store(write)`
        calls `write(dk_ref, dv_ref)` with where each consumer's dK/dV go."""
        row = b if has_seg else 0
        tiles = [_row_tile(walk, cta, w)[0] for w in (0, 1)]  # split: one tile
        # an odd number of key tiles: the last CTA's second consumer has none of its own. It walks the first's
        # tile (reads in range, the same bounds), adds nothing to dQ and stores nothing
        last = k_ref.shape[1] // ROWS - 1
        odd = not walk.split and last % 2 == 0
        if odd:
            spare_cta = tiles[1] > last
            tiles = [jnp.minimum(t, last) for t in tiles]
        bounds = [_bounds(rng_ref, row, t, walk.n_blocks, walk) for t in tiles]
        span = _Span.union(*bounds, reverse=walk.reverse)

        def _consumer(wg):
            plgpu.set_max_registers(_REGS["dkv"][0], action="increase")
            spare = (wg == 1) & spare_cta if odd else None
            tile = jnp.where(wg == 0, tiles[0], tiles[1])
            my = [jnp.where(wg == 0, a, c) for a, c in zip(bounds[0], bounds[1])]
            other = [jnp.where(wg == 0, c, a) for a, c in zip(bounds[0], bounds[1])]
            k0 = tile * ROWS
            kpos0 = kstart_ref[tile]
            rows = (b, pl.ds(k0, ROWS), kvh)
            # split: consumer wg loads half wg of the shared K and V tiles, and waits for both halves
            mine, mine_v = (_half(rows, walk, wg, width) for width in (d, v_ref.shape[-1]))
            k_in, v_in = kv_src()
            plgpu.copy_gmem_to_smem(k_in.at[mine], k_smem.at[wg], kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_in.at[mine_v], v_smem.at[wg], kv_bar.at[2 + wg])
            if kdq_smem is not None:
                plgpu.copy_gmem_to_smem(k_in.at[mine], kdq_smem.at[wg], kv_bar.at[4 + wg])
            kseg = _segments(kseg_ref, kseg_smem, seg_bar, b, tile, ROWS, wg, 1)
            # split: both halves of the shared tiles; fused: both consumers' K tiles (dQ reads them all)
            waits = (wg, 2 + wg) + ((4, 5) if kdq_smem is not None else (1 - wg,) if with_dq else ())
            for i in range(4) if walk.split else waits:
                plgpu.barrier_wait(kv_bar.at[i])

            def head(gi, carry):
                mods = _Mods.read(opts, mod_refs, b, kvh * groups + gi)

                def step(i, blk, carry, kind):
                    dk, dv, lag, slope = carry
                    slot = lax.rem(gi * span.steps + i, jnp.int32(stages))
                    plgpu.barrier_wait(q_bar.at[slot])
                    if with_dq or kind == "skip":  # the fused backward issues dP^T with S^T
                        plgpu.barrier_wait(do_bar.at[slot])
                    if kind == "skip":
                        plgpu.barrier_arrive(free.at[slot])
                        # fused: the other consumer's keys may see the block, and its half of dQ needs this tile's
                        # dS^T, zeros
                        if with_dq:
                            seen = (blk >= other[2]) & (blk < other[5])

                            @pl.when(seen)
                            def _():
                                zeros = jnp.zeros((ROWS, bq), q_ref.dtype)
                                share, terms, write = block_dq_parts(lag, gi, blk, zeros)
                                share()
                                write(_mma([_zeros((bq, dq_cols))], [terms], emulate)[0])

                            return dk, dv, advance(lag, gi, blk, seen), slope
                        return carry

                    # split: both consumers share the key tile; each scores its half of the block's queries over
                    # both halves of the head_dim (no score is computed twice), and adds dK's and dV's columns of
                    # its head_dim half over all the queries, its own P^T and dS^T and the other consumer's, met in
                    # shared memory
                    qs, cols = (pl.ds(pl.multiple_of(wg * half, half), half), half) if walk.split else ((), bq)
                    pos = None
                    if _needs_positions(opts, kind):  # rows: keys
                        qpos0 = qstart_ref[blk] + (wg * half * walk.col_stride if walk.split else 0)
                        pos = _tile_positions((ROWS, cols), kpos0, qpos0, walk)

                    def probs(st):
                        """P^T (dropped out: its float32 and the kept bf16), the dropout mask, the soft cap's t."""
                        lse = plgpu.load(lse_smem.at[slot].at[qs], layout=plgpu.Layout.WGMMA.reduce(0))
                        segs = None
                        if kind == "masked":
                            blk_part, size = (2 * blk + wg, half) if walk.split else (blk, bq)
                            segs = kseg, _segments(qseg_ref, qseg_smem, seg_bar, b, blk_part, size, wg, 0)
                        pt, keep, t, dist = _probs(st, opts, mods, pos, lse, False, segs, origin=kpos0)
                        kept = pt if keep is None else jnp.where(keep, pt * _keep_scale(opts), 0.0)
                        return pt, kept.astype(q_ref.dtype), keep, t, dist

                    if with_dq:
                        # FlashAttention-3's order: dP^T is issued with S^T and computes while P^T does
                        terms = [(k_smem.at[wg], q_smem.at[slot], True), (v_smem.at[wg], do_smem.at[slot], True)]
                        (pt, pt16, keep, t, dist), (_, dpt) = _mma_early([(ROWS, bq)] * 2, terms, 0, probs,
                                                                          emulate)
                    elif walk.split:
                        halves = [(k_smem.at[j], q_smem.at[slot].at[j].at[qs], True) for j in _parts(wg)]
                        (st,) = _mma([_zeros((ROWS, cols))], [halves], emulate)
                        pt, pt16, keep, t, dist = probs(st)
                        plgpu.barrier_wait(do_bar.at[slot])
                        (dpt,) = _mma([_zeros((ROWS, cols))],
                                      [[(v_smem.at[j], do_smem.at[slot].at[j].at[qs], True) for j in _parts(wg)]],
                                      emulate)
                    else:
                        st = _mma_fresh((ROWS, bq), k_smem.at[wg], q_smem.at[slot], transpose_b=True, emulate=emulate)
                        pt, pt16, keep, t, dist = probs(st)
                        plgpu.barrier_wait(do_bar.at[slot])
                        terms = [(pt16, do_smem.at[slot], False), (v_smem.at[wg], do_smem.at[slot], True)]
                        dv, dpt = _mma([dv, _zeros((ROWS, bq))], terms, emulate)
                    if keep is not None:
                        dpt = jnp.where(keep, dpt * _keep_scale(opts), 0.0)
                    # dS^T carries the softmax scale (one multiply-add per score where a subtract was): dK and
                    # the fused backward's per-visit dQ then need no scaling of their own
                    scale = opts.softmax_scale
                    delta = plgpu.load(delta_smem.at[slot].at[qs], layout=plgpu.Layout.WGMMA.reduce(0)) * scale
                    dst = pt * (dpt * scale - lax.broadcast_in_dim(delta, dpt.shape, [1]))
                    if slopes:  # d loss / d logit (times the scale), before the soft cap's factor, as in the dQ kernel
                        slope = slope + _slope_grad(dst, dist, rows_are_queries=False)
                    if t is not None:
                        dst = dst * cap_slope(t)
                    if with_dq and spare is not None:  # the spare consumer's dS^T must add nothing to dQ
                        dst = dst * jnp.where(spare, 0.0, 1.0)
                    dst16 = dst.astype(q_ref.dtype)

                    if walk.split:
                        plgpu.barrier_wait(read.at[0])  # the other consumer has read the last block's tiles
                        pt_smem.at[wg][...] = pt16
                        dst_smem.at[wg][...] = dst16
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(stored.at[0])
                        plgpu.barrier_wait(stored.at[0])

                        def terms(lhs, rhs):  # over both consumers' queries: lhs j times rhs's rows j, columns wg
                            rows = [pl.ds(pl.multiple_of(j * half, half), half) for j in _parts(wg)]
                            return [(lhs.at[j], rhs.at[slot].at[wg].at[r], False) for j, r in zip(_parts(wg), rows)]

                        dv, dk = _mma([dv, dk], [terms(pt_smem, do_smem), terms(dst_smem, q_smem)], emulate)
                        plgpu.barrier_arrive(read.at[0])
                        plgpu.barrier_arrive(free.at[slot])
                        return dk, dv, lag, slope
                    if not with_dq:
                        (dk,) = _mma([dk], [(dst16, q_smem.at[slot].at[wg] if walk.split else q_smem.at[slot], False)],
                                     emulate)
                        plgpu.barrier_arrive(free.at[slot])
                        return dk, dv, lag, slope
                    # fused: dS^T goes to shared memory, where both consumers read it for dQ (at head_dim 128 the
                    # previous visit's). By default dV is issued first, on P^T in registers, and computes while
                    # dS^T is stored; dQ's add into global memory leaves while dK computes (FlashAttention-3's
                    # order). `dq_first`: dS^T is stored first and dQ's product issued before dV's, so its store
                    # and add overlap both dV and dK (config.bwd_dq_first)
                    share, dq_terms, write = block_dq_parts(lag, gi, blk, dst16)
                    order = ("dq", "dv", "dk") if dq_first else ("dv", "dq", "dk")
                    accs = {"dv": dv, "dq": (bq, dq_cols), "dk": dk}
                    terms = {"dv": (pt16, do_smem.at[slot], False), "dq": dq_terms,
                             "dk": (dst16, q_smem.at[slot], False)}
                    at = order.index("dq")
                    _, out = _mma_early([accs[n] for n in order], [terms[n] for n in order], at, write, emulate,
                                        before={at: share})
                    dv, dk = out[order.index("dv")], out[order.index("dk")]
                    plgpu.barrier_arrive(free.at[slot])
                    return dk, dv, advance(lag, gi, blk), slope

                def block_dq_parts(lag: _Lag, gi, blk, dst16):
                    """For dQ over the CTA's 128 keys, added into global memory: `share()` stores this consumer's
                    dS^T of query block `blk`; dQ's wgmma terms; `write(dq)`. Consumer wg takes half wg of the
                    columns over both consumers' dS^T of the previous visit (`lag`)."""
                    buf = lag.visits % 2
                    prev = 1 - buf
                    terms, cols = lagged_products(prev)

                    def share():
                        # both stored dS^T of the previous visit, and the other has read our tile of the one before
                        # it (its dQ), which this store overwrites
                        plgpu.barrier_wait(ds_bar.at[prev])
                        ds_smem.at[buf, wg][...] = dst16
                        plgpu.commit_smem()

                    def write(dq):  # dQ's product has read both tiles of the previous visit
                        plgpu.barrier_arrive(ds_bar.at[buf])

                        @pl.when(lag.visits > 0)
                        def _():
                            write_dq(dq, lag.block, lag.head, cols)

                    return share, terms, write

                dk, dv, lag, slope = _walk_tile(span, my, step, carry, walk)
                if slopes:
                    write_slopes(slope, gi)
                    slope = _zeros((ROWS,), plgpu.Layout.WGMMA.reduce(1))
                return dk, dv, lag, slope

            def advance(lag: _Lag, gi, blk, seen=True) -> _Lag:
                """The fused backward's lag after a visit that stored dS^T (`seen`)."""
                seen = jnp.asarray(seen)
                return _Lag(lag.visits + seen.astype(jnp.int32), jnp.where(seen, blk, lag.block),
                            jnp.where(seen, gi, lag.head))

            def lagged_products(buf):
                """Consumer wg's half of the columns of dQ over both consumers' dS^T in `buf`."""
                cols = pl.ds(pl.multiple_of(wg * dq_cols, dq_cols), dq_cols)
                return [(_T(ds_smem.at[buf, j]), kdq.at[j].at[:, cols], False) for j in _parts(wg)], cols

            def write_slopes(acc, gi):
                """ALiBi: this key tile's slope gradient over query head gi, written once (no other CTA has these
                keys and head); the spare consumer's tile is the first's, and it writes nothing."""

                def write():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last head's row has left the slot
                    _write_vector(acc, slope_smem.at[wg], dslope_ref.at[b, kvh * groups + gi, pl.ds(k0, ROWS)])

                pl.when(jnp.logical_not(spare))(write) if spare is not None else write()

            def write_dq(dq, blk, gi, cols):
                rows = pl.ds(blk * bq, bq)
                h = kvh * groups + gi
                dst_ref = dq_ref.at[cta, wg, b, rows, h] if emulate else dq_ref.at[b, rows, h]
                _write_rows(dq, o_smem, wg, dst_ref.at[:, cols], add=not emulate)

            cols = [width // 2 if walk.split else width for width in (d, v_ref.shape[-1])]
            zero = jnp.int32(0)
            init = (*(_zeros((ROWS, c)) for c in cols), _Lag(zero, zero, zero) if with_dq else None,
                    _zeros((ROWS,), plgpu.Layout.WGMMA.reduce(1)) if slopes else None)
            if walk.split:  # nothing to read yet: the first block may store its tiles
                plgpu.barrier_arrive(read.at[0])
            if with_dq:  # a visit before the first, of zeros: the first visit's product reads it and writes nothing
                ds_smem.at[1, wg][...] = jnp.zeros((ROWS, bq), q_ref.dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_bar.at[1])
            dk, dv, lag, _ = lax.fori_loop(0, groups, head, init)
            if with_dq:  # the last visit's dQ
                prev = lax.rem(lag.visits + 1, jnp.int32(2))
                plgpu.barrier_wait(ds_bar.at[prev])
                terms, last_cols = lagged_products(prev)
                (dq,) = _mma([_zeros((bq, dq_cols))], [terms], emulate)

                @pl.when(lag.visits > 0)
                def _():
                    write_dq(dq, lag.block, lag.head, last_cols)
            if walk.split:  # the other consumer has read the last tiles before the epilogue reuses their memory
                plgpu.barrier_wait(read.at[0])

            def write(dk_out, dv_out):
                def rows():
                    chunks = _write_rows(dk, o_smem, wg, dk_out.at[mine])
                    _write_rows(dv, o_smem, wg, dv_out.at[mine_v], first=chunks)
                    plgpu.wait_smem_to_gmem(0)

                if spare is None:
                    rows()
                else:
                    pl.when(jnp.logical_not(spare))(rows)

            store(write)

        _per_consumer(_consumer)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(_REGS["dkv"][1], action="decrease")

            @pl.loop(0, groups * span.steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                gi, blk = span.visit(i)
                h = kvh * groups + gi
                rows = (b, pl.ds(blk * bq, bq), h)
                cols = (b, h, pl.ds(blk * bq, bq))

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                _load(q_ref, rows, q_smem.at[slot], q_bar.at[slot], walk.split)
                plgpu.copy_gmem_to_smem(lse_ref.at[cols], lse_smem.at[slot], q_bar.at[slot])
                _load(do_ref, rows, do_smem.at[slot], do_bar.at[slot], walk.split)
                plgpu.copy_gmem_to_smem(delta_ref.at[cols], delta_smem.at[slot], do_bar.at[slot])

            _drain(groups * span.steps, stages, free)

    def own(write):
        write(dk_ref, dv_ref)

    if ring is None:
        key_tiles(lambda: (k_ref, v_ref), own)
        return
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR((ring.steps - 1,)))  # a source's K/V landed here
    dsem = pl.get_global(plgpu.SemaphoreType.REGULAR((ring.steps - 1,)))  # partials of our K/V landed here
    copy_row, cid = ring.copy_cta()

    @pl.when(jnp.logical_not(copy_row) & (j == ring.local))
    def _():
        key_tiles(lambda: (k_ref, v_ref), own)

    @pl.when(jnp.logical_not(copy_row) & (j != ring.local))
    def _():
        def kv_src():  # each consumer waits for every copy of the source's K/V before loading its tile
            slot = ring.slot(j)
            pl.semaphore_wait(sem.at[slot], ring.copy_ctas, decrement=False)
            return k_recv.at[slot], v_recv.at[slot]

        def to_owner(write):
            """The partials go to the owner's receive slot of this sub-step by remote TMA, announced once
            landed. A branch per sub-step: Mosaic GPU computes a peer's id on the host, from the device alone."""
            for step, slot in ring.sends():

                @pl.when(j == step)
                def _():
                    owner = {ring.axis_name: ring.source(step)}
                    write(plgpu.remote_ref(dk_recv, owner).at[slot], plgpu.remote_ref(dv_recv, owner).at[slot])
                    if ring.signal:
                        pl.semaphore_signal(dsem.at[slot], device_id=owner)

        key_tiles(kv_src, to_owner)

    @pl.when(copy_row & (lax.axis_index("h") == 0) & (wg == 2))
    def _():
        _send_kv(ring, (k_ref, v_ref), (k_recv, v_recv), (q_smem, do_smem), staged, sem, cid)

        # this device's kernel ends only once every partial of its K/V has landed: XLA sums them next
        @pl.when((lax.axis_index("k") == 0) & (b == 0))
        def _():
            signals = 2 * k_ref.shape[2] * walk.n_ctas * k_ref.shape[0]  # per slot: each consumer of each CTA
            for slot in range(ring.steps - 1):
                pl.semaphore_wait(dsem.at[slot], signals, decrement=False)


def _bwd_stats(lse, delta):
    """Base-2 lse (rows that see no key get 0: every P of theirs is masked to 0 anyway) and float32 delta."""
    return jnp.where(jnp.isfinite(lse), lse * LOG2E, 0.0).astype(jnp.float32), delta.astype(jnp.float32)


def block_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, extras: Extras,
              opts: AttentionOptions, config: MosaicGpuConfig, out_dtype=jnp.float32):
    """(dq, dk, dv, d alibi_slopes or None) of one step: float32, or where they are final `out_dtype` (which
    the split kernels write directly; the fused backward's stay float32: its dQ is summed by reduce-adds, and
    its dK/dV cast after, or summed with `_sink_pair_grads`)."""
    lse2, delta = _bwd_stats(lse, delta)
    mods = _mod_args(opts, extras, q.shape[2])
    if fuses_backward(opts, config, q.shape[3], v.shape[3], q.dtype.itemsize):
        # sink tokens apart here too, their dQ share with them; not with ALiBi, whose slope gradient the kernel sums
        apart = sinks_apart(opts) and not opts.has_alibi
        kv_opts = dataclasses.replace(opts, num_sink_tokens=0) if apart else opts
        # dK/dV stay float32 (cast by XLA after): written in bf16 through a view of the slots dQ's float32 adds
        # use, the kernel ran 1.4% slower on plain 32K and 5.7% on a window, more than the cast it saved
        # (docs/performance.md)
        dq, dk, dv, *dslope = _launch_dkv(q, k, v, dout, lse2, delta, q_info, k_info, mods, kv_opts, config,
                                          with_dq=True)
        if apart:
            dq, dk, dv = _sink_pair_grads(dq, dk, dv, q, k, v, dout, lse, delta, q_info, k_info, extras, opts)
        return dq, dk, dv, (dslope[0] if dslope else None)
    dq, dslope = _launch_dq(q, k, v, dout, lse2, delta, q_info, k_info, mods, opts, config, out_dtype=out_dtype)
    dslope = None if dslope is None else dslope.sum(axis=(0, 2))
    if is_sink_step(opts):  # keys that every query sees: see `_sink_key_grads`
        dk, dv = few_keys_grads(q, k, v, dout, lse, delta, q_info, k_info, extras, opts)
        return dq, dk, dv, dslope
    if config.interpret:  # jax's GPU interpreter keeps one global state: run one kernel at a time
        dq, q = lax.optimization_barrier((dq, q))
    apart = sinks_apart(opts)
    kv_opts = dataclasses.replace(opts, num_sink_tokens=0) if apart else opts
    dk, dv = _launch_dkv(q, k, v, dout, lse2, delta, q_info, k_info, mods, kv_opts, config, out_dtype=out_dtype)
    if apart:
        dk, dv = _sink_key_grads(dk, dv, q, k, v, dout, lse, delta, q_info, k_info, extras, opts)
    return dq, dk, dv, dslope


def _sink_keys(k_info: TokenInfo, opts):
    """Where this step holds the sink tokens (at most num_sink_tokens; none on most ring steps): (index into
    the step's keys [s], present [s], rows [s]: the index, or out of range where absent, for scatters that
    drop it)."""
    s = opts.num_sink_tokens
    hits = k_info.pos[None, :] == jnp.arange(s, dtype=k_info.pos.dtype)[:, None]  # [s, S]
    idx, present = jnp.argmax(hits, axis=1), hits.any(axis=1)
    return idx, present, jnp.where(present, idx, k_info.pos.shape[0])


def _sink_key_grads(dk, dv, q, k, v, dout, lse, delta, q_info, k_info, extras, opts):
    """dK/dV with the sink keys' rows replaced by their whole gradient (every pair the full rule shows),
    computed densely in XLA against every query (`dense.few_keys_grads`), where the dK/dV kernel ran without
    the sink rule.

    The dK/dV kernel walks queries per key tile: the tile holding the sink tokens would walk every query
    tile alone while the others walk their window, and finish last (4 sink tokens beside a window of 1024,
    8K tokens: forward+backward took 1.4x the window's alone, one H100, 2026-11-26). Replacing rows lets the
    kernel write the others in their final dtype: each row is rounded once."""
    idx, _, rows = _sink_keys(k_info, opts)
    dk_s, dv_s = few_keys_grads(q, k[:, idx], v[:, idx], dout, lse, delta, q_info,
                                TokenInfo.first(opts.num_sink_tokens), extras, opts)
    return tuple(x.at[:, rows].set(x_s.astype(x.dtype), mode="drop") for x, x_s in ((dk, dk_s), (dv, dv_s)))


def _sink_pair_grads(dq, dk, dv, q, k, v, dout, lse, delta, q_info, k_info, extras, opts):
    """The fused backward's form of `_sink_key_grads`: its float32 dQ/dK/dV get the pairs only the sink rule
    shows added (the kernel's hold the rest), dQ's share too, so one dense product serves all three."""
    idx, present, rows = _sink_keys(k_info, opts)
    k_s, v_s = (jnp.where(present[None, :, None, None], x[:, idx], 0) for x in (k, v))  # absent: no dQ share
    dq_s, dk_s, dv_s = few_keys_grads(q, k_s, v_s, dout, lse, delta, q_info, TokenInfo.first(opts.num_sink_tokens),
                                      extras, StepOptions.sink_step(opts), with_dq=True)
    dk, dv = (x.at[:, rows].add(x_s, mode="drop") for x, x_s in ((dk, dk_s), (dv, dv_s)))
    return dq + dq_s, dk, dv


def fused_ring_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_infos: list[TokenInfo], axis_name: str,
                   axis_size: int, local: int, extras: Extras, opts: AttentionOptions, config: MosaicGpuConfig,
                   signal: bool = True, out_dtype=jnp.float32):
    """The backward of `fused_ring_fwd`: one dK/dV kernel over every source, which copies this device's K/V to
    the others while it computes on its own, and stores the dK/dV partials of each other source into its
    owner's receive slots (remote TMA, semaphores); then one dQ kernel over every source, on the K/V it received.
    Returns (dq, dk, dv, d alibi_slopes or None): dq in `out_dtype` (final: the dQ kernel sums every source in
    registers), the others float32. Head_dims up to 128 (`supports_fused_bwd`)."""
    lse2, delta = _bwd_stats(lse, delta)
    mods = _mod_args(opts, extras, q.shape[2])
    ring = (axis_name, axis_size, local, signal)
    dk, dv, k_recv, v_recv, dk_in, dv_in = _launch_dkv(q, k, v, dout, lse2, delta, q_info, k_infos, mods, opts,
                                                       config, ring=ring)
    dq, dslope = _launch_dq(q, k, v, dout, lse2, delta, q_info, k_infos, mods, opts, config, ring=ring,
                            recv=(k_recv, v_recv), out_dtype=out_dtype)
    # the owners sum in slot order: the same bits run to run
    dk, dv = dk + dk_in.sum(axis=0), dv + dv_in.sum(axis=0)
    return dq, dk, dv, None if dslope is None else dslope.sum(axis=(0, 2))


def _launch_dq(q, k, v, dout, lse2, delta, q_info, k_info, mods, opts, config, ring=None, recv=(),
               out_dtype=jnp.float32):
    """dQ (and ALiBi's per-row slope gradient): rows are query tiles, K/V blocks stream. `ring` (axis_name,
    axis_size, local, signal) with `k_info` a list of every source's: one launch over all of them, sub-step
    `local` on k, v and the others on `recv` = (K, V) receive slots (`fused_ring_bwd`)."""
    b, t, h, d = q.shape
    s, g, has_seg, dt, dv = k.shape[1], h // k.shape[2], q_info.seg is not None, q.dtype, v.shape[3]
    bk = _fit(s, config.dq_block_kv, opts, natural=_keys_natural(opts))
    k_infos = k_info if ring is not None else [k_info]
    split = split_head_dim(d, dv)
    walk = _walk_for(opts, t, s, bk, config.dq_num_stages, g, transpose=False, pair_heads=config.pair_heads,
                     prefix=_has_prefix(opts), split=split)
    rng, qstarts, kstarts, _ = _step_tables(opts, q_info, k_infos, ROWS, bk, ring is not None)
    args = _unify([q, k, v, dout, lse2, delta, rng, qstarts, kstarts,
                   *_segment_tables(opts, q_info, k_infos, ring is not None), *mods, *recv])
    vec = plgpu.SMEM((2, ROWS), jnp.float32)
    # split: dQ contracts a consumer's dS over its 32 keys, a wgmma K group of 32 bf16: 64-byte swizzles, which
    # wgmma wants of both its operands
    widest = 64 if split else 128
    # split: consumer 0 alone writes dQ out, 32 columns at a time; consumer 1 hands its share over through a float32
    # slot as wide (together no more than the two consumers' float32 slots `config.smem_bytes` counts)
    epilogue = _epilogue_smem(max(d, dv), consumers=1 if split else 2, dtype=out_dtype, width=32 if split else d)
    scratch = [_tile_smem(d, dt, split, widest), _tile_smem(dv, dt, split, widest), vec, vec,  # q, dO, lse, delta
               _stream_smem(walk.stages, bk, d, dt, split, widest),
               _stream_smem(walk.stages, bk, dv, dt, split, widest),  # K, V
               epilogue]
    if has_seg:  # split: each consumer reads its half of a block's key segments
        scratch += [plgpu.SMEM((2, ROWS), jnp.int32), plgpu.SMEM((2, bk // 2 if split else bk), jnp.int32)]
    loaded = plgpu.Barrier(num_arrivals=2 if split else 1, num_barriers=walk.stages)  # one TMA copy per part
    scratch += [plgpu.Barrier(num_barriers=8),  # q, dO, lse, delta: barrier 2 * i + consumer
                loaded, loaded,
                plgpu.Barrier(num_arrivals=2, num_barriers=walk.stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=walk.stages)]
    if has_seg:
        scratch.append(plgpu.Barrier(num_barriers=2))
    if split:  # consumer 1 hands its dQ over through a float32 slot: it handed a piece over, consumer 0 took it
        scratch += [plgpu.SMEM((ROWS, 32), jnp.float32, transforms=_transforms(32, jnp.float32)),
                    plgpu.Barrier(num_barriers=2)]
    out_type = [_compat.struct_like((b, t, h, d), out_dtype, args[0])]
    if opts.has_alibi:
        out_type.append(_compat.struct_like((b, h, t), jnp.float32, args[0]))
    static = {} if ring is None else {"ring": _make_ring(ring, len(k_infos), b, "q")}  # it copies nothing
    outs = _launch(_dq_kernel, args, out_type, scratch, grid=(h // 2 if walk.pair_heads else h, walk.n_ctas, b),
                   rows="q", walk=walk, groups=g, has_seg=has_seg, opts=opts, config=config, **static)
    return outs[0], (outs[1] if opts.has_alibi else None)


def fuses_backward(opts: AttentionOptions, config: MosaicGpuConfig, head_dim: int, v_head_dim: int,
                   itemsize: int = 2) -> bool:
    """Whether `block_bwd` runs the fused kernel (dQ added into global memory from the dK/dV kernel) rather than
    a dQ kernel and a dK/dV kernel: asked for by `config.bwd_fused`, where it can (`split_bwd_reason`)."""
    return config.split_bwd_reason(opts, head_dim, v_head_dim, itemsize) is None


def _launch_dkv(q, k, v, dout, lse2, delta, q_info, k_info, mods, opts, config, with_dq: bool = False,
                ring=None, out_dtype=jnp.float32):
    """dK/dV: rows are key tiles of one KV head; (q, dO, lse, delta) blocks of its query heads stream.
    `with_dq`: also dQ (fused backward), returned first, and with ALiBi the slopes' gradient, last. `ring`
    (axis_name, axis_size, local, signal), with `k_info` a list of every source's (`fused_ring_bwd`): also the
    K/V received and the partials for ours."""
    b, t, h, d = q.shape
    s, kvh, has_seg, dt, dv = k.shape[1], k.shape[2], q_info.seg is not None, q.dtype, v.shape[3]
    g = h // kvh
    split = split_head_dim(d, dv)
    bq = _fit(t, config.dkv_block_q, opts)
    walk = _walk_for(opts, s, t, bq, config.dkv_num_stages, g, transpose=True, split=split)
    walk = dataclasses.replace(walk, reverse=config.bwd_reverse)
    k_infos = k_info if ring is not None else [k_info]
    rng, qstarts, kstarts, _ = _step_tables(opts, q_info, k_infos, bq, ROWS, ring is not None, transpose=True)
    args = _unify([q, k, v, dout, lse2, delta, rng, qstarts, kstarts,
                   *_segment_tables(opts, q_info, k_infos, ring is not None), *mods])
    vec = plgpu.SMEM((walk.stages, bq), jnp.float32)
    # split: dK and dV contract a consumer's P^T and dS^T over its 32 queries, a wgmma K group of 32 bf16: 64-byte
    # swizzles, which wgmma wants of both its operands
    widest = 64 if split else 128
    epilogue = _epilogue_smem(max(d, dv), dtype=out_dtype, width=math.gcd(d, dv) // (2 if split else 1))
    if split:  # the consumers' P^T and dS^T over half a block each, where the epilogue writes later
        part = plgpu.SMEM((2, ROWS, bq // 2), dt, transforms=_transforms(bq // 2, dt, widest))
        epilogue = plgpu.RefUnion((part, part), epilogue)
    scratch = [_tile_smem(d, dt, split, widest), _tile_smem(dv, dt, split, widest),  # K, V
               _stream_smem(walk.stages, bq, d, dt, split, widest),
               _stream_smem(walk.stages, bq, dv, dt, split, widest),  # q, dO
               vec, vec, epilogue]  # lse, delta; dK and dV leave through the epilogue's slots
    if has_seg:  # split: each consumer reads its half of a block's query segments
        scratch += [plgpu.SMEM((2, ROWS), jnp.int32), plgpu.SMEM((2, bq // 2 if split else bq), jnp.int32)]
    # K/V tiles; a visit's q and lse, its dO and delta (a TMA copy per part of q and dO); its slot consumed
    loaded = plgpu.Barrier(num_arrivals=(2 if split else 1) + 1, num_barriers=walk.stages)
    k_copy = with_dq and dq_k_copy(d, jnp.dtype(dt).itemsize)  # and (fused, head_dim 64) K's copy for dQ
    scratch += [plgpu.Barrier(num_barriers=6 if k_copy else 4), loaded, loaded,
                plgpu.Barrier(num_arrivals=2, num_barriers=walk.stages)]
    if has_seg:
        scratch.append(plgpu.Barrier(num_barriers=2))
    if ring is not None:
        scratch += [plgpu.Barrier(num_barriers=walk.stages)] * 2
    if split:  # both consumers stored their P^T and dS^T; both have read them
        scratch += [plgpu.Barrier(num_arrivals=2, num_barriers=1), plgpu.Barrier(num_arrivals=2, num_barriers=1)]
    kv_structs = [_compat.struct_like(x.shape, out_dtype, args[0]) for x in (k, v)]
    if ring is not None:
        ring = _make_ring(ring, len(k_infos), b, "k")
        # receive slots, one per source but this device's own: their K/V, then the partials for ours
        recv = [_compat.struct_like((ring.steps - 1, *x.shape), dtype, args[0])
                for dtype in (k.dtype, jnp.float32) for x in (k, v)]
        return _launch(_dkv_kernel, args, kv_structs + recv, scratch,
                       grid=(kvh * ring.steps, ring.copy_rows + walk.n_ctas, b), rows="k", walk=walk, groups=g,
                       has_seg=has_seg, opts=opts, config=config, ring=ring)
    if not with_dq:
        return _launch(_dkv_kernel, args, kv_structs, scratch, grid=(kvh, walk.n_ctas, b), rows="k",
                       walk=walk, groups=g, has_seg=has_seg, opts=opts, config=config)
    # dS^T [visit % 2, consumer], swizzled as K's copy for dQ where there is one (wgmma wants its operands alike)
    ds_swizzle = 64 if k_copy else 128
    scratch += [plgpu.SMEM((2, 2, ROWS, bq), dt, transforms=_transforms(bq, dt, ds_swizzle)),
                plgpu.Barrier(num_arrivals=2, num_barriers=2)]  # both consumers stored theirs
    if k_copy:
        scratch.append(plgpu.SMEM((2, ROWS, d), dt, transforms=_transforms(d // 2, dt)))
    if opts.has_alibi:  # the slope's gradient per (batch row, query head, key), times the scale
        kv_structs.append(_compat.struct_like((b, h, s), jnp.float32, args[0]))
        scratch.append(plgpu.SMEM((2, ROWS), jnp.float32))
    # jax's GPU interpreter has no TMA reduce-add: there each consumer of each CTA writes its own copy, summed here
    parts = (walk.n_ctas, 2) if config.interpret else ()
    dq, dk, dv, *dslope = _launch(_dkv_kernel, args, kv_structs, scratch, grid=(kvh, walk.n_ctas, b), rows="k",
                                  walk=walk, groups=g, has_seg=has_seg, opts=opts, config=config,
                                  added=jax.ShapeDtypeStruct((*parts, *q.shape), jnp.float32), with_dq=True,
                                  dq_first=config.bwd_dq_first)
    dslope = [x.sum((0, 2)) / opts.softmax_scale for x in dslope]  # per query head, as the dQ kernel's
    return (dq.sum((0, 1)) if parts else dq), dk, dv, *dslope

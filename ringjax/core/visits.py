"""Which blocks of the other operand each row tile visits, decided in XLA before the launch.

Per tile a row of four bounds lo <= flo <= fhi <= hi over the other operand's blocks:
[lo, hi) covers every block the mask may show, [flo, fhi) only blocks it shows whole (no
element mask); the rest of [lo, hi) is masked element-wise and nothing outside is visited.
For position-only masks on any layout both sets are contiguous, so nothing hidden is
visited; with segments a hidden block inside [lo, hi) is visited under the mask.

Where positions follow from the layout alone (no segment ids), `on_device` builds the tables with
numpy while tracing: XLA then gets constants instead of a chain of small kernels before every launch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax.core.masks import (
    BlockRange,
    StepOptions,
    TokenInfo,
    array_module,
    fully_visible,
    is_sink_step,
    may_skip,
    maybe_visible,
)
from ringjax.core.tiles import block_ranges
from ringjax.options import AttentionOptions


def _ranges(info: TokenInfo, size: int, pos_axis: int, row_axis: int) -> BlockRange:
    """`tiles.block_ranges` shaped to broadcast: positions along `pos_axis`, per-row fields along `row_axis`."""
    r = block_ranges(info, size)
    xp = array_module(info.pos)

    def at(x, axis):
        return None if x is None else xp.expand_dims(x, axis)

    return BlockRange(at(r.pos_lo, pos_axis), at(r.pos_hi, pos_axis), at(r.seg_lo, row_axis), at(r.seg_hi, row_axis),
                      at(r.segpos_lo, row_axis))


def block_tables(opts: AttentionOptions, q_info: TokenInfo, k_info: TokenInfo, bq: int, bk: int):
    """bool [Bl, nq, nk] `maybe_visible` and `fully_visible` of every (query block, key block) pair.

    Bl is the batch with segments, else 1.
    """
    qr, kr = _ranges(q_info, bq, 1, 2), _ranges(k_info, bk, 0, 1)  # pos [nq, 1] / [1, nk], seg [B, nq, 1] / [B, 1, nk]
    batch = q_info.seg.shape[0] if q_info.seg is not None else 1
    shape = (batch, qr.pos_lo.shape[0], kr.pos_lo.shape[1])
    xp = array_module(qr.pos_lo)
    return (xp.broadcast_to(maybe_visible(opts, qr, kr), shape),
            xp.broadcast_to(fully_visible(opts, qr, kr), shape))


def range_table(opts: AttentionOptions, rows: TokenInfo, cols: TokenInfo, row_size: int, col_size: int,
                transpose: bool = False):
    """int32 [Bl, n_rows, 4] bounds (lo, flo, fhi, hi) over column blocks, or None if the mask hides nothing.

    `rows`/`cols` are the queries/keys, or with `transpose` the keys/queries (the dK/dV walk);
    Bl is the batch with segments, else 1.
    """
    if not may_skip(opts):
        return None
    q_info, k_info = (cols, rows) if transpose else (rows, cols)
    bq, bk = (col_size, row_size) if transpose else (row_size, col_size)
    maybe, full = block_tables(opts, q_info, k_info, bq, bk)
    if transpose:
        maybe, full = maybe.swapaxes(1, 2), full.swapaxes(1, 2)
    return bounds(maybe, full)


def sink_range_table(opts: AttentionOptions, q_info: TokenInfo, k_info: TokenInfo, bq: int, bk: int):
    """int32 [Bl, n_q, 6] (plo, phi, lo, flo, fhi, hi) over key blocks, or None if the mask hides nothing.

    `range_table` of the mask without sink tokens, plus a prefix [plo, phi) of the key blocks that
    only sink tokens make visible, visited first: a query tile of a sliding window then walks its
    window and the one block holding the sinks, not every block in between. Sinks that fall
    neither before nor inside [lo, hi) widen it instead (still exact: those blocks are masked).
    """
    xp = array_module(q_info.pos)
    if not opts.num_sink_tokens or is_sink_step(opts):
        table = range_table(opts, q_info, k_info, bq, bk)
        return None if table is None else xp.concatenate([table[..., :1], table], axis=-1)
    base = dataclasses.replace(opts, num_sink_tokens=0)
    if not may_skip(base):
        return None  # the base rule shows every key: the sinks add none
    main = bounds(*block_tables(base, q_info, k_info, bq, bk))
    sink_maybe, _ = block_tables(StepOptions.sink_step(opts), q_info, k_info, bq, bk)
    sink = bounds(sink_maybe, xp.zeros_like(sink_maybe))
    slo, shi = sink[..., 0], sink[..., 3]
    lo, flo, fhi, hi = (main[..., i] for i in range(4))
    has = shi > slo
    before = has & (shi <= lo)
    widen = has & ~before & ~((slo >= lo) & (shi <= hi))
    lo, hi = xp.where(widen, xp.minimum(lo, slo), lo), xp.where(widen, xp.maximum(hi, shi), hi)
    plo, phi = xp.where(before, slo, lo), xp.where(before, shi, lo)
    return xp.stack([plo, phi, lo, flo, fhi, hi], axis=-1).astype(np.int32)


def half_flags(opts: AttentionOptions, q_info: TokenInfo, k_info: TokenInfo, bq: int, bk: int, table):
    """int32 [Bl, n_q, 2 or 3] (lo_half, hi_half[, prefix_half]) of a forward visit table (`range_table`'s, or
    `sink_range_table`'s, whose prefix adds the third): 1 where no query of the tile sees a key of the first
    half of block lo (lo_half) or of the second half of block hi - 1 (hi_half, prefix_half: of block phi - 1)
    under the whole mask, so a kernel may score only the other half of that block. A causal diagonal or a
    window's edge leaves a quarter of a 64-row tile's 128-key block visible, and sink tokens a few keys of
    theirs: half of such a block is hidden whole. Never both for one block (it is visited once)."""
    xp = array_module(q_info.pos)
    maybe = block_tables(opts, q_info, k_info, bq, bk // 2)[0]  # [Bl, n_q, 2 n_k]
    lo, hi = table[..., -4], table[..., -1]
    maybe = xp.broadcast_to(maybe, (*lo.shape, maybe.shape[-1]))

    def hidden(half):
        at = xp.clip(half, 0, maybe.shape[-1] - 1)[..., None]
        return ~xp.take_along_axis(maybe, at, axis=-1)[..., 0]

    some = hi > lo
    lo_half = some & hidden(2 * lo)
    flags = [lo_half, some & hidden(2 * hi - 1) & ~(lo_half & (hi - lo == 1))]
    if table.shape[-1] == 6:  # the sink tokens' prefix [plo, phi), before [lo, hi)
        plo, phi = table[..., 0], table[..., 1]
        flags.append((phi > plo) & hidden(2 * phi - 1))
    return xp.stack(flags, axis=-1).astype(np.int32)


def bounds(maybe, full):
    """int32 [..., 4] (lo, flo, fhi, hi) per row of bool [..., m] tables over column blocks.

    [lo, hi) covers every column `maybe` shows; [flo, fhi) only columns `full` shows whole.
    """
    xp = array_module(maybe)
    m = maybe.shape[-1]
    col = xp.arange(m, dtype=np.int32)
    hi = xp.max(xp.where(maybe, col + 1, 0), axis=-1)
    lo = xp.minimum(xp.min(xp.where(maybe, col, m), axis=-1), hi)
    fhi = xp.max(xp.where(full, col + 1, 0), axis=-1)
    flo = xp.min(xp.where(full, col, m), axis=-1)
    # a gap among the fully visible blocks: treat none as fully visible (masking is always exact)
    contiguous = (fhi > flo) & (fhi - flo == full.sum(axis=-1))
    flo, fhi = xp.where(contiguous, flo, lo), xp.where(contiguous, fhi, lo)
    return xp.stack([lo, flo, fhi, hi], axis=-1).astype(np.int32)


def block_starts(info: TokenInfo, size: int):
    """int32 [n]: global position of the first token of each block."""
    return info.pos.reshape(-1, size)[:, 0].astype(np.int32)


# longest operand (tokens) whose tables `on_device` builds in numpy: block tables are quadratic in the length, and
# past this a launch's work dwarfs the few microseconds XLA's table kernels take
STATIC_TOKENS = 32768


def on_device(fn, opts: AttentionOptions, *infos: TokenInfo):
    """`fn(*infos)`, a pytree of integer tables, built with numpy where every info `is_static` (and none is
    longer than `STATIC_TOKENS`).

    A ring's devices hold different positions: the tables of every device are then stacked, and this
    device's row is taken by its axis index (one small gather), unless they are all the same. Otherwise
    `fn` runs on the traced infos.
    """
    if not all(info.is_static and info.pos.shape[0] <= STATIC_TOKENS for info in infos):
        return fn(*infos)
    devices = max(info.static_pos.shape[0] for info in infos)
    per_device = [fn(*(info.on_device(r) for info in infos)) for r in range(devices)]
    leaves = [jax.tree.leaves(tables) for tables in per_device]
    if all(np.array_equal(a, b) for other in leaves[1:] for a, b in zip(leaves[0], other)):
        return per_device[0]
    index = lax.axis_index(opts.axis_name)
    stacked = [jnp.asarray(np.stack(rows))[index] for rows in zip(*leaves)]
    return jax.tree.unflatten(jax.tree.structure(per_device[0]), stacked)

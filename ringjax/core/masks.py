"""What query i may see of key j.

Every backend reads its mask rules from here, so each rule is written once:
`visible` is the exact element-wise rule, `maybe_visible` the conservative test on
ranges that lets a kernel skip whole blocks and the ring skip whole steps.
All positions are global token positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from ringjax.options import AttentionOptions


def array_module(x):
    """numpy for a numpy array (tables built at trace time), else jax.numpy."""
    return np if isinstance(x, (np.ndarray, np.generic)) else jnp


class TokenInfo(NamedTuple):
    """Per-token metadata of a block of queries or keys."""

    pos: jnp.ndarray | np.ndarray  # [T] int32 global positions (numpy: one device's, `on_device`)
    seg: jnp.ndarray | None  # [B, T] int32 segment ids (negative: padding), or None
    segpos: jnp.ndarray | np.ndarray | None = None  # [B, T] int32 offset within its segment (sink tokens, chunks)
    # numpy [N or 1, T]: `pos` on each device of the ring axis (one row: the same on all), where the layout alone
    # decides them; without segment ids, so `segpos` (if any) is `pos` itself. Lets tables be built in numpy.
    static_pos: np.ndarray | None = None

    @classmethod
    def first(cls, n: int) -> TokenInfo:
        """The first n tokens of an unsegmented sequence (the sink tokens' step): a token's offset is its
        position."""
        pos = jnp.arange(n, dtype=jnp.int32)
        return cls(pos, None, pos[None, :], np.arange(n, dtype=np.int32)[None])

    @property
    def is_static(self) -> bool:
        """Whether the positions are known at trace time on every device (`static_pos`) and no ids come with them."""
        return self.static_pos is not None and self.seg is None

    def on_device(self, r: int) -> TokenInfo:
        """The numpy TokenInfo of device r (needs `is_static`)."""
        assert self.static_pos is not None
        pos = self.static_pos[min(r, self.static_pos.shape[0] - 1)]
        return TokenInfo(pos, None, None if self.segpos is None else pos[None, :])


class BlockRange(NamedTuple):
    """Bounds of a block's positions and segment ids: scalars, or arrays over many blocks that
    broadcast against each other (`tiles.block_ranges`); may be traced."""

    pos_lo: jnp.ndarray
    pos_hi: jnp.ndarray
    # None when the call has no segment ids (the rules read them only when opts.has_segments)
    seg_lo: Any
    seg_hi: Any
    segpos_lo: Any = None


class Extras(NamedTuple):
    """Per-call arrays that shape the logits or probabilities."""

    alibi_slopes: jnp.ndarray | None = None  # [H] float32
    dropout_seed: jnp.ndarray | None = None  # [2] uint32
    # [2] int32 (first head, heads in all) when the local heads are a slice of all heads (Ulysses):
    # dropout then draws the mask of the global head index
    head_slice: jnp.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepOptions(AttentionOptions):
    """The options of the ring's extra sink step (never set by users).

    Its keys are the sink tokens, and it counts only those the base rule hides: the other
    steps, run with num_sink_tokens=0, count the keys the base rule shows.
    """

    sinks_only: bool = False

    @classmethod
    def sink_step(cls, opts: AttentionOptions) -> StepOptions:
        return cls(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}, sinks_only=True)


def is_sink_step(opts: AttentionOptions) -> bool:
    """Whether these are the options of the ring's extra sink step (its keys are the sink tokens)."""
    return isinstance(opts, StepOptions) and opts.sinks_only


def _and(*masks):
    """Conjunction of the masks that apply (None: no rule); None if none applies."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def _base(opts: AttentionOptions, qp, kp, qp_left=None, kp_left=None):
    """Causal and window rules on positions, or None if neither applies.

    The right bound (causal: 0, window: right) is tested on the pair (qp, kp), the window's left
    bound on (qp_left, kp_left), by default the same pair; on block ranges each bound gets the
    pair of range ends that decides it.
    """
    if opts.window is not None and qp_left is None:
        # on pairs one unsigned compare: -right <= qp - kp <= left. Positions lie in [0, 2**31) and left, right in
        # [0, 2**30], so the difference never wraps onto the range. Causal windows have right = 0: this is the
        # causal rule too. A kernel's masked block pays one compare and one select per score, not two of each.
        left, right = opts.window
        return (qp + right - kp).astype(np.uint32) <= np.uint32(left + right)
    qp_left, kp_left = (qp, kp) if qp_left is None else (qp_left, kp_left)
    window = None
    if opts.window is not None:
        left, right = opts.window
        window = (kp_left >= qp_left - left) & (kp <= qp + right)
    return _and(kp <= qp if opts.causal else None, window)


def visible(opts: AttentionOptions, q: TokenInfo, k: TokenInfo) -> jnp.ndarray:
    """Exact mask, bool [B or 1, Tq, Tk]."""
    expand = lambda x, axis: None if x is None else jnp.expand_dims(x, axis)  # noqa: E731
    vis = visible_pairs(opts, q.pos[:, None], k.pos[None, :], expand(q.seg, 2), expand(k.seg, 1),
                        expand(q.segpos, 2), expand(k.segpos, 1))
    return vis if vis.ndim == 3 else vis[None]


def visible_pairs(opts: AttentionOptions, q_pos, k_pos, q_seg=None, k_seg=None, q_segpos=None, k_segpos=None):
    """`visible` on operands that already broadcast against each other; bool of their broadcast shape.

    `visible` passes [Tq, 1] / [1, Tk] positions and [B, Tq, 1] / [B, 1, Tk] segment ids
    and offsets; kernels working on 2-D tiles pass columns [bq, 1] and rows [1, bk].
    """
    same = None
    if opts.has_segments:
        # negative ids mark padding: it sees nothing and nothing sees it
        same = (q_seg == k_seg) & (q_seg >= 0)
    chunk = None
    if opts.chunk_size is not None:
        c = opts.chunk_size
        # chunks start at each packed document's first token (global position 0 without segments)
        chunk = q_segpos // c == k_segpos // c if opts.has_segments else q_pos // c == k_pos // c
    # no all-true constant unless nothing applies: kernels on tiles build masks from rules only
    base = _and(_base(opts, q_pos, k_pos), same, chunk)
    if base is None:
        base = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    if not opts.num_sink_tokens:
        return base
    # sink tokens: the first s tokens of the query's own segment, never in its future
    sink = _and(k_segpos < opts.num_sink_tokens, same, k_pos <= q_pos if opts.causal else None)
    if is_sink_step(opts):
        # not `sink & ~base`: Mosaic GPU cannot lower a bool vector's invert (jax 0.11.2: "Register bitwidth
        # in target type must be divisible by 8, got 2")
        return jnp.where(base, False, sink)
    return base | sink


def flag_sink_ids(seg, segpos, num_sink_tokens: int, keys: bool):
    """int32 segment ids as the kernels stream them with sink tokens of packed documents: doubled, a key's low bit
    set where it is one of its document's first `num_sink_tokens` (`tile_ids` reads them back), so one id per
    token carries what the sink rule needs of its offset. Negative ids (padding) stay negative."""
    ids = seg.astype(jnp.int32) * 2
    if keys:
        ids = ids + ((seg >= 0) & (segpos < num_sink_tokens)).astype(jnp.int32)
    return ids


def tile_ids(opts: AttentionOptions, q_pos, k_pos, q_ids, k_ids):
    """(query ids, key ids, query offsets, key offsets) for `visible_pairs` on a kernel's tile, from the ids it
    streams: with sink tokens of packed documents those of `flag_sink_ids`, read back (a key's offset as 0 where it
    is a sink token, else `num_sink_tokens`: the rule reads it only as offset < num_sink_tokens); with sink tokens
    alone a token's offset is its position; without them no offsets."""
    if not opts.num_sink_tokens:
        return q_ids, k_ids, None, None
    if not opts.has_segments:
        return q_ids, k_ids, q_pos, k_pos
    return q_ids >> 1, k_ids >> 1, None, jnp.where((k_ids & 1) == 1, 0, opts.num_sink_tokens)


def maybe_visible(opts: AttentionOptions, q: BlockRange, k: BlockRange) -> jnp.ndarray:
    """False only if no query of block q can see any key of block k (bool scalar)."""
    same = array_module(q.pos_lo).asarray(True)
    if opts.has_segments:
        # disjoint id ranges imply disjoint id sets, whatever the order of ids
        same = (k.seg_lo <= q.seg_hi) & (k.seg_hi >= q.seg_lo) & (q.seg_hi >= 0)
    # some pair passes: the earliest key meets the right bound of the latest query, the latest key the left
    # bound of the earliest
    base = _and(same, _base(opts, q.pos_hi, k.pos_lo, q.pos_lo, k.pos_hi))
    if opts.chunk_size is not None:
        c = opts.chunk_size
        if opts.has_segments:  # chunk ids restart per document: only the distance bound is known
            base = base & (k.pos_hi >= q.pos_lo - (c - 1)) & (k.pos_lo <= q.pos_hi + (c - 1))
        else:
            base = base & (k.pos_lo // c <= q.pos_hi // c) & (k.pos_hi // c >= q.pos_lo // c)
    if not opts.num_sink_tokens:
        return base
    sink = same & (k.segpos_lo < opts.num_sink_tokens)
    if opts.causal:
        sink = sink & (k.pos_lo <= q.pos_hi)
    return sink if is_sink_step(opts) else base | sink


def fully_visible(opts: AttentionOptions, q: BlockRange, k: BlockRange) -> jnp.ndarray:
    """True only if every query of block q sees every key of block k (bool, broadcasts).

    Kernels skip the element-wise mask on such block pairs.
    """
    xp = array_module(q.pos_lo)
    if is_sink_step(opts):
        return xp.asarray(False)  # sinks the base rule hides: never a whole block
    # every pair passes: the latest key meets the right bound of the earliest query, the earliest key the left
    # bound of the latest
    ok = _and(xp.asarray(True), _base(opts, q.pos_lo, k.pos_hi, q.pos_hi, k.pos_lo))
    if opts.chunk_size is not None:
        c = opts.chunk_size
        if opts.has_segments:
            return xp.asarray(False)  # per-document chunks: never claimed whole
        ok = ok & (q.pos_lo // c == q.pos_hi // c) & (k.pos_lo // c == k.pos_hi // c) & (q.pos_lo // c == k.pos_lo // c)
    if opts.has_segments:
        ok = ok & (q.seg_lo == q.seg_hi) & (k.seg_lo == k.seg_hi) & (q.seg_lo == k.seg_lo) & (q.seg_lo >= 0)
    return ok


def may_skip(opts: AttentionOptions) -> bool:
    """Whether any block pair can be empty at all (static)."""
    return (opts.causal or opts.window is not None or opts.has_segments or opts.chunk_size is not None
            or is_sink_step(opts))

"""What query i may see of key j, and the logits it sees them with.

Every backend reads its mask rules from here, so each rule is written once:
`visible` is the exact element-wise rule, `maybe_visible` the conservative test on
ranges that lets a kernel skip whole blocks and the ring skip whole steps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from ringjax.options import AttentionOptions


class TokenInfo(NamedTuple):
    """Per-token metadata of a block of queries or keys."""

    pos: jnp.ndarray  # [T] int32 global positions
    seg: jnp.ndarray | None  # [B, T] int32 segment ids, or None


class BlockRange(NamedTuple):
    """Bounds of a block's positions and segment ids (scalars, may be traced)."""

    pos_lo: jnp.ndarray
    pos_hi: jnp.ndarray
    seg_lo: jnp.ndarray | None
    seg_hi: jnp.ndarray | None


def block_range(info: TokenInfo) -> BlockRange:
    if info.seg is None:
        return BlockRange(info.pos.min(), info.pos.max(), None, None)
    return BlockRange(info.pos.min(), info.pos.max(), info.seg.min(), info.seg.max())


def visible(opts: AttentionOptions, q: TokenInfo, k: TokenInfo) -> jnp.ndarray:
    """Exact mask, bool [B or 1, Tq, Tk]."""
    vis = visible_pairs(
        opts,
        q.pos[:, None],
        k.pos[None, :],
        None if q.seg is None else q.seg[:, :, None],
        None if k.seg is None else k.seg[:, None, :],
    )
    return vis if vis.ndim == 3 else vis[None]


def visible_pairs(opts: AttentionOptions, q_pos, k_pos, q_seg=None, k_seg=None) -> jnp.ndarray:
    """`visible` on operands that already broadcast against each other.

    Kernels working on 2-D tiles pass q_pos, q_seg as columns [Tq, 1] and k_pos,
    k_seg as rows [1, Tk]; the mask has the broadcast shape of the operands.
    """
    rules = []
    if opts.causal:
        rules.append(k_pos <= q_pos)
    if opts.window is not None:
        left, right = opts.window
        rules.append((k_pos >= q_pos - left) & (k_pos <= q_pos + right))
    if opts.has_segments:
        # negative ids mark padding: it sees nothing and nothing sees it
        rules.append((q_seg == k_seg) & (q_seg >= 0))
    if not rules:
        return jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    vis = rules[0]
    for rule in rules[1:]:
        vis = vis & rule
    return vis


def maybe_visible(opts: AttentionOptions, q: BlockRange, k: BlockRange) -> jnp.ndarray:
    """False only if no query of block q can see any key of block k (bool scalar)."""
    ok = jnp.asarray(True)
    if opts.causal:
        ok &= k.pos_lo <= q.pos_hi
    if opts.window is not None:
        left, right = opts.window
        ok &= (k.pos_hi >= q.pos_lo - left) & (k.pos_lo <= q.pos_hi + right)
    if opts.has_segments:
        # disjoint id ranges imply disjoint id sets, whatever the order of ids
        ok &= (k.seg_lo <= q.seg_hi) & (k.seg_hi >= q.seg_lo) & (q.seg_hi >= 0)
    return ok


def may_skip(opts: AttentionOptions) -> bool:
    """Whether any block pair can be empty at all (static)."""
    return opts.causal or opts.window is not None or opts.has_segments


def logits(qk: jnp.ndarray, opts: AttentionOptions) -> jnp.ndarray:
    """Scaled (and soft-capped) logits from raw float32 dot products."""
    s = qk * opts.softmax_scale
    if opts.logits_soft_cap is not None:
        cap = opts.logits_soft_cap
        s = cap * jnp.tanh(s / cap)
    return s


def logits_and_slope(qk: jnp.ndarray, opts: AttentionOptions) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Logits and their derivative with respect to the raw dot product."""
    s = qk * opts.softmax_scale
    if opts.logits_soft_cap is None:
        return s, jnp.asarray(opts.softmax_scale, qk.dtype)
    t = jnp.tanh(s / opts.logits_soft_cap)
    return opts.logits_soft_cap * t, opts.softmax_scale * (1.0 - t * t)

"""Which tokens each device holds, and how shards move between devices: positions by layout, segment
offsets of the whole sequence, ppermute shifts. The ring (`core.ring`) and the invariant ring
(`core.invariant`) both run on these."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax.core.masks import TokenInfo
from ringjax.layouts import local_positions
from ringjax.options import AttentionOptions


def shift(tree, opts: AttentionOptions, d: int):
    """Device r receives the value of device r - d (mod N)."""
    n = opts.axis_size
    d %= n
    if d == 0:
        return tree
    perm = [(i, (i + d) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, opts.axis_name, perm), tree)


def shard_index(opts: AttentionOptions):
    """This device's index on the ring (0 without a ring)."""
    return lax.axis_index(opts.axis_name) if opts.axis_name is not None else jnp.int32(0)


def positions(opts: AttentionOptions, shard, t: int, xp=jnp):
    """Global positions of the t tokens that device `shard` holds."""
    return local_positions(opts.layout, shard, opts.axis_size, t, xp=xp, subshards=opts.subshards)


def shard_info(opts: AttentionOptions, source, t: int, seg=None, segpos=None) -> TokenInfo:
    """TokenInfo of the t tokens of shard `source(r)` on device r; without segment ids their positions on
    every device come along as numpy (`TokenInfo.static_pos`)."""
    static = None
    if seg is None:
        static = np.stack([positions(opts, source(r), t, xp=np) for r in range(opts.axis_size)])
    return TokenInfo(positions(opts, source(shard_index(opts)), t), seg, segpos, static)


def own(shard):
    """The source of a device's own tokens: the shard of its index."""
    return shard


def natural_order(opts: AttentionOptions, t: int) -> np.ndarray | None:
    """Indices that put the devices' tokens, concatenated in device order, in natural order (None: already)."""
    order = np.argsort(np.concatenate([positions(opts, r, t, xp=np) for r in range(opts.axis_size)]))
    return None if np.array_equal(order, np.arange(order.size)) else order


def whole(x, opts: AttentionOptions, order):
    """x [B, t, ...] of every device along the sequence, in natural token order."""
    if opts.axis_size > 1:
        x = lax.all_gather(x, opts.axis_name, axis=1, tiled=True)
    return x if order is None else x[:, order]


def needs_segpos(opts: AttentionOptions) -> bool:
    return bool(opts.num_sink_tokens) or (opts.chunk_size is not None and opts.has_segments)


def segment_offsets(whole_seg):
    """Offset [B, T] of each token within its run of equal segment ids (whole sequence, natural order).

    Sink tokens and per-document chunks need it; a run may begin on another shard, so the
    segment ids of the whole sequence (a few bytes per token) are gathered once.
    """
    idx = jnp.arange(whole_seg.shape[1], dtype=jnp.int32)
    boundary = jnp.concatenate([jnp.ones_like(whole_seg[:, :1], bool), whole_seg[:, 1:] != whole_seg[:, :-1]],
                               axis=1)
    start = lax.cummax(jnp.where(boundary, idx, 0), axis=1)
    return idx - start


def query_info(opts, q, q_seg):
    """The local queries' TokenInfo."""
    t = q.shape[1]
    info = shard_info(opts, own, t, q_seg)
    if not needs_segpos(opts):
        return info
    pos = info.pos
    # without segments the offset is the global position
    segpos = segment_offsets(whole(q_seg, opts, natural_order(opts, t)))[:, pos] if opts.has_segments \
        else pos[None, :]
    return info._replace(segpos=segpos)

"""Dilated attention (LongNet) over the ring, exact, built on `ring_attention`.

Branch (w, r) splits the global sequence into segments of w tokens; head h keeps the
tokens whose position p has p % r == h % r (with w % r == 0 this is the same as the
position inside the segment), and each kept token attends to the kept tokens of its
segment. Branches are merged through their lse, as LongNet weights them by their
softmax denominators.

How it runs: for each branch and each offset o the local tokens with p % r == o are
the strided slice [o::r] of the shard (when the shard, or the zigzag chunk, is a
multiple of r). That compressed sequence keeps the layout, and its positions p // r
are monotone in p, so causal and sliding windows carry over, and segments become
segment ids p // w. One `ring_attention` call per branch covers every offset: the
offsets are stacked along the batch axis when their head counts match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from ringjax import _compat
from ringjax.api import ring_attention
from ringjax.dispatch import calling
from ringjax.dispatch.calling import HEADS, LSE, SEQ, TOKENS
from ringjax.layouts import local_positions
from ringjax.merge import add_sinks, merge_attention_many
from ringjax.options import (
    MAX_STATIC_INT,
    check_inputs,
    chunks_per_shard,
    keywords_of,
    make_options,
    option_inputs,
)


def _int_tuple(value, name: str) -> tuple[int, ...]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    out = []
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be a (sequence of) Python int, got {value!r}")
        if not 1 <= x <= MAX_STATIC_INT:
            raise ValueError(f"{name} must be positive and at most 2**30 (positions are int32), got {value!r}")
        out.append(int(x))
    if not out:
        raise ValueError(f"{name} must not be empty")
    return tuple(out)


def _branches(segment_lengths, dilation_rates) -> tuple[tuple[int, int], ...]:
    ws = _int_tuple(segment_lengths, "segment_lengths")
    rs = _int_tuple(dilation_rates, "dilation_rates")
    if len(ws) != len(rs):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length, got {len(ws)} and {len(rs)}"
        )
    for w, r in zip(ws, rs):
        if w % r:
            raise ValueError(f"each segment length must be a multiple of its dilation rate, got w={w}, r={r}")
    return tuple(zip(ws, rs))


def _check_layout(layout: str, branches, axis_size: int, local_len: int) -> None:
    """Every shard must hold the same strided slice structure for every dilation rate."""
    if axis_size == 1:
        return  # one shard: positions are 0..T-1 whatever the layout
    for _, r in branches:
        if r == 1:
            continue
        if layout == "striped":
            raise ValueError(
                f"dilated_attention with dilation rate {r} > 1 does not support layout 'striped' on a ring "
                "(the dilated sub-sequences are not striped over the same shards); use 'contiguous' or 'zigzag'"
            )
        chunk = local_len // chunks_per_shard(layout)
        if chunk % r:
            what = "half the local sequence (zigzag chunk)" if layout == "zigzag" else "the local sequence length"
            raise ValueError(
                f"dilated_attention needs {what} ({chunk}) to be a multiple of every dilation rate, got rate {r}"
            )


def _kv_heads_for(heads: np.ndarray, group: int) -> np.ndarray:
    """K/V heads to pair with the query heads `heads` so that GQA grouping is kept.

    If the selected query heads fall into whole equal groups per K/V head, each K/V head
    is taken once; otherwise one K/V head per query head (duplicates are exact too).
    """
    kv_of = heads // group
    uniq, counts = np.unique(kv_of, return_counts=True)
    if np.all(counts == counts[0]) and np.array_equal(np.repeat(uniq, counts[0]), kv_of):
        return uniq
    return kv_of


def _compressed_window(window, w: int, r: int, global_len: int, causal: bool):
    """The window on the compressed sequence (positions p // r) of branch (w, r).

    Same-offset tokens are r apart, so |p - j| <= x iff |p//r - j//r| <= x // r. A segment
    of w tokens implies the window (w - 1, w - 1); stating it is exact and lets the ring
    skip the steps (and transfers) that no segment reaches.
    """
    if w < global_len:
        left, right = window if window is not None else (w - 1, w - 1)
        window = (min(left, w - 1), 0 if causal else min(right, w - 1))
    if window is None:
        return None
    return (window[0] // r, window[1] // r)


def _check_ids(segment_ids, branches, global_len: int) -> None:
    """ValueError where concrete ids would overflow int32 once combined with a branch's segment index (an id
    per pair: user id * ceil(seq / w) + segment); traced ids are the caller's to keep below the bound."""
    ids = _compat.host_value(segment_ids)
    if ids is None:
        return
    top = int(np.max(ids, initial=0))
    for w, _ in branches:
        limit = 2**31 // -(-global_len // w)
        if top >= limit:
            raise ValueError(f"segment_ids must stay below {limit} with segment length {w} over {global_len} "
                             f"tokens (they are combined with the segment index in int32), got {top}")


def _dilated_shard(q, k, v, seg, sinks, *, branches, axis_name, axis_size, layout, global_len, ring_kw):
    """Per-device dilated attention: (out [B,T,H,Dv], lse f32 [B,H,T])."""
    b, t, h, _ = q.shape
    group = h // k.shape[2]
    shard = lax.axis_index(axis_name) if axis_name is not None else 0
    pos = local_positions(layout, shard, axis_size, t)
    inner_layout = layout if axis_size > 1 else "contiguous"
    window = ring_kw.pop("window")
    if len(branches) == 1 and branches[0][1] == 1:
        # one undilated branch is plain (segmented) ring attention; sinks go to the ring as usual
        sinks_here, sinks = sinks, None
    else:
        sinks_here = None
    outs, lses = [], []
    for w, r in branches:
        nseg = -(-global_len // w)
        parts = []
        for o in range(min(r, h, t)):
            heads = np.arange(o, h, r)
            kv_heads = _kv_heads_for(heads, group)
            ids = jnp.broadcast_to((pos[o::r] // w)[None], (b, len(range(o, t, r))))
            if seg is not None:
                user = seg[:, o::r].astype(jnp.int32)
                # one id per (user segment, dilated segment); padding stays negative
                ids = jnp.where(user < 0, -1, user * nseg + ids)
            elif nseg == 1:
                ids = None
            parts.append((o, heads, q[:, o::r][:, :, heads], k[:, o::r][:, :, kv_heads],
                          v[:, o::r][:, :, kv_heads], ids))
        kw = dict(ring_kw, axis_name=axis_name, layout=inner_layout, return_lse=True,
                  sliding_window=_compressed_window(window, w, r, global_len, ring_kw["causal"]))
        stackable = len({(p[2].shape, p[3].shape) for p in parts}) == 1
        if stackable:
            cat = [None if parts[0][i] is None else jnp.concatenate([p[i] for p in parts]) for i in (2, 3, 4, 5)]
            out_all, lse_all = ring_attention(cat[0], cat[1], cat[2], segment_ids=cat[3], sinks=sinks_here, **kw)
            results = [(out_all[i * b:(i + 1) * b], lse_all[i * b:(i + 1) * b]) for i in range(len(parts))]
        else:
            results = [ring_attention(p[2], p[3], p[4], segment_ids=p[5], **kw) for p in parts]
        if r == 1 and len(branches) == 1:
            return results[0]  # the single part is the whole answer
        out_b = jnp.zeros((b, t, h, v.shape[3]), jnp.float32)
        lse_b = jnp.full((b, h, t), -jnp.inf, jnp.float32)
        for (o, heads, *_), (out_o, lse_o) in zip(parts, results):
            out_b = out_b.at[:, o::r, heads].set(out_o.astype(jnp.float32))
            lse_b = lse_b.at[:, heads, o::r].set(lse_o)
        outs.append(out_b)
        lses.append(lse_b)
    out, lse = merge_attention_many(outs, lses)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)  # once, after the branches merge
    return out, lse


@keywords_of(ring_attention, omit=("chunk_size", "alibi_slopes", "dropout_rate", "dropout_rng", "num_sink_tokens",
                                     "strategy"))
def dilated_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads v_head_dim"],
    *,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    axis_name: str | None = "sp",  # declared here: one axis, never ring_attention's (head_axis, ring_axis) pair
    **options,
):
    """LongNet dilated attention, exact over the ring; calling modes as `ring_attention`.

    Branch i is (segment length w = segment_lengths[i], dilation r = dilation_rates[i]),
    w in global tokens and a multiple of r. In branch i query p of head h sees key j iff
    p // w == j // w and p % r == j % r == h % r (plus causal, window, segment_ids);
    tokens with p % r != h % r get nothing from that branch. The branches merge through
    their lse (a pair seen by two branches counts twice, as in LongNet), `sinks` join
    the merged denominator once. One branch (w >= seq, r = 1) is exactly `ring_attention`.

    On a ring, every shard (zigzag: half shard) length must be a multiple of every r > 1,
    and layout "striped" needs all r = 1. Inside shard_map, h is the local head index.
    With `segment_ids`, ids must stay below 2**31 / ceil(seq / w) for every w.
    Returns out [batch, seq, heads, v_head_dim] in q's dtype (v may have a head_dim of its own, as
    for `ring_attention`) and, with `return_lse`, lse [batch, heads, seq] float32.

    The other keywords are those of `ring_attention` (`ringjax.options.KEYWORDS`, same defaults); the ones
    not listed here (chunk_size, alibi_slopes, dropout, num_sink_tokens, strategy) raise a TypeError.
    """
    branches = _branches(segment_lengths, dilation_rates)
    call = calling.resolve(axis_name, options["mesh"])
    layout, segment_ids, sinks, return_lse = (options[n] for n in ("layout", "segment_ids", "sinks", "return_lse"))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_inputs(q, k, v, segment_ids, sinks, axis_size=call.axis_size, layout=layout, local=not call.is_global)
    opts = make_options(q, axis_name=axis_name, axis_size=call.axis_size, **option_inputs(options))
    if opts.invariant and (len(branches) > 1 or (sinks is not None and branches[0][1] > 1)):
        # the merge's backward sums over the head_dim in XLA, in an order that follows the shard's length
        raise ValueError("dilated_attention with deterministic='invariant' takes one branch, and sinks only with "
                         f"dilation rate 1: merging branches is not invariant to the ring size; got {branches}")
    seq = q.shape[1]
    local_len = seq // call.axis_size if call.is_global else seq
    _check_layout(layout, branches, call.axis_size, local_len)
    _check_ids(segment_ids, branches, local_len * call.axis_size)
    ring_kw = dict(causal=options["causal"], window=opts.window, softmax_scale=opts.softmax_scale,
                   logits_soft_cap=opts.logits_soft_cap, implementation=options["implementation"],
                   config=options["config"], autotune=options["autotune"], deterministic=opts.deterministic)
    per_device_kw = dict(branches=branches, axis_name=axis_name, axis_size=call.axis_size, layout=layout,
                         global_len=local_len * call.axis_size)

    def per_device(q, k, v, seg, sinks):
        if sinks is not None and axis_name is not None:
            sinks = _compat.to_varying(sinks, axis_name)  # one sinks gradient per device, summed
        out, lse = _dilated_shard(q, k, v, seg, sinks, ring_kw=dict(ring_kw), **per_device_kw)
        return out.astype(q.dtype), lse

    rates = math.lcm(*(r for _, r in branches))
    heads, kv_heads = q.shape[2], k.shape[2]
    # head offsets h % r stay those of the global head index only if local head counts are multiples of r
    call = calling.with_spare_axes(
        call, q, batch=q.shape[0], kv_heads=kv_heads,
        keep_heads_if=lambda ways: heads % ways == 0 and (heads // ways) % rates == 0
        and (heads // ways) % (kv_heads // ways) == 0,
    )
    out, lse = calling.run(call, per_device, (q, k, v, segment_ids, sinks), (TOKENS, TOKENS, TOKENS, SEQ, HEADS),
                           (TOKENS, LSE))
    return (out, lse) if return_lse else out

"""The ppermute ring: K/V travel, queries stay, partial results merge by lse.

This file is the per-device op and its K/V schedules: the ring, or (`opts.gather_kv`)
K/V gathered once over the axis and dK/dV reduce-scattered back. What happens inside
one step (local queries against one block of keys) is a `BlockKernel` supplied by a backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax import _compat
from ringjax.core import invariant
from ringjax.core.masks import Extras, StepOptions, TokenInfo, maybe_visible
from ringjax.core.schedule import ring_plan, steps_may_be_empty
from ringjax.core.shards import (
    natural_order,
    needs_segpos,
    positions,
    query_info,
    segment_offsets,
    shard_index,
    shard_info,
    shift,
    whole,
)
from ringjax.core.tiles import shard_range
from ringjax.merge import add_sinks, merge_attention, sink_probability
from ringjax.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """One ring step: all local queries against one shard of keys.

    fwd(q, k, v, q_info, k_info, extras, opts, config) -> (out f32 [B,T,H,Dv], lse f32 [B,H,T]),
      Dv v's head_dim (which may differ from q's and k's)
    bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts, config)
      -> (dq, dk, dv, d alibi_slopes or None), float32,
      where lse is the final (whole-ring) lse and delta = rowsum(dout * out) - dlse.
    Both must give exact zeros (and lse -inf) for rows that see no key.
    `skips_empty_steps`: the kernel itself does no work on a step the mask empties,
    so the ring runs it unconditionally instead of under `lax.cond` (on GPUs a
    conditional reads its predicate on the host, stalling the stream every step).
    `ring_fwd`, `ring_bwd`: optional replacements of the whole forward / backward ring
    (e.g. one fused kernel that moves K/V itself):
      ring_fwd(q, k, v, q_seg, kv_seg, extras, opts, config) -> (out f32, lse), before sinks;
      ring_bwd(q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config)
        -> (dq, dk, dv, d alibi_slopes or None), float32.
    `rows_independent(opts, config)`: each query's output, lse and dQ, and each key's dK/dV, are the same bits
    whatever other rows share the call (no reduction across rows, blocks sized by the other operand's length alone), so
    `deterministic="invariant"` may take all of a device's granules against one granule per call
    (`core.invariant`) instead of one call per granule pair.
    `final_dtype`: fwd, ring_fwd, bwd and ring_bwd also take `out_dtype=`; where no merge follows a call
    (forward: one step, the all-gather's one call, ring_fwd, and no learnable sinks to rescale it; backward:
    one step, ring_bwd) the ring asks for the inputs' dtype, which spares the float32 stores and the casts
    after them. A kernel may still return float32 (the ring casts).
    """

    name: str
    fwd: Callable[..., Any]
    bwd: Callable[..., Any]
    skips_empty_steps: bool = False
    ring_fwd: Callable[..., Any] | None = None
    ring_bwd: Callable[..., Any] | None = None
    final_dtype: bool = False
    rows_independent: Callable[[Any, Any], bool] = lambda opts, config: False

    @classmethod
    def without_extras(cls, name: str, block_fwd: Callable[..., Any], block_bwd: Callable[..., Any], **kw):
        """A kernel from steps that take no `extras` (their backend refuses ALiBi and dropout):
        block_fwd(q, k, v, q_info, k_info, opts, config), block_bwd(..., opts, config) -> (dq, dk, dv)."""

        def fwd(q, k, v, q_info, k_info, extras, opts, config):
            return block_fwd(q, k, v, q_info, k_info, opts, config)

        def bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts, config):
            return (*block_bwd(q, k, v, dout, lse, delta, q_info, k_info, opts, config), None)

        return cls(name, fwd, bwd, **kw)


def _run_step(opts, kernel, q_info, k_info, compute, empty):
    """Run `compute` unless the mask hides every key of this step from every query."""
    if kernel.skips_empty_steps or not steps_may_be_empty(opts):
        return compute()
    pred = maybe_visible(opts, shard_range(q_info), shard_range(k_info))
    return lax.cond(pred, compute, empty)


def _source_at(plan, step: int, opts: AttentionOptions):
    """The shard whose K/V device r holds at `step`, as a function of r."""
    return functools.partial(plan.source, step=step, axis_size=opts.axis_size)


def _scatter_home(x, opts: AttentionOptions, order):
    """Transpose of `whole`: every device's contributions summed, each device keeping its own tokens."""
    if order is not None:
        x = x[:, np.argsort(order)]
    return lax.psum_scatter(x, opts.axis_name, scatter_dimension=1, tiled=True) if opts.axis_size > 1 else x


def _gather_kv(opts, k, v, kv_seg):
    """K, V and their TokenInfo for the whole sequence in natural order (monotone positions keep block
    skipping tight), and the order that `_scatter_home` undoes."""
    order = natural_order(opts, k.shape[1])
    k_all, v_all = whole(k, opts, order), whole(v, opts, order)
    seg = None if kv_seg is None else whole(kv_seg, opts, order)
    pos = jnp.arange(k_all.shape[1], dtype=jnp.int32)
    segpos = None
    if needs_segpos(opts):
        segpos = pos[None, :] if seg is None else segment_offsets(seg)
    static = None if seg is not None else np.arange(k_all.shape[1], dtype=np.int32)[None]
    return k_all, v_all, TokenInfo(pos, seg, segpos, static), order


def _dtype_kw(out_dtype):
    """Keyword arguments asking a kernel for its final results in `out_dtype` (None: float32, unasked)."""
    return {} if out_dtype is None else {"out_dtype": out_dtype}


def _gather_forward(opts, kernel, config, q, k, v, q_seg, kv_seg, extras, out_dtype=None):
    """The all-gather schedule: one kernel call of the local queries against every key."""
    q_info = query_info(opts, q, q_seg)
    k_all, v_all, k_info, _ = _gather_kv(opts, k, v, kv_seg)
    return kernel.fwd(q, k_all, v_all, q_info, k_info, extras, opts, config, **_dtype_kw(out_dtype))


def _gather_backward(kernel, q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config):
    # K/V are gathered again rather than kept from the forward: residuals stay O(local sequence)
    q_info = query_info(opts, q, q_seg)
    k_all, v_all, k_info, order = _gather_kv(opts, k, v, kv_seg)
    dq, dk, dv, dslopes = kernel.bwd(q, k_all, v_all, dout, lse, delta, q_info, k_info, extras, opts, config)
    return dq, _scatter_home(dk, opts, order), _scatter_home(dv, opts, order), dslopes


def _without_sinks(opts, plan):
    """Options of the regular steps: a shortened ring leaves the sink tokens to a step of their own."""
    return dataclasses.replace(opts, num_sink_tokens=0) if plan.sink_step else opts


# the sink step takes the first tokens up to a multiple of this, of which the sink rule shows only the
# first s (offsets < s): kernels with 64-token blocks can take them
_SINK_BLOCK = 64


def _sink_slots(opts) -> int:
    return -(-opts.num_sink_tokens // _SINK_BLOCK) * _SINK_BLOCK


def _sink_onehot(pos, s, dtype):
    return (pos[None, :] == jnp.arange(s, dtype=pos.dtype)[:, None]).astype(dtype)  # [s, L]


def _sink_kv(x, pos, opts):
    """K or V of the first `_sink_slots` global tokens, on every device (only without segments)."""
    s = _sink_slots(opts)
    # HIGHEST: a one-hot product must copy values exactly (no TF32 rounding on GPUs)
    part = jnp.einsum("sl,blhd->bshd", _sink_onehot(pos, s, x.dtype), x, preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST)
    return lax.psum(part, opts.axis_name).astype(x.dtype)


def _sink_info(opts):
    return TokenInfo.first(_sink_slots(opts))


def ring_sources(opts: AttentionOptions, q, q_seg, kv_seg):
    """What a kernel that moves K/V itself needs of the ring: (step options, the local queries' TokenInfo, the
    TokenInfo of the keys of each step's source shard in ring order, the step whose keys are this device's own).

    Segment ids and offsets of the sources are gathered once (a few bytes per token); the sink step of a
    shortened ring is not included (`RingPlan.sink_step`).
    """
    t = q.shape[1]
    shard = shard_index(opts)
    plan = ring_plan(opts, t)
    q_info = query_info(opts, q, q_seg)

    def gathered(x):
        return None if x is None else lax.all_gather(x, opts.axis_name)

    segs, segpos = gathered(kv_seg), gathered(q_info.segpos)
    infos = []
    for step in range(plan.num_steps):
        src = plan.source(shard, step, opts.axis_size)
        infos.append(shard_info(opts, _source_at(plan, step, opts), t, None if segs is None else segs[src],
                                 None if segpos is None else segpos[src]))
    return _without_sinks(opts, plan), q_info, infos, plan.offset


def _ring_forward(opts, kernel, config, q, k, v, q_seg, kv_seg, extras, out_dtype=None):
    b, t, h, _ = q.shape
    plan = ring_plan(opts, t)
    # a lone step's output is final: it may come in `out_dtype` (`BlockKernel.final_dtype`); merged ones not
    if plan.num_steps > 1 or plan.sink_step:
        out_dtype = None
    step_dtype = jnp.float32 if out_dtype is None else out_dtype
    q_info = query_info(opts, q, q_seg)
    ring_opts = _without_sinks(opts, plan)
    kv = shift((k, v, kv_seg, q_info.segpos), opts, -plan.offset)
    out = lse = None
    for step in range(plan.num_steps):
        # issue the next transfer before this step's compute so the two overlap
        nxt = shift(kv, opts, 1) if step + 1 < plan.num_steps else None
        k_cur, v_cur, seg_cur, segpos_cur = kv
        k_info = shard_info(opts, _source_at(plan, step, opts), t, seg_cur, segpos_cur)

        def compute(k_cur=k_cur, v_cur=v_cur, k_info=k_info):
            o, lse_s = kernel.fwd(q, k_cur, v_cur, q_info, k_info, extras, ring_opts, config, **_dtype_kw(out_dtype))
            return o.astype(step_dtype), lse_s  # a kernel may keep float32 where it cannot write out_dtype

        def empty(k_cur=k_cur):
            zero = _compat.match_vma(jnp.zeros((b, t, h, v.shape[3]), step_dtype), q, k_cur)
            return zero, _compat.match_vma(jnp.full((b, h, t), -jnp.inf, jnp.float32), q, k_cur)

        o, lse_s = _run_step(ring_opts, kernel, q_info, k_info, compute, empty)
        out, lse = (o, lse_s) if out is None else merge_attention(out, lse, o, lse_s)
        kv = nxt
    if plan.sink_step:
        sink_opts = StepOptions.sink_step(opts)
        k_s, v_s = _sink_kv(k, q_info.pos, opts), _sink_kv(v, q_info.pos, opts)
        o, lse_s = kernel.fwd(q, k_s, v_s, q_info, _sink_info(opts), extras, sink_opts, config)
        out, lse = merge_attention(out, lse, o, lse_s)
    return out, lse


_NO_EXTRAS = Extras()


def ring_attention_shard(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras=_NO_EXTRAS):
    """Per-device ring attention: returns (out in q.dtype, lse float32 [B,H,T])."""
    opts, q_seg, kv_seg = _chunks_as_segments(opts, q_seg, kv_seg)
    return _ring_attention(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras)


def _chunks_as_segments(opts: AttentionOptions, q_seg, kv_seg):
    """Per-document chunks (`chunk_size` with `segment_ids`, no sink tokens) as plain segments: two tokens
    share a chunk of a document iff they have the same segment id and the same chunk index within their run
    of that id, so ids numbering those (id, chunk) pairs mask exactly the same pairs with no chunk option.
    Every kernel that takes segments then runs per-document chunks, with no per-token offsets to load."""
    if opts.chunk_size is None or not opts.has_segments or opts.num_sink_tokens:
        return opts, q_seg, kv_seg
    t = q_seg.shape[1]
    order = natural_order(opts, t)
    pos = positions(opts, shard_index(opts), t)

    def refine(seg):
        return _chunk_ids(whole(seg, opts, order), opts.chunk_size)[:, pos]

    q_ids = refine(q_seg)
    kv_ids = q_ids if kv_seg is q_seg else refine(kv_seg)
    return dataclasses.replace(opts, chunk_size=None), q_ids, kv_ids


def _chunk_ids(whole_seg, chunk_size: int):
    """[B, T] ids (whole sequence, natural order) equal iff two tokens have the same segment id and the same
    `segment_offsets(...) // chunk_size`: the dense rank of that pair in each row; padding (< 0) stays -1."""
    chunk = segment_offsets(whole_seg) // chunk_size

    def row(seg, chunk):
        order = jnp.lexsort((chunk, seg))
        s, c = seg[order], chunk[order]
        new = jnp.concatenate([jnp.ones((1,), bool), (s[1:] != s[:-1]) | (c[1:] != c[:-1])])
        return jnp.zeros_like(seg).at[order].set(jnp.cumsum(new, dtype=seg.dtype) - 1)

    return jnp.where(whole_seg < 0, -1, jax.vmap(row)(whole_seg, chunk)).astype(whole_seg.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring_attention(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras=_NO_EXTRAS):
    out, lse, _ = _fwd(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras)
    return out, lse


def _fwd(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras):
    # an eager jax.grad hands this rule its inputs' primal values as given: numpy arrays, which loops index with
    # traced positions
    q, k, v, q_seg, kv_seg, sinks, extras = jax.tree.map(jnp.asarray, (q, k, v, q_seg, kv_seg, sinks, extras))
    # where no learnable sinks rescale it, one call's output is final and may come in q's dtype
    out_dtype = q.dtype if kernel.final_dtype and sinks is None else None
    if opts.invariant:  # the same bits on any ring: kernels on granule pairs, sums in fixed point
        out, lse = invariant.forward(opts, kernel, config, q, k, v, q_seg, kv_seg, extras)
    elif opts.gather_kv:
        out, lse = _gather_forward(opts, kernel, config, q, k, v, q_seg, kv_seg, extras, out_dtype)
    elif kernel.ring_fwd is not None:
        out, lse = kernel.ring_fwd(q, k, v, q_seg, kv_seg, extras, opts, config, **_dtype_kw(out_dtype))
    else:
        out, lse = _ring_forward(opts, kernel, config, q, k, v, q_seg, kv_seg, extras, out_dtype)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    out = out.astype(q.dtype)
    return out, lse, (q, k, v, q_seg, kv_seg, sinks, extras, out, lse)


def _fwd_rule(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras):
    out, lse, res = _fwd(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras)
    return (out, lse), res


def _bwd_rule(opts, kernel, config, res, cts):
    q, k, v, q_seg, kv_seg, sinks, extras, out, lse = res
    dout, dlse = cts
    dout = dout.astype(q.dtype)
    # dS = P * (dP - delta): the lse cotangent enters as a per-row shift of delta
    if opts.invariant:
        delta = invariant.row_dots(dout, out, opts)
    else:
        delta = jnp.swapaxes((dout.astype(jnp.float32) * out.astype(jnp.float32)).sum(axis=-1), 1, 2)
    delta = delta - dlse.astype(jnp.float32)
    alibi = extras.alibi_slopes is not None
    if opts.invariant:
        ring_bwd = functools.partial(invariant.backward, kernel)
    elif opts.gather_kv:
        ring_bwd = functools.partial(_gather_backward, kernel)
    elif kernel.ring_bwd is not None:
        ring_bwd = functools.partial(kernel.ring_bwd, **_dtype_kw(q.dtype if kernel.final_dtype else None))
    else:
        ring_bwd = functools.partial(_ring_backward, kernel, final=kernel.final_dtype)
    dq, dk, dv, dslopes = ring_bwd(q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config)

    dsinks = None
    if sinks is not None and opts.invariant:
        dsinks = invariant.sinks_grad(sinks, lse, delta, opts)
    elif sinks is not None:
        dsinks = (-(sink_probability(sinks, lse) * delta).sum(axis=(0, 2))).astype(sinks.dtype)
    dextras = Extras(alibi_slopes=None if not alibi else dslopes.astype(extras.alibi_slopes.dtype))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks, dextras)


def _ring_backward(kernel, q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config, final=False):
    t = q.shape[1]
    plan = ring_plan(opts, t)
    # a lone step's gradients are final: they may come in the inputs' dtype (`BlockKernel.final_dtype`)
    final = final and plan.num_steps == 1 and not plan.sink_step
    grad_dtype = q.dtype if final else jnp.float32
    dtype_kw = _dtype_kw(q.dtype if final else None)
    ring_opts = _without_sinks(opts, plan)
    q_info = query_info(opts, q, q_seg)
    alibi = extras.alibi_slopes is not None

    kv = shift((k, v, kv_seg, q_info.segpos), opts, -plan.offset)
    dq = dkv = dslopes = None
    for step in range(plan.num_steps):
        nxt = shift(kv, opts, 1) if step + 1 < plan.num_steps else None
        k_cur, v_cur, seg_cur, segpos_cur = kv
        k_info = shard_info(opts, _source_at(plan, step, opts), t, seg_cur, segpos_cur)

        def compute(k_cur=k_cur, v_cur=v_cur, k_info=k_info):
            *grads, dsl = kernel.bwd(q, k_cur, v_cur, dout, lse, delta, q_info, k_info, extras, ring_opts, config,
                                     **dtype_kw)
            return (*(g.astype(grad_dtype) for g in grads), dsl)

        def empty(k_cur=k_cur):
            refs = (q, k_cur, dout)
            zeros = [_compat.match_vma(jnp.zeros(x.shape, grad_dtype), *refs) for x in (q, k, v)]
            slopes = _compat.match_vma(jnp.zeros(q.shape[2], jnp.float32), *refs) if alibi else None
            return (*zeros, slopes)

        dq_s, dk_s, dv_s, dsl_s = _run_step(ring_opts, kernel, q_info, k_info, compute, empty)
        dq = dq_s if dq is None else dq + dq_s
        dslopes = dsl_s if dslopes is None else dslopes + dsl_s
        dkv = (dk_s, dv_s) if dkv is None else (dkv[0] + dk_s, dkv[1] + dv_s)
        if step + 1 < plan.num_steps:
            dkv = shift(dkv, opts, 1)  # dK/dV travel with the K/V they belong to
        kv = nxt
    dk, dv = shift(dkv, opts, plan.home_shift)

    if plan.sink_step:
        sink_opts = StepOptions.sink_step(opts)
        k_s, v_s = _sink_kv(k, q_info.pos, opts), _sink_kv(v, q_info.pos, opts)
        dq_s, dk_s, dv_s, dsl_s = kernel.bwd(q, k_s, v_s, dout, lse, delta, q_info, _sink_info(opts), extras,
                                             sink_opts, config)
        dq = dq + dq_s
        dslopes = None if dsl_s is None else dslopes + dsl_s
        onehot = _sink_onehot(q_info.pos, _sink_slots(opts), jnp.float32)
        # every device touched the sink keys: sum, then each owner keeps its own slots
        hi = lax.Precision.HIGHEST
        dk = dk + jnp.einsum("sl,bshd->blhd", onehot, lax.psum(dk_s, opts.axis_name), precision=hi)
        dv = dv + jnp.einsum("sl,bshd->blhd", onehot, lax.psum(dv_s, opts.axis_name), precision=hi)

    return dq, dk, dv, dslopes


_ring_attention.defvjp(_fwd_rule, _bwd_rule)

"""The ppermute ring: K/V travel, queries stay, partial results merge by lse.

This file is the ring schedule only. What happens inside one step (one shard's
queries against one shard's keys) is a `BlockKernel` supplied by a backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ringjax import _compat
from ringjax.layouts import local_positions
from ringjax.masks import TokenInfo, block_range, maybe_visible
from ringjax.merge import merge_attention
from ringjax.options import AttentionOptions
from ringjax.schedule import ring_plan, steps_may_be_empty


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """One ring step: all local queries against one shard of keys.

    fwd(q, k, v, q_info, k_info, opts, config) -> (out f32 [B,T,H,D], lse f32 [B,H,T])
    bwd(q, k, v, dout, lse, delta, q_info, k_info, opts, config) -> (dq, dk, dv), float32,
      where lse is the final (whole-ring) lse and delta = rowsum(dout * out) - dlse.
    Both must give exact zeros (and lse -inf) for rows that see no key.
    lockstep: the kernel must run on every device at every step (the Pallas TPU
      interpreter synchronises all devices at each kernel), so steps the mask empties
      are not skipped with lax.cond around it; the kernel skips their tiles itself.
    ring_fwd, ring_bwd: optional replacements of the whole forward / backward ring (e.g.
      one fused kernel that moves K/V itself):
      ring_fwd(q, k, v, q_seg, kv_seg, opts, config) -> (out f32, lse), before sinks;
      ring_bwd(q, k, v, dout, lse, delta, q_seg, kv_seg, opts, config) -> (dq, dk, dv) f32.
    """

    name: str
    fwd: Callable[..., Any]
    bwd: Callable[..., Any]
    lockstep: bool = False
    ring_fwd: Callable[..., Any] | None = None
    ring_bwd: Callable[..., Any] | None = None


def _shift(tree, opts: AttentionOptions, d: int):
    """Device r receives the value of device r - d (mod N)."""
    n = opts.axis_size
    d %= n
    if d == 0:
        return tree
    perm = [(i, (i + d) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, opts.axis_name, perm), tree)


def _shard_index(opts: AttentionOptions):
    return lax.axis_index(opts.axis_name) if opts.axis_name is not None else jnp.int32(0)


def _run_step(opts, kernel, q_info, k_info, compute, empty):
    """Run `compute` unless the mask hides every key of this step from every query."""
    if kernel.lockstep or not steps_may_be_empty(opts):
        return compute()
    pred = maybe_visible(opts, block_range(q_info), block_range(k_info))
    return lax.cond(pred, compute, empty)


def _ring_forward(opts, kernel, config, q, k, v, q_seg, kv_seg):
    b, t, h, _ = q.shape
    n = opts.axis_size
    shard = _shard_index(opts)
    plan = ring_plan(opts, t)
    q_info = TokenInfo(local_positions(opts.layout, shard, n, t), q_seg)
    kv = _shift((k, v, kv_seg), opts, -plan.offset)
    out = lse = None
    for step in range(plan.num_steps):
        # issue the next transfer before this step's compute so the two overlap
        nxt = _shift(kv, opts, 1) if step + 1 < plan.num_steps else None
        k_cur, v_cur, seg_cur = kv
        k_info = TokenInfo(local_positions(opts.layout, plan.source(shard, step, n), n, t), seg_cur)

        def compute(k_cur=k_cur, v_cur=v_cur, k_info=k_info):
            return kernel.fwd(q, k_cur, v_cur, q_info, k_info, opts, config)

        def empty():
            zero = _compat.match_vma(jnp.zeros(q.shape, jnp.float32), q, k_cur)
            return zero, _compat.match_vma(jnp.full((b, h, t), -jnp.inf, jnp.float32), q, k_cur)

        o, l = _run_step(opts, kernel, q_info, k_info, compute, empty)
        out, lse = (o, l) if out is None else merge_attention(out, lse, o, l)
        kv = nxt
    return out, lse


def _add_sinks(out, lse, sinks):
    """exp(sinks[h]) joins every denominator: rescale out, raise lse."""
    sink = sinks.astype(jnp.float32)[None, :, None]
    new_lse = jnp.logaddexp(lse, sink)
    scale = jnp.exp(lse - new_lse)  # 0 for rows that saw no key
    return out * jnp.swapaxes(scale, 1, 2)[..., None], new_lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def ring_attention_shard(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks):
    """Per-device ring attention: returns (out in q.dtype, lse float32 [B,H,T])."""
    out, lse, _ = _fwd(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks)
    return out, lse


def _fwd(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks):
    if kernel.ring_fwd is not None:
        out, lse = kernel.ring_fwd(q, k, v, q_seg, kv_seg, opts, config)
    else:
        out, lse = _ring_forward(opts, kernel, config, q, k, v, q_seg, kv_seg)
    if sinks is not None:
        out, lse = _add_sinks(out, lse, sinks)
    out = out.astype(q.dtype)
    return out, lse, (q, k, v, q_seg, kv_seg, sinks, out, lse)


def _fwd_rule(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks):
    out, lse, res = _fwd(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks)
    return (out, lse), res


def _bwd_rule(opts, kernel, config, res, cts):
    q, k, v, q_seg, kv_seg, sinks, out, lse = res
    dout, dlse = cts
    dout = dout.astype(q.dtype)
    # dS = P * (dP - delta): the lse cotangent enters as a per-row shift of delta
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    if kernel.ring_bwd is not None:
        dq, dk, dv = kernel.ring_bwd(q, k, v, dout, lse, delta, q_seg, kv_seg, opts, config)
    else:
        dq, dk, dv = _ring_backward(opts, kernel, config, q, k, v, q_seg, kv_seg, dout, lse, delta)

    dsinks = None
    if sinks is not None:
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
        dsinks = (-(p_sink * delta).sum(axis=(0, 2))).astype(sinks.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks)


def _ring_backward(opts, kernel, config, q, k, v, q_seg, kv_seg, dout, lse, delta):
    t = q.shape[1]
    n = opts.axis_size
    shard = _shard_index(opts)
    plan = ring_plan(opts, t)
    q_info = TokenInfo(local_positions(opts.layout, shard, n, t), q_seg)

    kv = _shift((k, v, kv_seg), opts, -plan.offset)
    dq = None
    dkv = None
    for step in range(plan.num_steps):
        nxt = _shift(kv, opts, 1) if step + 1 < plan.num_steps else None
        k_cur, v_cur, seg_cur = kv
        k_info = TokenInfo(local_positions(opts.layout, plan.source(shard, step, n), n, t), seg_cur)

        def compute(k_cur=k_cur, v_cur=v_cur, k_info=k_info):
            return kernel.bwd(q, k_cur, v_cur, dout, lse, delta, q_info, k_info, opts, config)

        def empty(k_cur=k_cur):
            refs = (q, k_cur, dout)
            return (
                _compat.match_vma(jnp.zeros(q.shape, jnp.float32), *refs),
                _compat.match_vma(jnp.zeros(k.shape, jnp.float32), *refs),
                _compat.match_vma(jnp.zeros(v.shape, jnp.float32), *refs),
            )

        dq_s, dk_s, dv_s = _run_step(opts, kernel, q_info, k_info, compute, empty)
        dq = dq_s if dq is None else dq + dq_s
        dkv = (dk_s, dv_s) if dkv is None else (dkv[0] + dk_s, dkv[1] + dv_s)
        if step + 1 < plan.num_steps:
            dkv = _shift(dkv, opts, 1)  # dK/dV travel with the K/V they belong to
        kv = nxt
    dk, dv = _shift(dkv, opts, plan.home_shift)
    return dq, dk, dv


ring_attention_shard.defvjp(_fwd_rule, _bwd_rule)

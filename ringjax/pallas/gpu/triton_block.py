"""One ring step as Pallas kernels lowered through Triton (any CUDA GPU, or the interpreter).

Forward: grid (q block, batch, head); each program walks the key blocks the mask
may show it. Backward, fused (default): grid over key blocks and KV heads, walking the
query blocks of the G query heads of its KV head (no repeated K/V); dK, dV accumulate in
registers and dQ is added to a float32 buffer with atomics: 5 block matmuls per block
pair. Backward, split (`GpuConfig(bwd_fused=False)`): the same dK/dV kernel without dQ,
plus a dQ kernel gridded like the forward: 7 block matmuls, no atomics.

Which block pairs run is decided before the launch, in XLA, from `masks.maybe_visible`
and `masks.fully_visible` on block position/segment ranges. Three walks:
- "dense": the mask hides nothing (no causal/window/chunk/segments): every block, no table.
- "ranges" (no segments): per program four loop bounds lo <= flo <= fhi <= hi; blocks
  [flo, fhi) are fully visible (no element mask), [lo, flo) and [fhi, hi) get the element
  mask, the rest are never visited. The loop index is the block index, so no load sits
  between iterations and Triton can software-pipeline the K/V loads.
- "list" (segments, whose visible blocks need not be contiguous): a per-program list of
  block indices, fully visible first; one dependent index load per block.
A step whose keys are all hidden does no work and returns out 0, lse -inf, zero grads,
so the ring needs no `lax.cond` around it (`BlockKernel.skips_empty_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ringjax import _compat
from ringjax.masks import (BlockRange, TokenInfo, fully_visible, logits, logits_and_slope, may_skip, maybe_visible,
                           visible)
from ringjax.options import AttentionOptions
from ringjax.pallas.gpu._atomics import atomic_add
from ringjax.pallas.gpu.config import GpuConfig, pick_block

_NEG_INF = float("-inf")
_LOG2E = 1.0 / math.log(2.0)


def block_sizes(opts: AttentionOptions, t: int, s: int, want_q: int, want_kv: int) -> tuple[int, int]:
    """Power-of-two blocks that never straddle a zigzag chunk boundary."""
    per = opts.shards_per_device
    bq, bk = pick_block(t // per, want_q), pick_block(s // per, want_kv)
    if bq is None or bk is None:
        raise ValueError(f"pallas_gpu needs shard units divisible by 16, got {t // per} and {s // per}")
    return bq, bk


# --------------------------------------------------------------------------- visit lists


def _ranges(info: TokenInfo, n: int, size: int) -> BlockRange:
    pos = info.pos.reshape(n, size)
    lo, hi = pos.min(axis=1), pos.max(axis=1)
    if info.seg is None:
        return BlockRange(lo, hi, None, None)
    seg = info.seg.reshape(info.seg.shape[0], n, size)
    return BlockRange(lo, hi, seg.min(axis=2), seg.max(axis=2))


def _expand(r: BlockRange, pos_axis: int, seg_axis: int) -> BlockRange:
    seg = (None, None) if r.seg_lo is None else (
        jnp.expand_dims(r.seg_lo, seg_axis), jnp.expand_dims(r.seg_hi, seg_axis))
    return BlockRange(jnp.expand_dims(r.pos_lo, pos_axis), jnp.expand_dims(r.pos_hi, pos_axis), *seg)


def _categories(opts, q_info, k_info, bq, bk):
    """int32 [Bl, nq, nk]: 0 fully visible, 1 partly visible, 2 hidden (Bl = B with segments, else 1)."""
    t, s = q_info.pos.shape[0], k_info.pos.shape[0]
    nq, nk = t // bq, s // bk
    qr = _expand(_ranges(q_info, nq, bq), 1, 2)  # pos [nq, 1], seg [B, nq, 1]
    kr = _expand(_ranges(k_info, nk, bk), 0, 1)  # pos [1, nk], seg [B, 1, nk]
    rows = q_info.seg.shape[0] if q_info.seg is not None else 1
    shape = (rows, nq, nk)
    maybe = jnp.broadcast_to(maybe_visible(opts, qr, kr), shape)
    full = jnp.broadcast_to(fully_visible(opts, qr, kr), shape)
    return jnp.where(full, 0, jnp.where(maybe, 1, 2)).astype(jnp.int32)


def _visit_list(cat):
    """Per row of `cat` [Bl, n, m]: column order (full, partial, hidden), #full, #visible."""
    order = jnp.argsort(cat, axis=-1, stable=True).astype(jnp.int32)
    n_full = (cat == 0).sum(axis=-1).astype(jnp.int32)
    n_vis = (cat < 2).sum(axis=-1).astype(jnp.int32)
    return order, n_full, n_vis


def _range_table(cat):
    """int32 [Bl, n, 4] per row of `cat` [Bl, n, m]: lo <= flo <= fhi <= hi.

    [lo, hi) covers every visible column; [flo, fhi) holds fully visible columns only.
    Exact for any mask: columns of [lo, hi) outside [flo, fhi) get the element mask, and
    if the fully visible columns are not contiguous none is treated as fully visible.
    For position-only masks on monotone positions (every layout) both sets are
    contiguous, so nothing hidden is visited and nothing visible is masked needlessly.
    """
    m = cat.shape[-1]
    col = jnp.arange(m, dtype=jnp.int32)
    vis, full = cat < 2, cat == 0
    hi = jnp.max(jnp.where(vis, col + 1, 0), axis=-1)
    lo = jnp.minimum(jnp.min(jnp.where(vis, col, m), axis=-1), hi)
    fhi = jnp.max(jnp.where(full, col + 1, 0), axis=-1)
    flo = jnp.min(jnp.where(full, col, m), axis=-1)
    contiguous = (fhi > flo) & (fhi - flo == full.sum(axis=-1))
    flo, fhi = jnp.where(contiguous, flo, lo), jnp.where(contiguous, fhi, lo)
    return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


def _walk_mode(opts: AttentionOptions, has_seg: bool) -> str:
    if not may_skip(opts):
        return "dense"
    return "list" if has_seg else "ranges"


def _tables(mode: str, cat):
    """Arrays the kernels index to find their blocks (see the module docstring)."""
    if mode == "dense":
        return []
    if mode == "ranges":
        return [_range_table(cat)]
    return list(_visit_list(cat))


def _walk(mode: str, tabs, row, i, n: int, step, carry):
    """carry = step(block, carry, masked) over the blocks program row `i` must visit."""
    if mode == "dense":
        return lax.fori_loop(0, n, lambda t, c: step(t, c, False), carry)
    if mode == "ranges":
        (rng_ref,) = tabs
        lo, flo, fhi, hi = (rng_ref[row, i, c] for c in range(4))
        carry = lax.fori_loop(lo, flo, lambda t, c: step(t, c, True), carry)
        carry = lax.fori_loop(flo, fhi, lambda t, c: step(t, c, False), carry)
        return lax.fori_loop(fhi, hi, lambda t, c: step(t, c, True), carry)
    idx_ref, nf_ref, nv_ref = tabs
    n_full, n_vis = nf_ref[row, i], nv_ref[row, i]
    carry = lax.fori_loop(0, n_full, lambda t, c: step(idx_ref[row, i, t], c, False), carry)
    return lax.fori_loop(n_full, n_vis, lambda t, c: step(idx_ref[row, i, t], c, True), carry)


# --------------------------------------------------------------------------- kernels


def _dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul with float32 accumulation; transposes fold into the contraction.

    float32 operands get IEEE products: Triton would otherwise use TF32 (~3e-4 error).
    """
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _logits2(qk, opts: AttentionOptions):
    """Logits in base 2 (logits * log2 e, so exp2 replaces exp) and their slope d logits / d qk.

    Without a soft cap the log2 e factor folds into the scale: one multiply per score.
    """
    if opts.logits_soft_cap is None:
        return logits(qk, dataclasses.replace(opts, softmax_scale=opts.softmax_scale * _LOG2E)), opts.softmax_scale
    s, slope = logits_and_slope(qk, opts)
    return s * _LOG2E, slope


def _q_block(opts: AttentionOptions, nq: int, i):
    """Causal: the last query blocks have the most keys; launch them first."""
    return nq - 1 - i if opts.causal else i


def _seg_info(pos, seg):
    return TokenInfo(pos, None if seg is None else seg[None, :])


def _mask(opts, q_tok, k_tok, shape):
    return visible(opts, q_tok, k_tok).reshape(shape)


def _unpack(refs, n_in: int, has_seg: bool, n_tabs: int):
    """Split kernel refs into (inputs, seg refs or Nones, tables, outputs)."""
    ins, rest = refs[:n_in], refs[n_in:]
    segs = (None, None)
    if has_seg:
        segs, rest = rest[:2], rest[2:]
    return ins, segs, rest[:n_tabs], rest[n_tabs:]


def _fwd_kernel(*refs, opts: AttentionOptions, bq: int, bk: int, nq: int, has_seg: bool, mode: str, n_tabs: int):
    (q_ref, k_ref, v_ref, qpos_ref, kpos_ref), (qseg_ref, kseg_ref), tabs, (o_ref, lse_ref) = _unpack(
        refs, 5, has_seg, n_tabs)
    i = _q_block(opts, nq, pl.program_id(0))
    row = pl.program_id(1) if has_seg else 0
    q = q_ref[...]
    q_tok = _seg_info(qpos_ref[...], None if qseg_ref is None else qseg_ref[...])

    def step(blk, carry, masked):
        m, l, acc = carry
        start = pl.multiple_of(blk * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s, _ = _logits2(_dot(q, k, trans_b=True), opts)
        if masked:
            k_tok = _seg_info(kpos_ref[pl.ds(start, bk)], None if kseg_ref is None else kseg_ref[pl.ds(start, bk)])
            s = jnp.where(_mask(opts, q_tok, k_tok, s.shape), s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        # rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives exact zeros
        m_use = jnp.where(m_new == _NEG_INF, 0.0, m_new) if masked else m_new
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        l = alpha * l + p.sum(axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return m_new, l, acc

    d = q.shape[-1]
    init = (jnp.full((bq,), _NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    m, l, acc = _walk(mode, tabs, row, i, k_ref.shape[0] // bk, step, init)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(l_safe)) / _LOG2E, _NEG_INF)


def _probs_and_ds(q, k, v, do, lse2, delta, opts, mask):
    """P, dS (both [bq, bk], float32) of one block pair; lse2 = lse * log2 e; `mask` is None or bool."""
    s, slope = _logits2(_dot(q, k, trans_b=True), opts)
    p = jnp.exp2(s - lse2[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None]) * slope
    return p, ds


def _dq_kernel(*refs, opts: AttentionOptions, bq: int, bk: int, nq: int, has_seg: bool, mode: str, n_tabs: int):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref), (qseg_ref, kseg_ref), tabs, (dq_ref,) = (
        _unpack(refs, 8, has_seg, n_tabs))
    i = _q_block(opts, nq, pl.program_id(0))
    row = pl.program_id(1) if has_seg else 0
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_tok = _seg_info(qpos_ref[...], None if qseg_ref is None else qseg_ref[...])

    def step(blk, dq, masked):
        start = pl.multiple_of(blk * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        mask = None
        if masked:
            k_tok = _seg_info(kpos_ref[pl.ds(start, bk)], None if kseg_ref is None else kseg_ref[pl.ds(start, bk)])
            mask = _mask(opts, q_tok, k_tok, (bq, bk))
        _, ds = _probs_and_ds(q, k, v, do, lse, delta, opts, mask)
        return dq + _dot(ds.astype(k.dtype), k)

    dq_ref[...] = _walk(mode, tabs, row, i, k_ref.shape[0] // bk, step, jnp.zeros(q.shape, jnp.float32))


def _dkv_kernel(*refs, opts: AttentionOptions, bq: int, bk: int, groups: int, has_seg: bool, mode: str,
                n_tabs: int, fused: bool):
    """dK, dV of one key block (and, if `fused`, its dQ contributions added atomically)."""
    ins, (qseg_ref, kseg_ref), tabs, outs = _unpack(refs, 8 + fused, has_seg, n_tabs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref = ins[:8]
    dk_ref, dv_ref = outs[:2]
    dq_ref = outs[2] if fused else None  # aliased to the zeros passed as input 8
    j = pl.program_id(0)
    row = pl.program_id(1) if has_seg else 0
    k, v = k_ref[...], v_ref[...]
    k_tok = _seg_info(kpos_ref[...], None if kseg_ref is None else kseg_ref[...])

    def head(g, carry):
        def step(blk, carry, masked):
            dk, dv = carry
            start = pl.multiple_of(blk * bq, bq)
            rows = pl.ds(start, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            mask = None
            if masked:
                q_tok = _seg_info(qpos_ref[rows], None if qseg_ref is None else qseg_ref[rows])
                mask = _mask(opts, q_tok, k_tok, (bq, bk))
            p, ds = _probs_and_ds(q, k, v, do, lse, delta, opts, mask)
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
            dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
            if fused:
                atomic_add(dq_ref, (rows, g, slice(None)), _dot(ds.astype(k.dtype), k))
            return dk, dv

        return _walk(mode, tabs, row, j, q_ref.shape[0] // bq, step, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = dk
    dv_ref[...] = dv


# --------------------------------------------------------------------------- launches


def _params(config: GpuConfig, bwd: bool):
    if bwd:
        return plgpu.CompilerParams(num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages)
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _unify(args):
    """Make every operand vary over the same mesh axes (a pallas_call needs one for its outputs)."""
    return [_compat.match_vma(x, *args) for x in args]


def _launch(call, args, out_shapes, interpret: bool):
    """Run a pallas_call; in interpret mode outside shard_map's vma checks (see _compat)."""
    if not interpret:
        return call(*args)
    return _compat.call_unchecked_vma(call, [(o.shape, o.dtype) for o in out_shapes], *args)


def _full(x):
    """BlockSpec covering all of `x` (small tables indexed inside the kernel)."""
    nd = x.ndim
    return pl.BlockSpec(x.shape, lambda *_: (0,) * nd)


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, opts: AttentionOptions, config: GpuConfig):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk = block_sizes(opts, t, s, config.block_q, config.block_kv)
    has_seg = q_info.seg is not None
    mode = _walk_mode(opts, has_seg)
    tabs = _tables(mode, _categories(opts, q_info, k_info, bq, bk)) if mode != "dense" else []
    nq = t // bq
    r = functools.partial(_q_block, opts, nq)
    args = [q, k, v, q_info.pos, k_info.pos]
    specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, r(i), hh, 0)),
        pl.BlockSpec((None, s, None, d), lambda i, bb, hh: (bb, 0, hh // g, 0)),
        pl.BlockSpec((None, s, None, d), lambda i, bb, hh: (bb, 0, hh // g, 0)),
        pl.BlockSpec((bq,), lambda i, bb, hh: (r(i),)),
        pl.BlockSpec((s,), lambda i, bb, hh: (0,)),
    ]
    if has_seg:
        args += [q_info.seg, k_info.seg]
        specs += [pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, r(i))),
                  pl.BlockSpec((None, s), lambda i, bb, hh: (bb, 0))]
    args += tabs
    specs += [_full(x) for x in tabs]
    args = _unify(args)
    kernel = functools.partial(_fwd_kernel, opts=opts, bq=bq, bk=bk, nq=nq, has_seg=has_seg, mode=mode,
                               n_tabs=len(tabs))
    out_shapes = [_compat.struct_like((b, t, h, d), jnp.float32, args[0]),
                  _compat.struct_like((b, h, t), jnp.float32, args[0])]
    call = pl.pallas_call(
        kernel,
        grid=(t // bq, b, h),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, r(i), hh, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, r(i))),
        ],
        out_shape=out_shapes,
        compiler_params=_params(config, bwd=False),
        interpret=config.interpret,
        name="ringjax_fwd",
    )
    out, lse = _launch(call, args, out_shapes, config.interpret)
    return out, lse


def block_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, opts: AttentionOptions,
              config: GpuConfig):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk = block_sizes(opts, t, s, config.bwd_block_q, config.bwd_block_kv)
    has_seg = q_info.seg is not None
    mode = _walk_mode(opts, has_seg)
    cat = _categories(opts, q_info, k_info, bq, bk) if mode != "dense" else None
    # base-2 lse; rows that see no key get 0: every P of theirs is masked to 0 anyway
    lse = jnp.where(jnp.isfinite(lse), lse * _LOG2E, 0.0)
    delta = delta.astype(jnp.float32)
    seg_args = [q_info.seg, k_info.seg] if has_seg else []
    fused = config.bwd_fused

    dq = None
    if not fused:  # dQ: grid over query blocks, walking key blocks
        tabs = _tables(mode, cat)
        nq = t // bq
        r = functools.partial(_q_block, opts, nq)
        args = _unify([q, k, v, dout, lse, delta, q_info.pos, k_info.pos, *seg_args, *tabs])
        specs = [
            pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, r(i), hh, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, bb, hh: (bb, 0, hh // g, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, bb, hh: (bb, 0, hh // g, 0)),
            pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, r(i), hh, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, r(i))),
            pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, r(i))),
            pl.BlockSpec((bq,), lambda i, bb, hh: (r(i),)),
            pl.BlockSpec((s,), lambda i, bb, hh: (0,)),
        ]
        if has_seg:
            specs += [pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, r(i))),
                      pl.BlockSpec((None, s), lambda i, bb, hh: (bb, 0))]
        specs += [_full(x) for x in tabs]
        out_shapes = [_compat.struct_like((b, t, h, d), jnp.float32, args[0])]
        call = pl.pallas_call(
            functools.partial(_dq_kernel, opts=opts, bq=bq, bk=bk, nq=nq, has_seg=has_seg, mode=mode,
                              n_tabs=len(tabs)),
            grid=(t // bq, b, h),
            in_specs=specs,
            out_specs=[pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, r(i), hh, 0))],
            out_shape=out_shapes,
            compiler_params=_params(config, bwd=True),
            interpret=config.interpret,
            name="ringjax_bwd_dq",
        )
        (dq,) = _launch(call, args, out_shapes, config.interpret)

    # dK, dV (and dQ when fused): grid over key blocks and KV heads, walking query blocks of the G query heads
    tabs = _tables(mode, None if cat is None else jnp.swapaxes(cat, 1, 2))
    group = pl.BlockSpec((None, t, g, d), lambda j, bb, hh: (bb, 0, hh, 0))
    args = [q, k, v, dout, lse, delta, q_info.pos, k_info.pos]
    specs = [
        group,
        pl.BlockSpec((None, bk, None, d), lambda j, bb, hh: (bb, j, hh, 0)),
        pl.BlockSpec((None, bk, None, d), lambda j, bb, hh: (bb, j, hh, 0)),
        group,
        pl.BlockSpec((None, g, t), lambda j, bb, hh: (bb, hh, 0)),
        pl.BlockSpec((None, g, t), lambda j, bb, hh: (bb, hh, 0)),
        pl.BlockSpec((t,), lambda j, bb, hh: (0,)),
        pl.BlockSpec((bk,), lambda j, bb, hh: (j,)),
    ]
    if fused:  # dQ accumulates atomically into these zeros (aliased to output 2)
        args.append(jnp.zeros((b, t, h, d), jnp.float32))
        specs.append(group)
    args += seg_args + tabs
    if has_seg:
        specs += [pl.BlockSpec((None, t), lambda j, bb, hh: (bb, 0)),
                  pl.BlockSpec((None, bk), lambda j, bb, hh: (bb, j))]
    specs += [_full(x) for x in tabs]
    args = _unify(args)
    kv_spec = pl.BlockSpec((None, bk, None, d), lambda j, bb, hh: (bb, j, hh, 0))
    out_shapes = [_compat.struct_like(k.shape, jnp.float32, args[0])] * 2
    out_specs = [kv_spec, kv_spec]
    if fused:
        out_shapes.append(_compat.struct_like((b, t, h, d), jnp.float32, args[0]))
        out_specs.append(group)
    call = pl.pallas_call(
        functools.partial(_dkv_kernel, opts=opts, bq=bq, bk=bk, groups=g, has_seg=has_seg, mode=mode,
                          n_tabs=len(tabs), fused=fused),
        grid=(s // bk, b, kvh),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases={8: 2} if fused else {},
        compiler_params=_params(config, bwd=True),
        interpret=config.interpret,
        name="ringjax_bwd_dkv_dq" if fused else "ringjax_bwd_dkv",
    )
    if fused:
        dk, dv, dq = _launch(call, args, out_shapes, config.interpret)
    else:
        dk, dv = _launch(call, args, out_shapes, config.interpret)
    return dq, dk, dv

"""One ring step as Pallas kernels lowered through Triton (any CUDA GPU, or the interpreter).

Forward: grid (q block, batch, head); each program walks the key blocks the mask
may show it. Backward, split (default): a dQ kernel gridded like the forward, and a dK/dV
kernel gridded over key blocks and KV heads that walks the query blocks of the G query
heads of its KV head (no repeated K/V): 7 block matmuls per block pair, no atomics.
Backward, fused (`GpuConfig(bwd_fused=True)`): the dK/dV kernel also adds dQ to a float32
buffer with atomics: 5 block matmuls per block pair.

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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ringjax import _compat
from ringjax.backends.pallas_triton._atomics import atomic_add
from ringjax.backends.pallas_triton.config import GpuConfig, block_sizes
from ringjax.core.masks import TokenInfo, may_skip, visible
from ringjax.core.modifiers import LOG2E, logit_slope, logits2
from ringjax.core.operands import Operands, Refs
from ringjax.core.precision import DEFAULT, dot_precision
from ringjax.core.tiles import Tiling
from ringjax.core.visits import block_tables, on_device, range_table
from ringjax.merge import finish, finite_or_zero
from ringjax.options import AttentionOptions

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- visit lists


def _categories(opts, q_info, k_info, bq, bk):
    """int32 [Bl, nq, nk]: 0 fully visible, 1 partly visible, 2 hidden (Bl = B with segments, else 1)."""
    maybe, full = block_tables(opts, q_info, k_info, bq, bk)
    return jnp.where(full, 0, jnp.where(maybe, 1, 2)).astype(jnp.int32)


def _visit_list(cat):
    """Per row of `cat` [Bl, n, m]: column order (full, partial, hidden), #full, #visible."""
    order = jnp.argsort(cat, axis=-1, stable=True).astype(jnp.int32)
    n_full = (cat == 0).sum(axis=-1).astype(jnp.int32)
    n_vis = (cat < 2).sum(axis=-1).astype(jnp.int32)
    return order, n_full, n_vis


def _range_tables(opts, q_info, k_info, bq, bk):
    """int32 [1, nq, 4] over key blocks and [1, nk, 4] over query blocks: lo <= flo <= fhi <= hi
    (`visits.range_table`), constants where the positions are static (`visits.on_device`).

    Exact for any mask: columns of [lo, hi) outside [flo, fhi) get the element mask. For
    position-only masks on monotone positions (every layout) both sets are contiguous, so
    nothing hidden is visited and nothing visible is masked needlessly.
    """
    return on_device(lambda q, k: (range_table(opts, q, k, bq, bk), range_table(opts, k, q, bk, bq, transpose=True)),
                     opts, q_info, k_info)


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


def _dot(a, b, prec, trans_a=False, trans_b=False):
    """2-D matmul with float32 accumulation; transposes fold into the contraction. `prec`: the tiles'
    `core.precision.dot_precision` (Triton lowers DEFAULT/HIGH on float32 to TF32, HIGHEST to IEEE)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _q_block(opts: AttentionOptions, nq: int, i):
    """Causal: the last query blocks have the most keys; launch them first."""
    return nq - 1 - i if opts.causal else i


def _tokens(pos_ref, seg_ref, idx) -> TokenInfo:
    """Positions and (this program's batch row of) segment ids of the tokens at `idx`."""
    return TokenInfo(pos_ref[idx], None if seg_ref is None else seg_ref[idx][None, :])


def _mask(opts, q_tok, k_tok, shape):
    return visible(opts, q_tok, k_tok).reshape(shape)


def _fwd_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling, mode: str, prec):
    r = Refs(layout, refs)
    bk = tl.block_kv
    i = _q_block(opts, tl.num_q, pl.program_id(0))
    row = pl.program_id(1) if tl.has_segments else 0
    q = r.q[...]
    q_tok = _tokens(r.qpos, r.get("qseg"), ...)

    def step(blk, carry, masked):
        m, denom, acc = carry
        keys = pl.ds(pl.multiple_of(blk * bk, bk), bk)
        k, v = r.k[keys, :], r.v[keys, :]
        s, _ = logits2(_dot(q, k, prec, trans_b=True), opts)
        if masked:
            s = jnp.where(_mask(opts, q_tok, _tokens(r.kpos, r.get("kseg"), keys), s.shape), s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        # rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives exact zeros
        m_use = finite_or_zero(m_new) if masked else m_new
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        denom = alpha * denom + p.sum(axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, prec)
        return m_new, denom, acc

    bq, dv = tl.block_q, tl.v_head_dim
    init = (jnp.full((bq,), _NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, dv), jnp.float32))
    m, denom, acc = _walk(mode, r.tables, row, i, tl.num_kv, step, init)
    out, lse = finish(acc, m, denom, base2=True)
    r.out[...] = out
    r.lse[...] = lse


def _probs_and_ds(q, k, v, do, lse2, delta, opts, mask, prec):
    """P, dS (both [bq, bk], float32) of one block pair; lse2 = lse * log2 e; `mask` is None or bool."""
    s, t = logits2(_dot(q, k, prec, trans_b=True), opts)
    slope = logit_slope(t, opts)
    p = jnp.exp2(s - lse2[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = _dot(do, v, prec, trans_b=True)
    ds = p * (dp - delta[:, None]) * slope
    return p, ds


def _dq_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling, mode: str, prec):
    r = Refs(layout, refs)
    bk = tl.block_kv
    i = _q_block(opts, tl.num_q, pl.program_id(0))
    row = pl.program_id(1) if tl.has_segments else 0
    q, do, lse, delta = r.q[...], r.do[...], r.lse[...], r.delta[...]
    q_tok = _tokens(r.qpos, r.get("qseg"), ...)

    def step(blk, dq, masked):
        keys = pl.ds(pl.multiple_of(blk * bk, bk), bk)
        k, v = r.k[keys, :], r.v[keys, :]
        mask = _mask(opts, q_tok, _tokens(r.kpos, r.get("kseg"), keys), (tl.block_q, bk)) if masked else None
        _, ds = _probs_and_ds(q, k, v, do, lse, delta, opts, mask, prec)
        return dq + _dot(ds.astype(k.dtype), k, prec)

    r.dq[...] = _walk(mode, r.tables, row, i, tl.num_kv, step, jnp.zeros(q.shape, jnp.float32))


def _dkv_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling, mode: str, prec):
    """dK, dV of one key block (and, if the layout has a dQ buffer, its dQ contributions added atomically)."""
    r = Refs(layout, refs)
    bq = tl.block_q
    j = pl.program_id(0)
    row = pl.program_id(1) if tl.has_segments else 0
    k, v = r.k[...], r.v[...]
    k_tok = _tokens(r.kpos, r.get("kseg"), ...)

    def head(g, carry):
        def step(blk, carry, masked):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(blk * bq, bq), bq)
            q, do = r.q[rows, g, :], r.do[rows, g, :]
            lse, delta = r.lse[g, rows], r.delta[g, rows]
            mask = _mask(opts, _tokens(r.qpos, r.get("qseg"), rows), k_tok, (bq, tl.block_kv)) if masked else None
            p, ds = _probs_and_ds(q, k, v, do, lse, delta, opts, mask, prec)
            dv = dv + _dot(p.astype(do.dtype), do, prec, trans_a=True)
            dk = dk + _dot(ds.astype(q.dtype), q, prec, trans_a=True)
            if r.get("dq") is not None:  # fused: the output aliased to the zeros passed in as dq_zeros
                atomic_add(r.dq, (rows, g, slice(None)), _dot(ds.astype(k.dtype), k, prec))
            return dk, dv

        return _walk(mode, r.tables, row, j, tl.num_q, step, carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    r.dk[...], r.dv[...] = lax.fori_loop(0, tl.groups, head, zeros)


# --------------------------------------------------------------------------- launches


def _full(x):
    """BlockSpec covering all of `x` (small tables indexed inside the kernel)."""
    nd = x.ndim
    return pl.BlockSpec(x.shape, lambda *_: (0,) * nd)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every kernel of one step shares: the tiling, the walk and the token metadata."""

    opts: AttentionOptions
    tl: Tiling
    mode: str
    q_info: TokenInfo
    k_info: TokenInfo
    tables: tuple  # ("ranges") the range tables by query and by key block; ("list") `_categories`; else ()
    prec: object  # `precision=` of every tile dot (core.precision.dot_precision)

    @classmethod
    def of(cls, q, k, v, q_info, k_info, opts, block_q, block_kv, precision: str):
        bq, bk = block_sizes(opts, q.shape[1], k.shape[1], block_q, block_kv)
        has_seg = q_info.seg is not None
        tl = Tiling.of(q, k, v, bq, bk, has_seg)
        mode = "dense" if not may_skip(opts) else "list" if has_seg else "ranges"
        tables = ()
        if mode == "ranges":
            tables = _range_tables(opts, q_info, k_info, bq, bk)
        elif mode == "list":
            tables = (_categories(opts, q_info, k_info, bq, bk),)
        return cls(opts, tl, mode, q_info, k_info, tables, dot_precision(q.dtype, precision))

    def walk_tables(self, by_keys: bool):
        """Arrays the kernels index to find their blocks (see the module docstring): rows are query blocks, or
        with `by_keys` key blocks."""
        if self.mode == "dense":
            return []
        if self.mode == "ranges":
            return [self.tables[by_keys]]
        (cat,) = self.tables
        return list(_visit_list(jnp.swapaxes(cat, 1, 2) if by_keys else cat))

    def by_query_block(self, *blocks):
        """Operands of a kernel gridded (query block, batch, head): q and `blocks` ((name, array, kind),
        kind "tokens" [B, T, H, D] (q's head_dim; "tokens_v": v's, as out and dO) or "rows" [B, H, T] at the
        query block, "keys" / "values": all keys of K / V) and the tables."""
        opts, tl = self.opts, self.tl
        g, bq, s = tl.groups, tl.block_q, tl.kv_len
        r = functools.partial(_q_block, opts, tl.num_q)
        spec = {"rows": pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, r(i)))}
        for suffix, d in (("", tl.head_dim), ("_v", tl.v_head_dim)):
            spec["tokens" + suffix] = pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, r(i), h, 0))
        spec["keys"], spec["values"] = (pl.BlockSpec((None, s, None, d), lambda i, b, h: (b, 0, h // g, 0))
                                        for d in (tl.head_dim, tl.v_head_dim))
        ops = Operands()
        for name, x, kind in blocks:
            ops.add(name, x, spec[kind])
        ops.add("qpos", self.q_info.pos, pl.BlockSpec((bq,), lambda i, b, h: (r(i),)))
        ops.add("kpos", self.k_info.pos, pl.BlockSpec((s,), lambda i, b, h: (0,)))
        if tl.has_segments:
            ops.add("qseg", self.q_info.seg, pl.BlockSpec((None, bq), lambda i, b, h: (b, r(i))))
            ops.add("kseg", self.k_info.seg, pl.BlockSpec((None, s), lambda i, b, h: (b, 0)))
        tabs = self.walk_tables(by_keys=False)
        ops.add_group("tables", tabs, [_full(x) for x in tabs])
        return ops, spec

    def by_key_block(self, *blocks):
        """Operands of a kernel gridded (key block, batch, KV head): `blocks` ((name, array, kind), kind
        "tokens" / "tokens_v": all T rows of the G query heads (q's / v's head_dim), "rows": [B, H, T]
        likewise, "keys" / "values": the key block of K / V)."""
        tl = self.tl
        g, t, bk = tl.groups, tl.q_len, tl.block_kv
        spec = {"rows": pl.BlockSpec((None, g, t), lambda j, b, h: (b, h, 0))}
        for suffix, d in (("", tl.head_dim), ("_v", tl.v_head_dim)):
            spec["tokens" + suffix] = pl.BlockSpec((None, t, g, d), lambda j, b, h: (b, 0, h, 0))
        spec["keys"], spec["values"] = (pl.BlockSpec((None, bk, None, d), lambda j, b, h: (b, j, h, 0))
                                        for d in (tl.head_dim, tl.v_head_dim))
        ops = Operands()
        for name, x, kind in blocks:
            ops.add(name, x, spec[kind])
        ops.add("qpos", self.q_info.pos, pl.BlockSpec((t,), lambda j, b, h: (0,)))
        ops.add("kpos", self.k_info.pos, pl.BlockSpec((bk,), lambda j, b, h: (j,)))
        if tl.has_segments:
            ops.add("qseg", self.q_info.seg, pl.BlockSpec((None, t), lambda j, b, h: (b, 0)))
            ops.add("kseg", self.k_info.seg, pl.BlockSpec((None, bk), lambda j, b, h: (b, j)))
        tabs = self.walk_tables(by_keys=True)
        ops.add_group("tables", tabs, [_full(x) for x in tabs])
        return ops, spec

    def launch(self, kernel, name: str, grid, ins: Operands, outs: Operands, config: GpuConfig, *, bwd: bool,
               aliases=None):
        """Run `kernel` over `grid`; `outs` holds (shape, dtype) pairs. In interpret mode the call runs
        outside shard_map's varying-axes checks (see _compat.call_unchecked_vma)."""
        args = _compat.align_vma(*ins.arrays)
        out_shapes = [_compat.struct_like(shape, dtype, *args) for shape, dtype in outs.arrays]
        warps, stages = (config.bwd_num_warps, config.bwd_num_stages) if bwd else (config.num_warps,
                                                                                 config.num_stages)
        call = pl.pallas_call(
            functools.partial(kernel, layout=ins.layout + outs.layout, opts=self.opts, tl=self.tl, mode=self.mode,
                              prec=self.prec),
            grid=grid,
            in_specs=ins.specs,
            out_specs=outs.specs,
            out_shape=out_shapes,
            input_output_aliases=aliases or {},
            compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
            interpret=config.interpret,
            name=name,
        )
        if not config.interpret:
            return call(*args)
        return _compat.call_unchecked_vma(call, [(o.shape, o.dtype) for o in out_shapes], *args)


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, opts: AttentionOptions, config: GpuConfig, *,
              precision: str = DEFAULT):
    """One ring step forward: (out f32 [B,T,H,Dv], lse f32 [B,H,T]); float32 tiles multiply at `precision`."""
    step = _Step.of(q, k, v, q_info, k_info, opts, config.block_q, config.block_kv, precision)
    tl = step.tl
    ins, spec = step.by_query_block(("q", q, "tokens"), ("k", k, "keys"), ("v", v, "values"))
    outs = (Operands().add("out", ((tl.batch, tl.q_len, tl.heads, tl.v_head_dim), jnp.float32), spec["tokens_v"])
            .add("lse", ((tl.batch, tl.heads, tl.q_len), jnp.float32), spec["rows"]))
    out, lse = step.launch(_fwd_kernel, "ringjax_fwd", (tl.num_q, tl.batch, tl.heads), ins, outs, config, bwd=False)
    return out, lse


def fuses_backward(opts: AttentionOptions, config: GpuConfig) -> bool:
    """Whether `block_bwd` adds dQ from the dK/dV kernel by float32 atomics (`config.bwd_fused`) rather than
    running a dQ kernel: not with `opts.deterministic`, as atomics sum dQ in no fixed order."""
    return config.bwd_fused and not opts.deterministic


def block_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, opts: AttentionOptions,
              config: GpuConfig, *, precision: str = DEFAULT):
    """One ring step backward: (dq, dk, dv) float32, from the whole-ring lse and delta."""
    step = _Step.of(q, k, v, q_info, k_info, opts, config.bwd_block_q, config.bwd_block_kv, precision)
    tl = step.tl
    # base-2 lse; rows that see no key get 0: every P of theirs is masked to 0 anyway
    lse2, delta = finite_or_zero(lse) * LOG2E, delta.astype(jnp.float32)
    tokens = ((tl.batch, tl.q_len, tl.heads, tl.head_dim), jnp.float32)
    fused = fuses_backward(opts, config)

    dq = None
    if not fused:  # dQ: grid over query blocks, walking key blocks
        ins, spec = step.by_query_block(("q", q, "tokens"), ("k", k, "keys"), ("v", v, "values"),
                                        ("do", dout, "tokens_v"), ("lse", lse2, "rows"), ("delta", delta, "rows"))
        outs = Operands().add("dq", tokens, spec["tokens"])
        (dq,) = step.launch(_dq_kernel, "ringjax_bwd_dq", (tl.num_q, tl.batch, tl.heads), ins, outs, config, bwd=True)

    # dK, dV (and dQ when fused): grid over key blocks and KV heads, walking query blocks of the G query heads
    blocks = [("q", q, "tokens"), ("k", k, "keys"), ("v", v, "values"), ("do", dout, "tokens_v"),
              ("lse", lse2, "rows"), ("delta", delta, "rows")]
    if fused:  # dQ accumulates atomically into these zeros, aliased to the dq output
        blocks.append(("dq_zeros", jnp.zeros(*tokens), "tokens"))
    ins, spec = step.by_key_block(*blocks)
    k_grads, v_grads = (((tl.batch, tl.kv_len, tl.kv_heads, d), jnp.float32) for d in (tl.head_dim, tl.v_head_dim))
    outs = Operands().add("dk", k_grads, spec["keys"]).add("dv", v_grads, spec["values"])
    if fused:
        outs.add("dq", tokens, spec["tokens"])
    grid = (tl.num_kv, tl.batch, tl.kv_heads)
    name = "ringjax_bwd_dkv_dq" if fused else "ringjax_bwd_dkv"
    aliases = {ins.index("dq_zeros"): outs.index("dq")} if fused else None
    dk, dv, *fused_dq = step.launch(_dkv_kernel, name, grid, ins, outs, config, bwd=True, aliases=aliases)
    return (fused_dq[0] if fused else dq), dk, dv

"""The blockwise ring step in plain jnp: flash-style attention with float32 statistics.

Queries and keys are cut into blocks of `block_q` x `block_kv`; only one block of
scores is live at a time, so memory is O(local_seq * block), and block pairs the
mask hides entirely are skipped with `lax.cond`. It is the XLA backend's step, and the backward a
kernel backend may run after its own forward (`pallas_triton`'s `bwd_xla`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from ringjax import _compat
from ringjax.core.dense import Tile, tile_grads
from ringjax.core.masks import BlockRange, Extras, TokenInfo, may_skip, maybe_visible
from ringjax.core.modifiers import logits
from ringjax.core.precision import DEFAULT, dot_precision
from ringjax.core.tiles import Tiling, block_ranges, pick_block
from ringjax.merge import exp_below, finish, finite_or_zero
from ringjax.options import AttentionOptions

DEFAULT_BLOCK = 512  # the side every platform but GPUs takes
GPU_SCORES = 1 << 27  # float32 scores of one block pair on a GPU (512 MiB): 32 heads of 2048 x 2048


class Blocks(NamedTuple):
    """Block sizes of the step (any object with these two fields will do, e.g. `XlaConfig`)."""

    block_q: int
    block_kv: int


def gpu_blocks(batch: int, heads: int) -> Blocks:
    """The step's blocks on a GPU: square, the largest power of two up to 2048 whose float32 scores of all
    `batch` rows and `heads` query heads stay within GPU_SCORES, and never below DEFAULT_BLOCK.

    Each block pair is a few kernel launches, so on a GPU larger blocks win until the scores crowd memory:
    8K causal on one H200 (jax 0.11.2, 2026-12-03) ran float32 fwd+bwd at 38.1 TFLOP/s with 512 x 512 blocks,
    57.0 with 1024 and 60.8 with 2048 (26.8 against 21.6 at "highest"); bf16 23.0 ms at 1024 against 35.8-48.6.
    """
    side = 2048
    while side > DEFAULT_BLOCK and batch * heads * side * side > GPU_SCORES:
        side //= 2
    return Blocks(side, side)


def _blocks(info: TokenInfo, n: int, size: int):
    """Positions [n, size], segment ids and offsets [n, B, size] (or None), per-block ranges."""

    def split(x):
        return None if x is None else jnp.moveaxis(x.reshape(x.shape[0], n, size), 1, 0)

    return info.pos.reshape(n, size), split(info.seg), split(info.segpos), block_ranges(info, size)


def _may_see(opts: AttentionOptions, q_rng: BlockRange, k_rng: BlockRange, i, j):
    """Whether query block i may see key block j in some batch row (bool scalar)."""

    def at(r: BlockRange, n) -> BlockRange:
        return BlockRange(*(None if x is None else x[..., n] for x in r))

    return maybe_visible(opts, at(q_rng, i), at(k_rng, j)).any()


def _split_q(x, nq, bq, kv_heads):
    """[B, T, H, D] -> [nq, B, KVH, G, bq, D]."""
    b, _, h, d = x.shape
    return x.reshape(b, nq, bq, kv_heads, h // kv_heads, d).transpose(1, 0, 3, 4, 2, 5)


def _merge_q(x):
    """[nq, B, KVH, G, bq, D] -> [B, T, H, D]."""
    nq, b, kvh, g, bq, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kvh * g, d)


def _split_rows(x, nq, bq, kv_heads):
    """[B, H, T] -> [nq, B, KVH, G, bq]."""
    b, h, _ = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, nq, bq).transpose(3, 0, 1, 2, 4)


def _split_kv(x, nk, bk):
    """[B, S, KVH, D] -> [nk, B, KVH, bk, D]."""
    b, _, kvh, d = x.shape
    return x.reshape(b, nk, bk, kvh, d).transpose(1, 0, 3, 2, 4)


def _merge_kv(x):
    nk, b, kvh, bk, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, kvh, d)


def _at(x, i):
    return None if x is None else x[i]


def _tiling(q, k, v, opts: AttentionOptions, config: Blocks):
    """(batch, heads, kv_heads, groups, block_q, block_kv, n_q_blocks, n_kv_blocks); any divisor is a legal block."""
    tl = Tiling.of(q, k, v, pick_block(q.shape[1], config.block_q, opts),
                   pick_block(k.shape[1], config.block_kv, opts))
    return tl.batch, tl.heads, tl.kv_heads, tl.groups, tl.block_q, tl.block_kv, tl.num_q, tl.num_kv


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, extras: Extras, opts: AttentionOptions, config: Blocks,
              *, precision: str = DEFAULT):
    """(out f32 [B, T, H, v's head_dim], lse f32) of one step; float32 tiles multiply at `precision`
    (`core.precision`)."""
    b, h, kvh, g, bq, bk, nq, nk = _tiling(q, k, v, opts, config)
    t = q.shape[1]
    prec = dot_precision(q.dtype, precision)
    qb = _split_q(q, nq, bq, kvh)
    kb, vb = _split_kv(k, nk, bk), _split_kv(v, nk, bk)
    qpos, qseg, qsegpos, qrng = _blocks(q_info, nq, bq)
    kpos, kseg, ksegpos, krng = _blocks(k_info, nk, bk)
    skip = may_skip(opts)

    def q_block(i):
        qi = qb[i]
        init = (
            _compat.match_vma(jnp.full(qi.shape[:-1], -jnp.inf, jnp.float32), q, k),
            _compat.match_vma(jnp.zeros(qi.shape[:-1], jnp.float32), q, k),
            _compat.match_vma(jnp.zeros(qi.shape[:-1] + v.shape[-1:], jnp.float32), q, k),
        )

        def kv_block(j, carry):
            def compute(carry):
                m, denom, acc = carry
                tile = Tile(opts, extras, TokenInfo(qpos[i], _at(qseg, i), _at(qsegpos, i)),
                            TokenInfo(kpos[j], _at(kseg, j), _at(ksegpos, j)), kvh, g)
                qk = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kb[j], preferred_element_type=jnp.float32, precision=prec)
                s = tile.logits(logits(qk, opts))
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = finite_or_zero(m_new)
                p = exp_below(s, m_safe[..., None])  # exactly 0 where masked
                alpha = jnp.exp(m - m_safe)
                denom = alpha * denom + p.sum(axis=-1)
                pv = jnp.einsum("bhgqk,bhkd->bhgqd", tile.dropped(p, b).astype(v.dtype), vb[j],
                                preferred_element_type=jnp.float32, precision=prec)
                return m_new, denom, alpha[..., None] * acc + pv

            if not skip:
                return compute(carry)
            return lax.cond(_may_see(opts, qrng, krng, i, j), compute, lambda c: c, carry)

        m, denom, acc = lax.fori_loop(0, nk, kv_block, init)
        return finish(acc, m, denom)

    out, lse = lax.map(q_block, jnp.arange(nq))
    # lse [nq, B, KVH, G, bq] -> [B, H, T]
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, h, t)
    return _merge_q(out), lse


def block_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, extras: Extras,
              opts: AttentionOptions, config: Blocks, *, precision: str = DEFAULT):
    """(dq, dk, dv, d alibi_slopes or None), float32."""
    b, h, kvh, g, bq, bk, nq, nk = _tiling(q, k, v, opts, config)
    prec = dot_precision(q.dtype, precision)
    qb, dob = _split_q(q, nq, bq, kvh), _split_q(dout, nq, bq, kvh)
    lseb, deltab = _split_rows(finite_or_zero(lse), nq, bq, kvh), _split_rows(delta, nq, bq, kvh)
    kb, vb = _split_kv(k, nk, bk), _split_kv(v, nk, bk)
    qpos, qseg, qsegpos, qrng = _blocks(q_info, nq, bq)
    kpos, kseg, ksegpos, krng = _blocks(k_info, nk, bk)
    skip = may_skip(opts)
    refs = (q, k, dout)
    alibi = extras.alibi_slopes is not None

    def kv_block(carry, j):
        kj, vj = kb[j], vb[j]

        def q_block(i, carry):
            def compute(carry):
                dq_acc, dslopes, dk, dv = carry
                tile = Tile(opts, extras, TokenInfo(qpos[i], _at(qseg, i), _at(qsegpos, i)),
                            TokenInfo(kpos[j], _at(kseg, j), _at(ksegpos, j)), kvh, g)
                dq_i, dk_i, dv_i, ds_logit = tile_grads(qb[i], dob[i], kj, vj, lseb[i], deltab[i], tile, opts, b,
                                                        prec)
                if alibi:
                    dslopes = dslopes + (ds_logit * tile.dist).sum(axis=(0, 3, 4))
                return dq_acc.at[i].add(dq_i), dslopes, dk + dk_i, dv + dv_i

            if not skip:
                return compute(carry)
            return lax.cond(_may_see(opts, qrng, krng, i, j), compute, lambda c: c, carry)

        dq_acc, dslopes = carry
        zeros_k, zeros_v = (_compat.match_vma(jnp.zeros(x.shape, jnp.float32), *refs) for x in (kj, vj))
        dq_acc, dslopes, dk, dv = lax.fori_loop(0, nq, q_block, (dq_acc, dslopes, zeros_k, zeros_v))
        return (dq_acc, dslopes), (dk, dv)

    dq0 = _compat.match_vma(jnp.zeros(qb.shape, jnp.float32), *refs)
    ds0 = _compat.match_vma(jnp.zeros((kvh, g), jnp.float32), *refs)
    (dq_acc, dslopes), (dk, dv) = lax.scan(kv_block, (dq0, ds0), jnp.arange(nk))
    return _merge_q(dq_acc), _merge_kv(dk), _merge_kv(dv), dslopes.reshape(h) if alibi else None

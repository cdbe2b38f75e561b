"""One ring step in plain XLA: flash-style blockwise attention with float32 statistics.

Queries and keys are cut into blocks of `block_q` x `block_kv`; only one block of
scores is live at a time, so memory is O(local_seq * block), and block pairs the
mask hides entirely are skipped with `lax.cond`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ringjax import _compat
from ringjax.backends.xla.config import XlaCacheConfig, XlaConfig
from ringjax.core.dense import Tile, tile_grads
from ringjax.core.masks import BlockRange, Extras, TokenInfo, may_skip, maybe_visible, visible_pairs
from ringjax.core.modifiers import (
    alibi_distance_pairs,
    logits,
)
from ringjax.core.precision import DEFAULT, dot_precision
from ringjax.core.schedule import reach
from ringjax.core.tiles import Tiling, block_ranges, pick_block
from ringjax.merge import exp_below, finish, finite_or_zero
from ringjax.options import AttentionOptions


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


def _tiling(q, k, v, opts: AttentionOptions, config: XlaConfig):
    """(batch, heads, kv_heads, groups, block_q, block_kv, n_q_blocks, n_kv_blocks); any divisor is a legal block."""
    tl = Tiling.of(q, k, v, pick_block(q.shape[1], config.block_q, opts),
                   pick_block(k.shape[1], config.block_kv, opts))
    return tl.batch, tl.heads, tl.kv_heads, tl.groups, tl.block_q, tl.block_kv, tl.num_q, tl.num_kv


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, extras: Extras, opts: AttentionOptions, config: XlaConfig,
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
              opts: AttentionOptions, config: XlaConfig, *, precision: str = DEFAULT):
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


# ---------------------------------------------------------------------------- cache_attention partials


def _key_ranges(opts: AttentionOptions, q_pos, k_pos, k_len):
    """Slot ranges [lo, hi) of ascending `k_pos` that the queries at `q_pos` may see: the mask's reach, and
    the sink tokens' slots below it. Everything outside them is masked, so it is never read."""
    last = k_len.max() - 1  # the last real key of any row
    span = reach(opts)
    if opts.causal:
        last = jnp.minimum(last, q_pos.max())
    if span is not None:
        last = jnp.minimum(last, q_pos.max() + span[1])
    first = q_pos.min() - span[0] if span is not None else jnp.int32(0)
    lo = jnp.searchsorted(k_pos, first, side="left").astype(jnp.int32)
    hi = jnp.searchsorted(k_pos, last, side="right").astype(jnp.int32)
    ranges = [(lo, hi)]
    if opts.num_sink_tokens and span is not None:
        sink_hi = jnp.searchsorted(k_pos, jnp.minimum(opts.num_sink_tokens - 1, last), side="right")
        ranges.insert(0, (jnp.int32(0), jnp.minimum(sink_hi.astype(jnp.int32), lo)))
    return ranges


def _cache_block(q, k, v, q_pos, k_pos, k_len, opts: AttentionOptions, extras: Extras, config: XlaCacheConfig,
                 prec):
    """One block of queries q [B, t, H, D] against the cache: (out [B, KVH, G, t, Dv], lse [B, KVH, G, t])."""
    b, t, h, _ = q.shape
    slots, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // kvh
    chunk = min(config.block_kv, slots)
    # slots read per loop step: a whole number of chunks whose scores fit max_scores
    step = max(1, min(config.max_scores // max(1, b * h * t * chunk), slots // chunk)) * chunk
    nc = step // chunk
    qg = q.reshape(b, t, kvh, g, -1).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, t, D]
    qp = q_pos[:, None, None, None, :, None]  # [B, 1, 1, 1, t, 1] against keys [1, nc, 1, 1, 1, chunk]
    k_len6 = k_len[:, None, None, None, None, None]
    slopes = None
    if extras.alibi_slopes is not None:
        slopes = extras.alibi_slopes.astype(jnp.float32).reshape(1, 1, kvh, g, 1, 1)
    refs = (q, k, v, q_pos, k_pos, k_len)

    def visit(carry, lo, hi):
        def body(state):
            j, m, denom, acc = state
            # the last step may start early to stay inside the stripe; slots before j*step were read already
            start = jnp.minimum(j * step, slots - step)

            def take(x, axis=1):
                # one step covering the stripe reads it whole: no slice for XLA to copy
                return x if step == slots else lax.dynamic_slice_in_dim(x, start, step, axis=axis)

            kc = take(k).reshape(b, nc, chunk, kvh, -1)
            vc = take(v).reshape(b, nc, chunk, kvh, dv)
            slot = (start + jnp.arange(step, dtype=jnp.int32)).reshape(1, nc, 1, 1, 1, chunk)
            kp = take(k_pos, axis=0).reshape(1, nc, 1, 1, 1, chunk)
            if config.dots:
                qk = jnp.einsum("bhgqd,bnchd->bnhgqc", qg, kc, preferred_element_type=jnp.float32, precision=prec)
            else:  # [B, 1, KVH, G, t, 1, D] * [B, nc, KVH, 1, 1, chunk, D], summed over D
                k7 = jnp.moveaxis(kc, 3, 2)[:, :, :, None, None].astype(jnp.float32)
                qk = (qg[:, None, :, :, :, None].astype(jnp.float32) * k7).sum(-1)
            s = logits(qk, opts)
            if slopes is not None:
                s = s + slopes * alibi_distance_pairs(qp, kp)
            # without segments a token's offset in its segment is its position (sink tokens, chunks)
            vis = visible_pairs(opts, qp, kp, q_segpos=qp, k_segpos=kp)
            vis = vis & (kp < k_len6) & (slot >= jnp.maximum(j * step, lo)) & (slot < hi)
            s = jnp.where(vis, s, -jnp.inf)
            # split-K: every chunk's max, sum and P V at once, then merged by their max
            m_c = s.max(axis=-1)
            p = exp_below(s, finite_or_zero(m_c)[..., None])  # exactly 0 where masked
            if config.dots:
                pv = jnp.einsum("bnhgqc,bnchd->bnhgqd", p.astype(v.dtype), vc, preferred_element_type=jnp.float32,
                                precision=prec)
            else:  # [B, nc, KVH, G, t, chunk, 1] * [B, nc, KVH, 1, 1, chunk, Dv], summed over the chunk
                v7 = jnp.moveaxis(vc, 3, 2)[:, :, :, None, None].astype(jnp.float32)
                pv = (p.astype(v.dtype).astype(jnp.float32)[..., None] * v7).sum(-2)
            m_new = jnp.maximum(m, m_c.max(axis=1))
            m_safe = finite_or_zero(m_new)
            alpha = jnp.exp(m - m_safe)
            w = jnp.exp(m_c - m_safe[:, None])  # [B, nc, KVH, G, t]
            denom = alpha * denom + (w * p.sum(axis=-1)).sum(axis=1)
            acc = alpha[..., None] * acc + (w[..., None] * pv).sum(axis=1)
            return j + 1, m_new, denom, acc

        end = (hi + step - 1) // step
        state = (lo // step, *carry)
        return lax.while_loop(lambda state: state[0] < end, body, state)[1:]

    carry = (
        _compat.match_vma(jnp.full((b, kvh, g, t), -jnp.inf, jnp.float32), *refs),
        _compat.match_vma(jnp.zeros((b, kvh, g, t), jnp.float32), *refs),
        _compat.match_vma(jnp.zeros((b, kvh, g, t, dv), jnp.float32), *refs),
    )
    for lo, hi in _key_ranges(opts, q_pos, k_pos, k_len):
        carry = visit(carry, lo, hi)
    m, denom, acc = carry
    return finish(acc, m, denom)


def cache_partials(q, k, v, q_pos, k_pos, k_len, opts: AttentionOptions, *, extras: Extras | None = None,
                   config: XlaCacheConfig | None = None, precision: str = DEFAULT):
    """Queries against one device's slots of a KV cache: (out f32 [B, t, H, Dv], lse f32 [B, t, H]).

    q [B, t, H, D]; k [B, S, KVH, D], v [B, S, KVH, Dv]; q_pos [B, t] int32 global positions of the queries;
    k_pos [S] int32 ascending global positions of the slots; k_len [B] int32: a slot is a real key of row b
    iff k_pos < k_len[b], and then `opts`' mask rules decide. Rows that see no key give out 0, lse -inf.
    Only the slots the mask can reach are read (a loop with traced bounds), in steps split into chunks
    computed in parallel (split-K) and merged by their max.
    """
    extras = Extras() if extras is None else extras
    config = XlaCacheConfig() if config is None else config
    prec = dot_precision(q.dtype, precision)
    b, t, h, _ = q.shape
    bq = min(config.block_q, t)
    nq = -(-t // bq)
    if nq * bq != t:  # padded queries repeat the last position (no wider key range) and are dropped
        q = jnp.pad(q, ((0, 0), (0, nq * bq - t), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, nq * bq - t)), mode="edge")
    if nq == 1:
        out, lse = _cache_block(q, k, v, q_pos, k_pos, k_len, opts, extras, config, prec)
        out, lse = out[None], lse[None]
    else:
        qs = q.reshape(b, nq, bq, h, -1).swapaxes(0, 1)
        ps = q_pos.reshape(b, nq, bq).swapaxes(0, 1)
        out, lse = lax.map(lambda a: _cache_block(a[0], k, v, a[1], k_pos, k_len, opts, extras, config, prec),
                           (qs, ps))
    # [nq, B, KVH, G, bq, (Dv)] -> [B, t, H, (Dv)]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, h, -1)[:, :t]
    lse = lse.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, h)[:, :t]
    return out, lse

"""The XLA backend's kernels: the blockwise ring step of `core.blockwise` (shared with kernel backends
that run its backward), and `cache_attention`'s split-K partials.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ringjax import _compat
from ringjax.backends.xla.config import XlaCacheConfig
from ringjax.core.blockwise import block_bwd, block_fwd
from ringjax.core.masks import Extras, visible_pairs
from ringjax.core.modifiers import (
    alibi_distance_pairs,
    logits,
)
from ringjax.core.precision import DEFAULT, dot_precision
from ringjax.core.schedule import reach
from ringjax.merge import exp_below, finish, finite_or_zero
from ringjax.options import AttentionOptions

__all__ = ["block_bwd", "block_fwd", "cache_partials"]

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

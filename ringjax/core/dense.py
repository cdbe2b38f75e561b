"""Attention on whole jnp tiles: the mask, ALiBi bias and dropout of a (queries, keys) tile and its gradients.

The XLA backend's blockwise step is built from these; tile kernels hand them the few keys they would
walk badly (`few_keys_grads`).
"""

from __future__ import annotations

import jax.numpy as jnp

from ringjax.core.masks import Extras, TokenInfo, visible
from ringjax.core.modifiers import alibi_distance, dropout_batch_head, dropout_keep, logits_and_slope
from ringjax.core.precision import DEFAULT, dot_precision
from ringjax.merge import exp_below, finite_or_zero
from ringjax.options import AttentionOptions


class Tile:
    """Mask, bias and dropout of one (query block, key block) pair, shaped [B|1, KVH, G, bq, bk]."""

    def __init__(self, opts, extras: Extras, qb_info, kb_info, kv_heads, groups):
        qp, kp = qb_info.pos, kb_info.pos
        self.vis = visible(opts, qb_info, kb_info)[:, None, None]
        self.bias = self.dist = None
        if extras.alibi_slopes is not None:
            self.dist = alibi_distance(qp, kp)
            slopes = extras.alibi_slopes.astype(jnp.float32).reshape(kv_heads, groups)[None, :, :, None, None]
            self.bias = slopes * self.dist
        self.rate = opts.dropout_rate
        if self.rate:
            self.heads = jnp.arange(kv_heads * groups, dtype=jnp.int32).reshape(1, kv_heads, groups, 1, 1)
            self.seed, self.head_slice, self.qp, self.kp = extras.dropout_seed, extras.head_slice, qp, kp

    def logits(self, s):
        s = s if self.bias is None else s + self.bias
        return jnp.where(self.vis, s, -jnp.inf)

    def dropped(self, x, batch: int):
        """x * keep / (1 - rate), applied to P (and to dP in backward)."""
        if not self.rate:
            return x
        b = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1, 1)
        batch_head = dropout_batch_head(self.head_slice, b, self.heads, self.heads.size)
        keep = dropout_keep(self.seed, self.rate, batch_head, self.qp, self.kp)
        return jnp.where(keep, x * (1.0 / (1.0 - self.rate)), 0.0)


def tile_grads(qi, doi, kj, vj, lse_i, delta_i, tile: Tile, opts: AttentionOptions, batch: int, prec):
    """(dq, dk, dv, d logits) of one tile, float32: queries and dO [B, KVH, G, bq, D], keys and values
    [B, KVH, bk, D], the rows' final lse (finite) and delta [B, KVH, G, bq]. The logits' gradient is what
    ALiBi's slope gradient sums."""
    f32 = jnp.float32
    qk = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=f32, precision=prec)
    s, slope = logits_and_slope(qk, opts)
    p = exp_below(tile.logits(s), lse_i[..., None])  # 0 where masked
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", tile.dropped(p, batch).astype(doi.dtype), doi, preferred_element_type=f32,
                    precision=prec)
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=f32, precision=prec)
    # d out / d logit = P * (keep/(1-rate) * dP - delta): dropout enters through dP only
    ds_logit = p * (tile.dropped(dp, batch) - delta_i[..., None])
    ds = ds_logit * slope
    dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(kj.dtype), kj, preferred_element_type=f32, precision=prec)
    dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(qi.dtype), qi, preferred_element_type=f32, precision=prec)
    return dq, dk, dv, ds_logit


def few_keys_grads(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, extras: Extras,
                   opts: AttentionOptions):
    """dK and dV (float32, k's and v's shapes) of a few keys against every query, as one dense tile: no loop
    and no conditional. For kernels that walk queries per key tile, where a key every query sees would walk
    all of them alone."""
    b, t, h, _ = q.shape
    kvh = k.shape[2]

    def rows(x):  # [B, T, H, D] -> [B, KVH, G, T, D]
        return x.reshape(b, t, kvh, h // kvh, x.shape[3]).transpose(0, 2, 3, 1, 4)

    def keys(x):  # [B, S, KVH, D] <-> [B, KVH, S, D]
        return x.transpose(0, 2, 1, 3)

    def stats(x):  # [B, H, T] -> [B, KVH, G, T]
        return x.reshape(b, kvh, h // kvh, t)

    tile = Tile(opts, extras, q_info, k_info, kvh, h // kvh)
    _, dk, dv, _ = tile_grads(rows(q), rows(dout), keys(k), keys(v), stats(finite_or_zero(lse)), stats(delta), tile,
                              opts, b, dot_precision(q.dtype, DEFAULT))
    return keys(dk), keys(dv)

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


# largest (local query heads) x (keys) for which `few_keys_grads` multiplies block-diagonal matrices: their
# products cost 2 T (H S) (H D) FLOPs against the T H D bytes of a Q or dO read, so at H S FLOPs a byte, below the
# ~300 of a Hopper GPU's ridge, they stay bound by the one read of each
BLOCK_DIAGONAL_MAX = 256


def few_keys_grads(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, extras: Extras,
                   opts: AttentionOptions, block_diagonal: bool | None = None, with_dq: bool = False):
    """dK and dV (float32, k's and v's shapes) of a few keys against every query, as one dense tile: no loop
    and no conditional. For kernels that walk queries per key tile, where a key every query sees would walk
    all of them alone. `with_dq`: (dq, dk, dv), dq the queries' share from these keys (float32, q's shape), for a
    kernel that adds dQ from the same walk.

    Q and dO are read in their own [B, T, H, D] layout, as [T, H D] matrices: the S keys of every head are one
    block-diagonal [H D, H S] matrix, so the logits, dP, dK and dV are four plain matrix products whose batch is
    B alone, and dK, dV the diagonal blocks of theirs. Grouped by KV head instead ([B, KVH, G, T, D]), XLA
    copied Q and dO to that layout first: 0.81 ms against 0.45 at 32K tokens, 32 heads, one H100. Where
    H S exceeds `BLOCK_DIAGONAL_MAX` (or `block_diagonal=False`) the products waste more than they save, and
    the grouped layout runs."""
    b, t, h, _ = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    f32, prec = jnp.float32, dot_precision(q.dtype, DEFAULT)
    tile = Tile(opts, extras, q_info, k_info, kvh, g)
    lse, delta = (x.reshape(b, kvh, g, t) for x in (finite_or_zero(lse), delta))  # [B, H, T] -> [B, KVH, G, T]
    if not (h * s <= BLOCK_DIAGONAL_MAX if block_diagonal is None else block_diagonal):
        def rows(x):  # [B, T, H, D] -> [B, KVH, G, T, D]
            return x.reshape(b, t, kvh, g, x.shape[3]).transpose(0, 2, 3, 1, 4)

        def keys(x):  # [B, S, KVH, D] <-> [B, KVH, S, D]
            return x.transpose(0, 2, 1, 3)

        dq, dk, dv, _ = tile_grads(rows(q), rows(dout), keys(k), keys(v), lse, delta, tile, opts, b, prec)
        dk, dv = keys(dk), keys(dv)
        return (dq.transpose(0, 3, 1, 2, 4).reshape(q.shape), dk, dv) if with_dq else (dk, dv)

    def flat(x):  # [B, T, H, D] -> [B, T, H D]: a reshape, no copy
        return x.reshape(b, t, -1)

    def block_diag(y):  # keys y [B, S, KVH, D] -> [B, H D, H S], head i's keys in diagonal block i
        y = jnp.repeat(y, g, axis=2)  # [B, S, H, D]
        return jnp.einsum("bshd,hi->bhdis", y, jnp.eye(h, dtype=y.dtype)).reshape(b, -1, h * s)

    def scores(x, y):  # [B, KVH, G, T, S]: x [B, T, H, D] against keys y [B, S, KVH, D]
        out = jnp.einsum("btx,bxy->bty", flat(x), block_diag(y), preferred_element_type=f32, precision=prec)
        return out.reshape(b, t, kvh, g, s).transpose(0, 2, 3, 1, 4)

    def per_query(w, y):  # w [B, KVH, G, T, S] times keys y [B, S, KVH, D], summed over keys: [B, T, H, D]
        w = w.transpose(0, 3, 1, 2, 4).reshape(b, t, h * s)
        out = jnp.einsum("bty,bxy->btx", w, block_diag(y), preferred_element_type=f32, precision=prec)
        return out.reshape(b, t, h, y.shape[3])

    def per_key(w, x):  # sum over queries and groups of w [B, KVH, G, T, S] times x [B, T, H, D]: [B, S, KVH, D]
        w = w.transpose(0, 3, 1, 2, 4).reshape(b, t, h * s)
        full = jnp.einsum("btx,bty->bxy", w, flat(x), preferred_element_type=f32, precision=prec)
        blocks = jnp.diagonal(full.reshape(b, h, s, h, x.shape[3]), axis1=1, axis2=3)  # [B, S, D, H]
        return blocks.reshape(b, s, x.shape[3], kvh, g).sum(-1).transpose(0, 1, 3, 2)

    logits, slope = logits_and_slope(scores(q, k), opts)
    p = exp_below(tile.logits(logits), lse[..., None])  # 0 where masked
    ds = p * (tile.dropped(scores(dout, v), b) - delta[..., None]) * slope
    dk, dv = per_key(ds.astype(q.dtype), q), per_key(tile.dropped(p, b).astype(dout.dtype), dout)
    return (per_query(ds.astype(k.dtype), k), dk, dv) if with_dq else (dk, dv)

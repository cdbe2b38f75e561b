"""The one dense float64 reference every implementation is checked against.

Global arrays in natural token order; position of token t is t. Written
independently of ringjax's code: no shared mask or merge helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def document_offsets(segment_ids):
    """int [B, T]: each token's offset within its run of equal ids."""
    seg = np.asarray(segment_ids)
    offset = np.zeros(seg.shape, int)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            offset[b, t] = offset[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
    return offset


def mask_reference(seq, *, causal=False, window=None, segment_ids=None, chunk_size=None, num_sink_tokens=0):
    """bool [B or 1, T, T]: may query i see key j."""
    i = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    m = np.ones((seq, seq), bool)
    if causal:
        m &= j <= i
    if window is not None:
        left, right = (window, window) if np.isscalar(window) else window
        if causal:
            right = 0
        m &= (j >= i - left) & (j <= i + right)
    m = m[None]
    same = np.ones((1, seq, seq), bool)
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        same = (seg[:, :, None] == seg[:, None, :]) & (seg >= 0)[:, :, None]
    m = m & same
    offset = document_offsets(np.zeros((1, seq), int) if segment_ids is None else segment_ids)
    if chunk_size is not None:  # chunks restart at every document
        chunk = offset // chunk_size
        m = m & (chunk[:, :, None] == chunk[:, None, :])
    if num_sink_tokens:
        sink = (offset < num_sink_tokens)[:, None, :] & same
        if causal:
            sink &= (j <= i)[None]
        m = m | sink
    return m


def _fmix32(x, last: bool = True):
    """murmur3's finaliser; `last=False` leaves out its final xor-shift (the per-pair mix of the dropout hash)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16)) if last else x


def dropout_keep_reference(seed, rate, batch, heads, seq):
    """bool [B, H, T, T]: the documented counter-based hash of (seed, b*H+h, i, j)."""
    with np.errstate(over="ignore"):
        seed = np.asarray(seed, np.uint32)
        i = np.arange(seq, dtype=np.uint32)[:, None]
        j = np.arange(seq, dtype=np.uint32)[None, :]
        bh = np.arange(batch * heads, dtype=np.uint32).reshape(batch, heads, 1, 1)
        key = _fmix32(_fmix32(bh * np.uint32(0xC2B2AE3D) + seed[0]) ^ seed[1])
        x = _fmix32((i * np.uint32(0x9E3779B1)) ^ (j * np.uint32(0x85EBCA77) + key), last=False)
    return x >= np.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))


def _attention64(q, k, v, sinks, slopes, *, mask, scale, soft_cap, keep=None, rate=0.0, counts=None):
    b, t, h, d = q.shape
    g = h // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    if slopes is not None:
        dist = np.abs(np.arange(t)[:, None] - np.arange(t)[None, :])
        s = s - slopes[None, :, None, None] * dist
    mask = jnp.asarray(mask)[:, None]  # [B|1, 1, T, T]
    weight = 1.0
    if counts is not None:  # [B|1, H|1, T, T]: key j enters row i's softmax counts[i, j] times
        counts = jnp.asarray(counts, jnp.float64)
        mask = mask & (counts > 0)
        weight = counts
    mx = jax.lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
    if sinks is not None:
        mx = jnp.maximum(mx, jax.lax.stop_gradient(sinks)[None, :, None])
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.where(mask, jnp.exp(s - mx[..., None]) * weight, 0.0)
    total = e.sum(-1)
    if sinks is not None:
        total = total + jnp.exp(sinks[None, :, None] - mx)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, jnp.log(safe) + mx, -jnp.inf)
    p = e / safe[..., None]
    if keep is not None:
        p = jnp.where(keep, p / (1.0 - rate), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def attention_reference(
    q, k, v, *, causal=False, window=None, segment_ids=None, softmax_scale=None, logits_soft_cap=None,
    sinks=None, chunk_size=None, num_sink_tokens=0, alibi_slopes=None, dropout_rate=0.0, dropout_seed=None,
    dout=None, dlse=None, counts=None,
):
    """Float64 (out, lse) and, given cotangents, gradients (dq, dk, dv, dsinks, dalibi).

    `counts` (optional, [B or 1, H or 1, T, T], bool or non-negative numbers) is a
    per-head multiplicity on top of the other masks: key j enters query i's softmax
    counts[..., i, j] times (0: not at all), as when partial results that share keys
    are merged through their lse.

    The loss whose gradient is returned is sum(out * dout) + sum(lse * dlse) over
    rows with finite lse.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / np.sqrt(q.shape[-1])
    mask = mask_reference(q.shape[1], causal=causal, window=window, segment_ids=segment_ids,
                          chunk_size=chunk_size, num_sink_tokens=num_sink_tokens)
    keep = None
    if dropout_rate:
        keep = dropout_keep_reference(dropout_seed, dropout_rate, q.shape[0], q.shape[2], q.shape[1])
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        extra = [None if x is None else jnp.asarray(np.asarray(x, np.float64)) for x in (sinks, alibi_slopes)]

        def f(q, k, v, s, a):
            return _attention64(q, k, v, s, a, mask=mask, scale=scale, soft_cap=logits_soft_cap, keep=keep,
                                rate=dropout_rate, counts=counts)

        out, lse = f(*args, *extra)
        result = {"out": np.asarray(out), "lse": np.asarray(lse)}
        if dout is not None:
            do64 = jnp.asarray(np.asarray(dout, np.float64))
            dl64 = jnp.asarray(np.asarray(dlse, np.float64)) if dlse is not None else jnp.zeros(lse.shape)

            def loss(q, k, v, s, a):
                o, l = f(q, k, v, s, a)
                return (o * do64).sum() + jnp.where(jnp.isfinite(l), l * dl64, 0.0).sum()

            names = ["dq", "dk", "dv", "dsinks", "dalibi"]
            argnums = [i for i, x in enumerate([*args, *extra]) if x is not None]
            grads = jax.grad(loss, argnums=tuple(argnums))(*args, *extra)
            result.update({names[i]: np.asarray(g) for i, g in zip(argnums, grads)})
            if extra[0] is not None:
                # d loss / d sink[h] = -sum over (batch, query) of p_sink * (dout . out - dlse): a sum whose terms
                # may cancel, so its error is judged against the sum of their magnitudes
                p_sink = jnp.exp(extra[0][None, :, None] - lse)
                delta = jnp.swapaxes((do64 * out).sum(-1), 1, 2) - dl64
                result["dsinks_terms"] = np.asarray(jnp.abs(p_sink * delta).sum(axis=(0, 2)))
        return result

"""The one dense float64 reference every implementation is checked against.

Global arrays in natural token order; position of token t is t. Written
independently of ringjax's code: no shared mask or merge helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mask_reference(seq, *, causal=False, window=None, segment_ids=None):
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
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        m = m & (seg[:, :, None] == seg[:, None, :]) & (seg >= 0)[:, :, None]
    return m


def _attention64(q, k, v, sinks, *, mask, scale, soft_cap):
    b, t, h, d = q.shape
    g = h // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = jnp.asarray(mask)[:, None]  # [B|1, 1, T, T]
    mx = jax.lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
    if sinks is not None:
        mx = jnp.maximum(mx, jax.lax.stop_gradient(sinks)[None, :, None])
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.where(mask, jnp.exp(s - mx[..., None]), 0.0)
    total = e.sum(-1)
    if sinks is not None:
        total = total + jnp.exp(sinks[None, :, None] - mx)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, jnp.log(safe) + mx, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", e / safe[..., None], v)
    return out, lse


def attention_reference(
    q, k, v, *, causal=False, window=None, segment_ids=None, softmax_scale=None, logits_soft_cap=None,
    sinks=None, dout=None, dlse=None,
):
    """Float64 (out, lse) and, given cotangents, gradients (dq, dk, dv, dsinks).

    The loss whose gradient is returned is sum(out * dout) + sum(lse * dlse) over
    rows with finite lse.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / np.sqrt(q.shape[-1])
    mask = mask_reference(q.shape[1], causal=causal, window=window, segment_ids=segment_ids)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        s64 = None if sinks is None else jnp.asarray(np.asarray(sinks, np.float64))

        def f(q, k, v, s):
            return _attention64(q, k, v, s, mask=mask, scale=scale, soft_cap=logits_soft_cap)

        out, lse = f(*args, s64)
        result = {"out": np.asarray(out), "lse": np.asarray(lse)}
        if dout is not None:
            do64 = jnp.asarray(np.asarray(dout, np.float64))
            dl64 = jnp.asarray(np.asarray(dlse, np.float64)) if dlse is not None else jnp.zeros(lse.shape)

            def loss(q, k, v, s):
                o, l = f(q, k, v, s)
                return (o * do64).sum() + jnp.where(jnp.isfinite(l), l * dl64, 0.0).sum()

            grads = jax.grad(loss, argnums=(0, 1, 2) if sinks is None else (0, 1, 2, 3))(*args, s64)
            result.update(dq=np.asarray(grads[0]), dk=np.asarray(grads[1]), dv=np.asarray(grads[2]))
            if sinks is not None:
                result["dsinks"] = np.asarray(grads[3])
        return result

"""Combining partial attention results through their log-sum-exp.

Attention over keys A ∪ B equals the weighted sum of the results over A and over B,
with weights exp(lse_A - lse) and exp(lse_B - lse), lse = logaddexp(lse_A, lse_B).
Rows that see no key carry lse = -inf and out = 0; merging keeps them exactly so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float

from ringjax.options import described

_LOG2E = 1.0 / math.log(2.0)


def finite_or_zero(lse):
    """lse with -inf (rows that see no key) replaced by 0, so that lse - lse is 0 rather than NaN.

    Such rows have every score masked: whatever they are shifted by, their probabilities stay 0.
    """
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


def exp_below(s, shift):
    """exp(s - shift) for a shift at or above every s (a running max, an lse), never above exp(0).

    The min keeps p <= 1, and it stands between the logits' product and the subtraction: XLA fused them
    into one FMA, whose unrounded product differs from the rounded one that gave the max (by up to 128 at
    logits near 1e9), so that exp overflowed to inf, then NaN, or the max's own term underflowed to 0.
    """
    return jnp.exp(jnp.minimum(s, shift) - shift)


def log_sum(m, total, *, base2: bool = False):
    """lse = m + log(total) of a sum of exp(x - m) (exp2 with `base2`); -inf where total = 0 (no key)."""
    seen = total > 0.0
    safe = jnp.where(seen, total, 1.0)
    lse = (m + jnp.log2(safe)) / _LOG2E if base2 else m + jnp.log(safe)
    return jnp.where(seen, lse, -jnp.inf)


def finish(acc, m, denom, *, base2: bool = False):
    """Normalised output acc / denom and natural-log lse of an online softmax (running max m).

    `denom` has acc's shape without head_dim, or with it as 1. Rows with denom 0 saw no key: out 0, lse -inf.
    """
    safe = jnp.where(denom > 0.0, denom, 1.0)
    out = acc / (safe if safe.ndim == acc.ndim else safe[..., None])
    return out, log_sum(m, denom, base2=base2)


def add_sinks(out, lse, sinks):
    """Let exp(sinks[h]) join every row's denominator: a key of value 0 seen by every query.

    out [B, T, H, D], lse [B, H, T] float32, sinks [H]; rows that saw no key stay 0.
    """
    sink = sinks.astype(jnp.float32)[None, :, None]
    # not jnp.logaddexp: its derivatives are NaN where lse and the sink are both -inf (a row that saw no key, a
    # head without a sink), and 0 times NaN stays NaN in the gradients
    m = finite_or_zero(jnp.maximum(lse, sink))
    new_lse = log_sum(m, jnp.exp(lse - m) + jnp.exp(sink - m))
    scale = jnp.exp(lse - finite_or_zero(new_lse))  # 0 for rows that saw no key
    return out * jnp.swapaxes(scale, 1, 2)[..., None], new_lse


def sink_probability(sinks, lse):
    """exp(sinks[h] - lse) [B, H, T]: the sink's share of each row's softmax (lse with the sinks, from
    `add_sinks`); 0 where a sink of -inf meets a row that saw no key (lse -inf), where the difference is NaN."""
    return jnp.exp(sinks.astype(jnp.float32)[None, :, None] - finite_or_zero(lse))


def merge_attention(
    out_a: Float[Array, "batch seq heads head_dim"],
    lse_a: Float[Array, "batch heads seq"],
    out_b: Float[Array, "batch seq heads head_dim"],
    lse_b: Float[Array, "batch heads seq"],
) -> tuple[Float[Array, "batch seq heads head_dim"], Float[Array, "batch heads seq"]]:
    """Merge two normalised partial results; computes in float32, returns out_a's dtype."""
    return merge_attention_many([out_a, out_b], [lse_a, lse_b])


def merge_attention_many(
    outs: Sequence[Float[Array, "batch seq heads head_dim"]],
    lses: Sequence[Float[Array, "batch heads seq"]],
) -> tuple[Float[Array, "batch seq heads head_dim"], Float[Array, "batch heads seq"]]:
    """Merge any number of partial results (the list form of `merge_attention`)."""
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(f"outs and lses must be lists (or tuples) of arrays, got {type(outs).__name__} and "
                        f"{type(lses).__name__}")
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"need equally many outs and lses (at least one), got {len(outs)} and {len(lses)}")
    for i, (o, lse_i) in enumerate(zip(outs, lses)):
        for name, x in (("out", o), ("lse", lse_i)):
            dtype = getattr(x, "dtype", None)
            if dtype is None or not hasattr(x, "shape") or not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"part {i}: {name} must be a floating-point array, got {described(x)}")
        if o.ndim != 4 or lse_i.shape != (o.shape[0], o.shape[2], o.shape[1]):
            raise ValueError(
                f"part {i}: out must be [batch, seq, heads, head_dim] and lse [batch, heads, seq], "
                f"got {o.shape} and {lse_i.shape}"
            )
        if o.shape != outs[0].shape:  # any head_dim (v's), but one for every part
            raise ValueError(f"part {i}: out must have part 0's shape {outs[0].shape}, got {o.shape}")
    lses32 = [lse_i.astype(jnp.float32) for lse_i in lses]
    m = lses32[0]
    for lse_i in lses32[1:]:
        m = jnp.maximum(m, lse_i)
    m_safe = finite_or_zero(m)
    lse = log_sum(m_safe, sum(jnp.exp(lse_i - m_safe) for lse_i in lses32))
    lse_safe = finite_or_zero(lse)
    # weights exp(lse_i - lse) [B, H, T]; 0 where lse_i = -inf
    parts = [o.astype(jnp.float32) * jnp.swapaxes(jnp.exp(lse_i - lse_safe), 1, 2)[..., None]
             for o, lse_i in zip(outs, lses32)]
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out.astype(outs[0].dtype), lse

"""Combining partial attention results through their log-sum-exp.

Attention over keys A ∪ B equals the weighted sum of the results over A and over B,
with weights exp(lse_A - lse) and exp(lse_B - lse), lse = logaddexp(lse_A, lse_B).
Rows that see no key carry lse = -inf and out = 0; merging keeps them exactly so.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float


def _safe(x):
    # -inf - -inf is NaN; rows with no key at all keep weight 0 instead
    return jnp.where(jnp.isfinite(x), x, 0.0)


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
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"need equally many outs and lses (at least one), got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        if o.ndim != 4 or l.shape != (o.shape[0], o.shape[2], o.shape[1]):
            raise ValueError(
                f"part {i}: out must be [batch, seq, heads, head_dim] and lse [batch, heads, seq], "
                f"got {o.shape} and {l.shape}"
            )
    lses32 = [l.astype(jnp.float32) for l in lses]
    m = lses32[0]
    for l in lses32[1:]:
        m = jnp.maximum(m, l)
    m_safe = _safe(m)
    total = sum(jnp.exp(l - m_safe) for l in lses32)
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    lse_safe = _safe(lse)
    out = 0.0
    for o, l in zip(outs, lses32):
        w = jnp.exp(l - lse_safe)  # [B, H, T]; 0 where l = -inf
        out = out + o.astype(jnp.float32) * jnp.swapaxes(w, 1, 2)[..., None]
    return out.astype(outs[0].dtype), lse

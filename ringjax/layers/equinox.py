"""Equinox attention layer backed by `ringjax.ring_attention` (needs `pip install ringjax[equinox]`).

Computes the same function as `ringjax.flax.MultiHeadAttention`: q/k/v projections
with grouped-query heads, rotary embeddings at global token positions, ring
attention over `axis_name`, output projection. Unlike most Equinox layers it takes
a batch, x [batch, seq, features] (the ring op is batched; no vmap needed).
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ringjax.layers import core
from ringjax.layers.core import AttentionLayerConfig
from ringjax.options import check_float_dtype

__all__ = ["AttentionLayerConfig", "MultiHeadAttention"]


class MultiHeadAttention(eqx.Module):
    """Equinox multi-head (GQA) attention over a sequence sharded on mesh axis `axis_name`.

    Takes the fields of `AttentionLayerConfig` as arguments (in_features, num_heads, then by
    keyword num_kv_heads, causal, axis_name, layout, ...), or one as `config=`.
    Fields: q_proj [in, heads, head_dim], k_proj [in, kv_heads, head_dim], v_proj [in, kv_heads,
    v_head_dim], o_proj [heads, v_head_dim, out], sinks [heads] or None (a learnable logit per head
    that joins every softmax denominator, present with use_sinks=True).
    """

    q_proj: Array
    k_proj: Array
    v_proj: Array
    o_proj: Array
    sinks: Array | None
    config: AttentionLayerConfig = eqx.field(static=True)
    dtype: jnp.dtype | None = eqx.field(static=True)

    def __init__(self, in_features: int | None = None, num_heads: int | None = None, *,
                 config: AttentionLayerConfig | None = None, dtype=None, param_dtype=jnp.float32, key: PRNGKeyArray,
                 **options):
        self.config = core.layer_config(config, in_features, num_heads, options)
        # checked now: a dtype is otherwise first used, and refused under q's name, at the first call
        self.dtype = check_float_dtype("dtype", dtype, optional=True)
        params = core.init_params(self.config, key, param_dtype)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (params[n] for n in core.PROJECTIONS)
        self.sinks = params.get("sinks")

    __call__ = core.layer_call

    def config_and_params(self, x) -> tuple[AttentionLayerConfig, dict]:
        params = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.o_proj}
        if self.sinks is not None:
            params["sinks"] = self.sinks
        return self.config, params

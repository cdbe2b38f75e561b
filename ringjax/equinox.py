"""Equinox attention layer backed by `ringjax.ring_attention` (needs `pip install ringjax[equinox]`).

Computes the same function as `ringjax.flax.MultiHeadAttention`: q/k/v projections
with grouped-query heads, rotary embeddings at global token positions, ring
attention over `axis_name`, output projection. Unlike most Equinox layers it takes
a batch, x [batch, seq, features] (the ring op is batched; no vmap needed).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ringjax import _attention_layer as core

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(eqx.Module):
    """Equinox multi-head (GQA) attention over a sequence sharded on mesh axis `axis_name`.

    Fields: q_proj [in, heads, head_dim], k_proj / v_proj [in, kv_heads, head_dim],
    o_proj [heads, head_dim, out], sinks [heads] or None (a learnable logit per head
    that joins every softmax denominator, present with use_sinks=True).
    """

    q_proj: Array
    k_proj: Array
    v_proj: Array
    o_proj: Array
    sinks: Array | None
    config: core.AttentionLayerConfig = eqx.field(static=True)
    dtype: jnp.dtype | None = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        out_features: int | None = None,
        causal: bool = False,
        sliding_window: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        softmax_scale: float | None = None,
        use_sinks: bool = False,
        rope_base: float | None = 10000.0,
        axis_name: str | tuple[str, str] | None = "sp",
        layout: str = "contiguous",
        implementation: str = "auto",
        strategy: str = "ring",
        dtype=None,
        param_dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        self.config = core.AttentionLayerConfig(
            in_features=in_features,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            out_features=out_features,
            causal=causal,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            softmax_scale=softmax_scale,
            use_sinks=use_sinks,
            rope_base=rope_base,
            axis_name=axis_name,
            layout=layout,
            implementation=implementation,
            strategy=strategy,
        )
        self.dtype = dtype
        shapes = self.config.param_shapes()
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = core.init_param("q", kq, shapes["q"], param_dtype)
        self.k_proj = core.init_param("k", kk, shapes["k"], param_dtype)
        self.v_proj = core.init_param("v", kv, shapes["v"], param_dtype)
        self.o_proj = core.init_param("o", ko, shapes["o"], param_dtype)
        self.sinks = core.init_param("sinks", None, shapes["sinks"], param_dtype) if use_sinks else None

    def __call__(
        self,
        x: Float[Array, "batch seq features"],
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "batch seq out_features"]:
        params = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.o_proj}
        if self.sinks is not None:
            params["sinks"] = self.sinks
        return core.forward(self.config, params, x, segment_ids=segment_ids, positions=positions, dtype=self.dtype)

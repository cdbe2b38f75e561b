"""Flax attention layers backed by `ringjax.ring_attention` (needs `pip install ringjax[flax]`).

- `MultiHeadAttention`: Flax NNX.
- `LinenMultiHeadAttention`: Flax Linen.

Both take x [batch, seq, features] and compute the same function as
`ringjax.equinox.MultiHeadAttention`: q/k/v projections with grouped-query heads,
rotary embeddings at global token positions, ring attention over `axis_name`,
output projection. Inside `jax.shard_map` x is the local shard (in `layout`
order); with axis_name=None the sequence is unsharded and in natural order.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jaxtyping import Array, Float, Int

from ringjax import _attention_layer as core

__all__ = ["LinenMultiHeadAttention", "MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Flax NNX multi-head (GQA) attention over a sequence sharded on mesh axis `axis_name`.

    Parameters: q_proj [in, heads, head_dim], k_proj / v_proj [in, kv_heads, head_dim],
    o_proj [heads, head_dim, out] and, with use_sinks, sinks [heads] (a learnable
    logit per head that joins every softmax denominator).
    """

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
        rngs: nnx.Rngs,
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
        self.q_proj = nnx.Param(core.init_param("q", rngs.params(), shapes["q"], param_dtype))
        self.k_proj = nnx.Param(core.init_param("k", rngs.params(), shapes["k"], param_dtype))
        self.v_proj = nnx.Param(core.init_param("v", rngs.params(), shapes["v"], param_dtype))
        self.o_proj = nnx.Param(core.init_param("o", rngs.params(), shapes["o"], param_dtype))
        self.sinks = nnx.Param(core.init_param("sinks", None, shapes["sinks"], param_dtype)) if use_sinks else None

    def __call__(
        self,
        x: Float[Array, "batch seq features"],
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "batch seq out_features"]:
        params = {"q": self.q_proj[...], "k": self.k_proj[...], "v": self.v_proj[...], "o": self.o_proj[...]}
        if self.sinks is not None:
            params["sinks"] = self.sinks[...]
        return core.forward(self.config, params, x, segment_ids=segment_ids, positions=positions, dtype=self.dtype)


class LinenMultiHeadAttention(nn.Module):
    """Flax Linen multi-head (GQA) attention over a sequence sharded on mesh axis `axis_name`.

    `in_features` is taken from the input. Parameters (in the "params" collection):
    q_proj, k_proj, v_proj, o_proj and, with use_sinks, sinks; shapes as in
    `MultiHeadAttention`.
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    causal: bool = False
    sliding_window: int | tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    softmax_scale: float | None = None
    use_sinks: bool = False
    rope_base: float | None = 10000.0
    axis_name: str | tuple[str, str] | None = "sp"
    layout: str = "contiguous"
    implementation: str = "auto"
    strategy: str = "ring"
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def layer_config(self, in_features: int) -> core.AttentionLayerConfig:
        return core.AttentionLayerConfig(
            in_features=in_features,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            out_features=self.out_features,
            causal=self.causal,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            softmax_scale=self.softmax_scale,
            use_sinks=self.use_sinks,
            rope_base=self.rope_base,
            axis_name=self.axis_name,
            layout=self.layout,
            implementation=self.implementation,
            strategy=self.strategy,
        )

    @nn.compact
    def __call__(
        self,
        x: Float[Array, "batch seq features"],
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "batch seq out_features"]:
        if not hasattr(x, "ndim") or x.ndim != 3:
            raise ValueError(f"x must have shape [batch, seq, features], got {getattr(x, 'shape', None)}")
        cfg = self.layer_config(x.shape[-1])
        params = {}
        for name, shape in cfg.param_shapes().items():
            init = functools.partial(core.init_param, name)
            params[name] = self.param(name if name == "sinks" else f"{name}_proj", init, shape, self.param_dtype)
        return core.forward(cfg, params, x, segment_ids=segment_ids, positions=positions, dtype=self.dtype)


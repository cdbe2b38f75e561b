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

from ringjax.layers import core
from ringjax.layers.core import AttentionLayerConfig
from ringjax.options import check_float_dtype

__all__ = ["AttentionLayerConfig", "LinenMultiHeadAttention", "MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Flax NNX multi-head (GQA) attention over a sequence sharded on mesh axis `axis_name`.

    Takes the fields of `AttentionLayerConfig` as arguments (in_features, num_heads, then by
    keyword num_kv_heads, causal, axis_name, layout, ...), or one as `config=`.
    Parameters: q_proj [in, heads, head_dim], k_proj [in, kv_heads, head_dim], v_proj [in, kv_heads,
    v_head_dim], o_proj [heads, v_head_dim, out] and, with use_sinks, sinks [heads] (a learnable
    logit per head that joins every softmax denominator).
    """

    def __init__(self, in_features: int | None = None, num_heads: int | None = None, *,
                 config: AttentionLayerConfig | None = None, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 **options):
        self.config = core.layer_config(config, in_features, num_heads, options)
        # checked now: a dtype is otherwise first used, and refused under q's name, at the first call
        self.dtype = check_float_dtype("dtype", dtype, optional=True)
        params = core.init_params(self.config, rngs.params, param_dtype)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nnx.Param(params[n]) for n in core.PROJECTIONS)
        self.sinks = nnx.Param(params["sinks"]) if "sinks" in params else None

    __call__ = core.layer_call

    def config_and_params(self, x) -> tuple[AttentionLayerConfig, dict]:
        params = {"q": self.q_proj[...], "k": self.k_proj[...], "v": self.v_proj[...], "o": self.o_proj[...]}
        if self.sinks is not None:
            params["sinks"] = self.sinks[...]
        return self.config, params


class LinenMultiHeadAttention(nn.Module):
    """Flax Linen multi-head (GQA) attention over a sequence sharded on mesh axis `axis_name`.

    Its attributes are the fields of `AttentionLayerConfig` but `in_features`, which is taken
    from the input (Linen builds a module and its `clone` from declared attributes, so they are
    listed here; a test checks they match the config). Parameters (in the "params" collection):
    q_proj, k_proj, v_proj, o_proj and, with use_sinks, sinks; shapes as in `MultiHeadAttention`.
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
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
    # gradients bitwise-identical run to run, or "invariant": on any ring size (not dropout's: there is none)
    deterministic: bool | str = False
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def layer_config(self, in_features: int) -> AttentionLayerConfig:
        fields = {name: getattr(self, name) for name in core.LAYER_FIELDS}
        return AttentionLayerConfig(in_features=in_features, **fields)

    __call__ = core.layer_call

    @nn.compact
    def config_and_params(self, x) -> tuple[AttentionLayerConfig, dict]:
        """The config for x's features and the parameters, created on first use."""
        if not hasattr(x, "ndim") or x.ndim != 3:
            raise ValueError(f"x must have shape [batch, seq, features], got {getattr(x, 'shape', None)}")
        cfg = self.layer_config(x.shape[-1])
        check_float_dtype("dtype", self.dtype, optional=True)
        check_float_dtype("param_dtype", self.param_dtype)
        params = {}
        for name, shape in cfg.param_shapes().items():
            init = functools.partial(core.init_param, name)
            params[name] = self.param(name if name == "sinks" else f"{name}_proj", init, shape, self.param_dtype)
        return cfg, params


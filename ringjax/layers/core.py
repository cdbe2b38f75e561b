"""Framework-free core of the ringjax attention layers (Flax NNX, Flax Linen, Equinox).

Each framework module only owns the parameters; the config, the parameter shapes and
initialisers, and the forward pass live here, so the three layers compute the same
function and differ only in how they store weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ringjax.api import ring_attention
from ringjax.dispatch import registry
from ringjax.inference import KVCache, cache_attention
from ringjax.layers.rotary import apply_rotary, token_positions
from ringjax.options import (
    KEYWORDS_BY_NAME,
    _static_number,
    check_float_dtype,
    check_key,
    described,
    make_options,
    option_inputs,
)
from ringjax.strategies.spread import check_strategy


@dataclasses.dataclass(frozen=True)
class AttentionLayerConfig:
    """Static description of a multi-head (GQA) attention layer.

    Shapes: x [batch, seq, in_features] -> [batch, seq, out_features], with
    `num_heads` query heads sharing `num_kv_heads` key/value heads; values may have a head_dim of
    their own (`v_head_dim`, as multi-head latent attention's), which the output projection takes
    (num_heads * v_head_dim inputs). The fields named as
    `ring_attention` keywords (causal, sliding_window, ...) are those keywords, with the same
    defaults (tests/test_options.py), and are checked by the same declaration. `deterministic` is
    `ring_attention`'s: bitwise-identical gradients run to run, not dropout's switch (the layers have
    no dropout).
    """

    in_features: int
    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads (plain multi-head)
    head_dim: int | None = None  # None: in_features // num_heads
    v_head_dim: int | None = None  # None: head_dim
    out_features: int | None = None  # None: in_features
    causal: bool = False
    sliding_window: int | tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    softmax_scale: float | None = None
    use_sinks: bool = False
    rope_base: float | None = 10000.0  # None: no rotary embeddings
    axis_name: str | tuple[str, str] | None = "sp"  # a (head_axis, ring_axis) pair with strategy="hybrid"
    layout: str = "contiguous"
    implementation: str = "auto"
    strategy: str = "ring"  # see ringjax.ring_attention
    deterministic: bool | str = False  # see ringjax.ring_attention (True or "invariant")

    def __post_init__(self):
        for name in ("in_features", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_kv_heads", "head_dim", "v_head_dim", "out_features"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})")
        if self.head_dim is None and self.in_features % self.num_heads:
            raise ValueError(
                f"in_features ({self.in_features}) is not divisible by num_heads ({self.num_heads}); pass head_dim"
            )
        if not isinstance(self.use_sinks, bool):
            raise TypeError(f"use_sinks must be a bool, got {type(self.use_sinks).__name__}")
        # the ring_attention keywords among the fields are checked as ring_attention checks them
        make_options(self.dim, axis_name=None, axis_size=1, has_sinks=self.use_sinks,
                     **option_inputs(self.ring_keywords()))
        if self.rope_base is not None:
            if not (_static_number(self.rope_base, "rope_base", float) > 0):
                raise ValueError(f"rope_base must be positive or None, got {self.rope_base!r}")
            if self.dim % 2:
                raise ValueError(f"rotary embeddings need an even head_dim, got {self.dim}")
        if self.axis_name is not None and not isinstance(self.axis_name, (str, tuple)):
            raise TypeError(f"axis_name must be a str, a (head_axis, ring_axis) tuple or None, got "
                            f"{type(self.axis_name).__name__}")
        check_strategy(self.strategy, self.axis_name)
        if not isinstance(self.implementation, str):
            raise TypeError(f"implementation must be a str, got {type(self.implementation).__name__}")
        registry.check_name("ring_attention", self.implementation)

    def ring_keywords(self) -> dict[str, Any]:
        """The fields that are `ring_attention` keywords, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in KEYWORDS_BY_NAME}

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim(self) -> int:
        return self.in_features // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def v_dim(self) -> int:
        """v's head_dim (the output projection's per-head width)."""
        return self.dim if self.v_head_dim is None else self.v_head_dim

    @property
    def features_out(self) -> int:
        return self.in_features if self.out_features is None else self.out_features

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {
            "q": (self.in_features, self.num_heads, self.dim),
            "k": (self.in_features, self.kv_heads, self.dim),
            "v": (self.in_features, self.kv_heads, self.v_dim),
            "o": (self.num_heads, self.v_dim, self.features_out),
        }
        if self.use_sinks:
            shapes["sinks"] = (self.num_heads,)
        return shapes


# the config's fields but in_features, which Linen reads from the input
LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionLayerConfig) if f.name != "in_features")


def layer_config(config: AttentionLayerConfig | None, in_features: int | None, num_heads: int | None,
                 options: dict) -> AttentionLayerConfig:
    """A layer's config: `config` as given, or one built from the layer's arguments (in_features,
    num_heads and the other AttentionLayerConfig fields by name in `options`); not both."""
    if config is None:
        return AttentionLayerConfig(in_features=in_features, num_heads=num_heads, **options)
    if not isinstance(config, AttentionLayerConfig):
        raise TypeError(f"config must be an AttentionLayerConfig, got {type(config).__name__}")
    if in_features is not None or num_heads is not None or options:
        raise TypeError("pass either config= or the layer's options (in_features, num_heads, ...), not both")
    return config


def fan_in(name: str, shape: tuple[int, ...]) -> int:
    """Inputs summed into one output of parameter `name` (its contracted axes)."""
    return shape[0] if name in ("q", "k", "v") else shape[0] * shape[1]


def init_param(name: str, key, shape: tuple[int, ...], dtype) -> jax.Array:
    """LeCun-normal projections (unit-variance outputs); sinks start at 0 (logit of exp(0)=1)."""
    if name == "sinks":
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in(name, shape))).astype(dtype)


PROJECTIONS = ("q", "k", "v", "o")


def init_params(cfg: AttentionLayerConfig, key, param_dtype=jnp.float32) -> dict[str, jax.Array]:
    """Initial parameters by name: the q, k, v, o projections and, with use_sinks, sinks.

    `key` is a PRNG key, split once per projection, or a function giving a fresh key per
    projection (an `nnx.Rngs` stream).
    """
    if not callable(key):
        check_key(key, "key")
    check_float_dtype("param_dtype", param_dtype)
    keys = [key() for _ in PROJECTIONS] if callable(key) else jax.random.split(key, len(PROJECTIONS))
    shapes = cfg.param_shapes()
    params = {name: init_param(name, k, shapes[name], param_dtype) for name, k in zip(PROJECTIONS, keys)}
    if cfg.use_sinks:
        params["sinks"] = init_param("sinks", None, shapes["sinks"], param_dtype)
    return params


def forward(cfg: AttentionLayerConfig, params, x, *, segment_ids=None, positions=None, dtype=None, cache=None,
            counts=None):
    """x [batch, seq, in_features] -> [batch, seq, out_features].

    Rotary embeddings use `positions` if given ([seq] or [batch, seq] global token
    positions), else the true positions of x's rows for cfg.axis_name / cfg.layout.
    `dtype` is the computation dtype (None: promote x and the parameters).

    With a `cache` (a `ringjax.KVCache`), x holds the next tokens of each row (a prompt, a chunk of
    one, or one token): their keys and values are appended (`counts`: per-row counts of a ragged
    append) and they attend to everything the cache holds with `cache_attention`, rotary embeddings
    at their global positions (each row's length onwards); returns (y, the new cache).
    """
    if not hasattr(x, "ndim") or x.ndim != 3:
        raise ValueError(f"x must have shape [batch, seq, features], got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[-1] != cfg.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects in_features={cfg.in_features}")
    if counts is not None and cache is None:
        raise ValueError("counts (per-row token counts of a ragged append) applies only with a cache; got no cache")
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a ringjax.KVCache, got {type(cache).__name__}")
        if segment_ids is not None:
            raise ValueError("segment_ids does not apply with a cache: each row of the cache is one sequence")
        want = (x.shape[0], cfg.kv_heads, cfg.dim, cfg.v_dim)
        held = (cache.k.shape[0], cache.k.shape[2], cache.k.shape[3], cache.v.shape[3])
        if held != want:
            raise ValueError(f"cache must hold (batch, kv_heads, head_dim, v_head_dim) = {want} for this layer and "
                             f"x, got {held}")
    if dtype is None:
        dtype = jnp.result_type(x.dtype, params["q"].dtype)
    x = x.astype(dtype)
    q = jnp.einsum("btf,fhd->bthd", x, params["q"].astype(dtype))
    k = jnp.einsum("btf,fhd->bthd", x, params["k"].astype(dtype))
    v = jnp.einsum("btf,fhd->bthd", x, params["v"].astype(dtype))
    if cache is not None:
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
    if cfg.rope_base is not None:
        seq = x.shape[1]
        if positions is None:
            positions = token_positions(seq, axis_name=cfg.axis_name, layout=cfg.layout)
        elif not hasattr(positions, "shape") or not jnp.issubdtype(getattr(positions, "dtype", object), jnp.number):
            # fractional positions are allowed: position interpolation scales them
            raise TypeError(f"positions must be an array of shape [seq] or [batch, seq], got {described(positions)}")
        elif positions.shape not in ((seq,), (x.shape[0], seq)):
            raise ValueError(f"positions must have shape [seq] or [batch, seq] = {(x.shape[0], seq)}, got "
                             f"{positions.shape}")
        q = apply_rotary(q, positions, base=cfg.rope_base)
        k = apply_rotary(k, positions, base=cfg.rope_base)
    elif positions is not None:
        raise ValueError("positions is only used by rotary embeddings, which this layer has off (rope_base=None)")
    if cache is not None:
        cache = cache.append(k, v, counts)
        out = cache_attention(q.astype(cache.dtype), cache, counts=counts, sinks=params.get("sinks"),
                              causal=cfg.causal, sliding_window=cfg.sliding_window, softmax_scale=cfg.softmax_scale,
                              logits_soft_cap=cfg.logits_soft_cap).astype(dtype)
        return jnp.einsum("bthd,hdf->btf", out, params["o"].astype(dtype)), cache
    out = ring_attention(q, k, v, segment_ids=segment_ids, sinks=params.get("sinks"), **cfg.ring_keywords())
    return jnp.einsum("bthd,hdf->btf", out, params["o"].astype(dtype))


def layer_call(
    self,
    x: Float[Array, "batch seq features"],
    *,
    segment_ids: Int[Array, "batch seq"] | None = None,
    positions: Int[Array, "*batch seq"] | None = None,
    cache: KVCache | None = None,
    counts: Int[Array, " batch"] | None = None,
):
    """The layers' `__call__`: `forward` with the config and parameters (by name) from the layer's
    `config_and_params(x)` and its computation `dtype`. y [batch, seq, out_features]; with `cache`
    (decode mode), (y, the cache with x's keys and values appended)."""
    cfg, params = self.config_and_params(x)
    return forward(cfg, params, x, segment_ids=segment_ids, positions=positions, dtype=self.dtype, cache=cache,
                   counts=counts)

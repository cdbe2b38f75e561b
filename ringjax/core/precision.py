"""Matmul precision of float32 tiles: jax's setting, read once when a call is traced.

bfloat16 and float16 tiles multiply in their dtype (P cast to it) and float64 tiles in float64,
all accumulating in float32 or wider, whatever the setting. float32 tiles follow jax's
`jax_default_matmul_precision` (its config value or the `jax.default_matmul_precision(...)`
context), as jax's own float32 matmuls do: "default" and "high" use TF32 tensor cores on GPUs
that have them, "highest" computes full float32 products. The setting is read when
`ring_attention` is traced and kept on its `Problem`, so the forward, the backward and
autotuning (which traces in a worker thread, where a context manager does not reach) agree,
and a TF32 call never shares a compiled or tuned config with a full-float32 one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT, HIGH, HIGHEST = "default", "high", "highest"
# jax's other spellings of its three levels; any other accepted value is a lax.DotAlgorithmPreset name
_LEVELS = {None: DEFAULT, "default": DEFAULT, "bfloat16": DEFAULT, "high": HIGH, "tensorfloat32": HIGH,
           "highest": HIGHEST, "float32": HIGHEST}
# settings whose float32 products are exact float32 (no TF32 or bfloat16 rounding of the inputs)
FULL_FLOAT32 = frozenset({HIGHEST, "F32_F32_F32"})
# settings a GPU computes in one TF32 tensor-core pass (jax's own default on GPUs)
TF32 = frozenset({DEFAULT, HIGH, "TF32_TF32_F32"})
_PRECISION = {DEFAULT: lax.Precision.DEFAULT, HIGH: lax.Precision.HIGH, HIGHEST: lax.Precision.HIGHEST}


def canonical(setting: str | None) -> str:
    """One name per setting: "default", "high", "highest" or a `lax.DotAlgorithmPreset` name."""
    if setting in _LEVELS:
        return _LEVELS[setting]
    if isinstance(setting, str) and setting in lax.DotAlgorithmPreset.__members__:
        return setting
    raise ValueError(f"unknown matmul precision {setting!r}: use one of {sorted(k for k in _LEVELS if k)} or a "
                     "jax.lax.DotAlgorithmPreset name")


def current(dtype) -> str:
    """The precision a call on `dtype` inputs computes in, from jax's setting now (at trace time).

    "default" for every dtype but float32, whose tiles are the only ones the setting changes.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return DEFAULT
    # the config attribute reads the innermost `jax.default_matmul_precision` context of this thread (jax 0.10-0.12)
    return canonical(getattr(jax.config, "jax_default_matmul_precision"))


def dot_precision(dtype, precision: str):
    """`precision=` of a tile's `lax.dot_general` / `einsum` on inputs of `dtype` under `precision`.

    Explicit, never None: jax would otherwise read its setting again wherever the dot is traced.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return lax.Precision.DEFAULT
    if precision in _PRECISION:
        return _PRECISION[precision]
    return lax.DotAlgorithmPreset[precision]


def describe(precision: str) -> str:
    """What float32 products are computed in under `precision`, in words."""
    if precision in FULL_FLOAT32:
        return "full float32"
    if precision in TF32:
        return "TF32 on GPUs with tensor cores (float32 on CPUs)"
    return f"the {precision} dot algorithm"

"""Rotary position embeddings at global token positions, under any layout.

A sharded sequence row does not hold token `row`: inside `jax.shard_map` device r
holds the positions `local_positions(layout, r, ...)`, and a global array in a
layout order holds them permuted. `token_positions` returns the true position of
every row in each calling mode, so rotary embeddings (and anything else
position-dependent) agree with the unsharded model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from ringjax import _compat
from ringjax.layouts import local_positions, to_layout
from ringjax.options import LAYOUTS


def token_positions(seq_len: int, *, axis_name: str | None, layout: str = "contiguous") -> Int[Array, " seq"]:
    """Global positions (int32 [seq_len]) of the rows of a sequence of length `seq_len`.

    - axis_name None: an unsharded sequence in natural order, 0..seq_len-1.
    - axis_name bound (inside `jax.shard_map`): `seq_len` is the local length and the
      rows are this device's shard of `layout`.
    - otherwise: a global array in `layout` order (see `to_layout`) that will be
      sharded over `axis_name` of the mesh set by `jax.set_mesh`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if axis_name is None:
        return jnp.arange(seq_len, dtype=jnp.int32)
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)  # a pair: major first
    sizes = [_compat.axis_size_or_none(name) for name in names]
    if all(size is not None for size in sizes):
        return local_positions(layout, lax.axis_index(names), int(np.prod(sizes)), seq_len)
    mesh = _compat.context_mesh()
    if mesh is None or any(name not in mesh.axis_names for name in names):
        raise ValueError(
            f"axis_name {axis_name!r} is not bound: call inside jax.shard_map over a mesh with that axis, "
            "or on global arrays under jax.set_mesh(mesh), or pass axis_name=None for an unsharded sequence"
        )
    with jax.ensure_compile_time_eval():  # a constant permutation, even while tracing under jit
        size = int(np.prod([mesh.shape[name] for name in names]))
        order = to_layout(np.arange(seq_len, dtype=np.int32)[None], layout, size, axis=1)
    return jnp.asarray(order[0])


def apply_rotary(
    x: Float[Array, "batch seq heads head_dim"],
    positions: Int[Array, "*batch seq"],
    *,
    base: float = 10000.0,
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate feature pairs (i, i + head_dim/2) by angle position * base^(-2i/head_dim).

    `positions` is [seq] or [batch, seq]. Computed in float32, returned in x's dtype.
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    if not (isinstance(base, (int, float)) and base > 0):
        raise ValueError(f"rotary base must be a positive number, got {base!r}")
    half = head_dim // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)
    angle = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    if angle.ndim == 2:  # [seq, half]
        angle = angle[None]
    cos = jnp.cos(angle)[:, :, None, :]  # [batch|1, seq, 1, half]
    sin = jnp.sin(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

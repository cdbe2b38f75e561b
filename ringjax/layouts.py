"""Which global token positions each shard holds, and reordering global arrays to match.

- contiguous: shard i holds block i of N blocks.
- zigzag: shard i holds chunks i and 2N-1-i of 2N chunks (balances causal work).
- striped: shard i holds tokens i, i+N, i+2N, ... (balances causal work finely).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ringjax import _compat
from ringjax.options import LAYOUTS, chunks_per_shard, sequence_chunks


def _check(layout: str, axis_size: int, seq: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) or axis_size < 1:
        raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
    chunks = sequence_chunks(layout, axis_size)
    if seq % chunks:
        raise ValueError(f"sequence length {seq} must be divisible by {chunks} for layout {layout!r}")


def local_positions(layout: str, shard, axis_size: int, local_len: int, xp=jnp, subshards: int = 1):
    """Global positions [local_len] (int32) of the tokens held by `shard` (may be traced).

    `xp=numpy` gives a concrete array for a static shard index (usable inside jit).
    `subshards` > 1: the sequence is in axis_size * subshards layout shards and `shard`
    holds shards i * axis_size + shard for i < subshards, concatenated in that order.
    """
    if subshards > 1:
        part = local_len // subshards
        return xp.concatenate([local_positions(layout, i * axis_size + shard, axis_size * subshards, part, xp)
                               for i in range(subshards)])
    t = xp.arange(local_len, dtype=xp.int32)
    shard = xp.asarray(shard, xp.int32)
    if layout == "contiguous":
        return shard * local_len + t
    if layout == "striped":
        return t * axis_size + shard
    if layout == "zigzag":
        half = local_len // 2
        # first half is chunk `shard`, second half is chunk 2N-1-shard
        chunk = xp.where(t < half, shard, 2 * axis_size - 1 - shard)
        return (chunk * half + t % half).astype(xp.int32)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _permutation(layout: str, axis_size: int, seq: int) -> np.ndarray:
    """perm[i] = global position stored at index i of the reordered array."""
    local = seq // axis_size
    return np.concatenate(
        [local_positions(layout, s, axis_size, local, xp=np) for s in range(axis_size)]
    )


def _take(x, order: np.ndarray, axis: int):
    """x reordered along `axis` inside a trace, keeping an explicit sharding where x has one."""
    index = (slice(None),) * axis + (order,)
    spec = _compat.explicit_spec(x)
    if spec is not None:  # explicit axes: the gather needs its output sharding spelled out
        return x.at[index].get(out_sharding=spec)
    return x[index]


@functools.lru_cache(maxsize=64)
def _compiled_take(order: bytes, axis: int, sharding):
    index = np.frombuffer(order, np.int64)
    return jax.jit(lambda x: _take(x, index, axis), out_shardings=sharding)


def _reorder(x, order: np.ndarray, axis: int, out_sharding=None):
    if isinstance(x, jax.core.Tracer):
        y = _take(x, order, axis)
        return y if out_sharding is None else _compat.constrain(y, out_sharding)
    if not isinstance(x, jax.Array):  # numpy (or anything array-like) stays on the host
        return np.asarray(x)[(slice(None),) * axis + (order,)]
    if out_sharding is None and not _compat.is_committed(x):
        return x[(slice(None),) * axis + (order,)]  # uncommitted in, uncommitted out: jax may move it freely
    # a committed array keeps its placement, whatever kind of mesh (or device) it lives on
    sharding = out_sharding if out_sharding is not None else x.sharding
    fn = _compiled_take(order.astype(np.int64).tobytes(), axis, sharding)
    with _compat.explicit_mesh_context(getattr(x.sharding, "mesh", None)):
        return fn(x)


def _check_out_sharding(out_sharding) -> None:
    if out_sharding is not None and not isinstance(out_sharding, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
        raise TypeError(f"out_sharding must be None, a jax.sharding.Sharding or (under jax.set_mesh) a PartitionSpec, "
                        f"got {out_sharding!r}")
    if isinstance(out_sharding, jax.sharding.PartitionSpec) and _compat.context_mesh() is None:
        raise ValueError(f"out_sharding={out_sharding} names mesh axes but no mesh is set: call under "
                         "jax.set_mesh(mesh), or pass NamedSharding(mesh, spec)")


def _normalize_axis(x, axis: int) -> int:
    ndim = np.ndim(x)
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"axis must be an int in [-{ndim}, {ndim}) for an array of shape {np.shape(x)}, got {axis!r}")
    return int(axis) % ndim


def to_layout(x, layout: str, axis_size: int, axis: int = 1, *, out_sharding=None):
    """Reorder a global array so that contiguous sharding along `axis` gives `layout`.

    Works on numpy arrays (returns numpy), jax arrays on any mesh or device (the result
    keeps x's sharding) and tracers inside `jit` (explicit mesh axes are kept; with auto
    axes XLA places the result unless `out_sharding`, a `NamedSharding` or, under
    `jax.set_mesh`, a `PartitionSpec`, says where it goes).
    """
    axis = _normalize_axis(x, axis)
    _check(layout, axis_size, np.shape(x)[axis])
    _check_out_sharding(out_sharding)
    if layout == "contiguous":
        return x
    return _reorder(x, _permutation(layout, axis_size, np.shape(x)[axis]), axis, out_sharding)


def from_layout(x, layout: str, axis_size: int, axis: int = 1, *, out_sharding=None):
    """Inverse of `to_layout`: restore natural token order along `axis` (same input kinds)."""
    axis = _normalize_axis(x, axis)
    _check(layout, axis_size, np.shape(x)[axis])
    _check_out_sharding(out_sharding)
    if layout == "contiguous":
        return x
    return _reorder(x, np.argsort(_permutation(layout, axis_size, np.shape(x)[axis])), axis, out_sharding)


@functools.lru_cache(maxsize=64)
def sorted_shards(layout: str, axis_size: int, local_len: int, subshards: int) -> tuple[str, np.ndarray | None] | None:
    """What sorting by position leaves of each device's `local_len` tokens when every device holds
    `subshards` shards of `layout` (`local_positions`): (the layout whose shards of `axis_size` are then
    each device's tokens, the order that sorts them: stored index of each sorted token, None if already
    sorted), or None where no layout's shards are (the sorted tokens of a hybrid's ring device are
    layout shards only for striped, and for one ring device: the whole sequence).
    """
    pos = [local_positions(layout, r, axis_size, local_len, xp=np, subshards=subshards) for r in range(axis_size)]
    order = np.argsort(pos[0], kind="stable")
    target = "contiguous" if axis_size == 1 else layout  # one device: every layout holds the whole sequence
    if local_len % chunks_per_shard(target) or not all(
            np.array_equal(p[order], local_positions(target, r, axis_size, local_len, xp=np))
            for r, p in enumerate(pos)):
        return None
    if np.array_equal(order, np.arange(local_len)):
        return target, None
    order.setflags(write=False)  # cached: shared by every caller
    return target, order

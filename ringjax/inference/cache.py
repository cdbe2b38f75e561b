"""`KVCache`: keys and values of past tokens, sharded over a mesh axis in the striped layout.

Global position p of a row lives on device p % n of the axis, in its local slot p // n (the
`striped` layout of `ringjax.layouts`), so every append of t tokens writes about t / n slots on
each device and every read spreads over all devices; each device holds capacity / n slots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ringjax import _compat
from ringjax.dispatch import calling
from ringjax.dispatch.calling import ROWS, SEQ, Call
from ringjax.layouts import from_layout, local_positions
from ringjax.options import check_float_dtype, described

LAYOUT = "striped"


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def concrete(x) -> np.ndarray | None:
    """x as numpy when its value is known on the host (not traced), else None."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_counts(counts, batch: int, t: int, name: str = "counts"):
    """Raise unless `counts` is None or an int array [batch] with values in 0..t (checked when concrete)."""
    if counts is None:
        return
    if not hasattr(counts, "shape") or not hasattr(counts, "dtype") or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int array of shape [batch], got {getattr(counts, 'dtype', type(counts))}")
    if counts.shape != (batch,):
        raise ValueError(f"{name} must have shape [batch] = ({batch},), got {counts.shape}")
    values = concrete(counts)
    if values is not None and ((values < 0) | (values > t)).any():
        raise ValueError(f"{name} must lie in 0..{t} (the new tokens per row), got {values.tolist()}")


@jax.tree_util.register_pytree_node_class
class KVCache:
    """Per-row keys and values of past tokens, sharded over mesh axis `axis_name` (striped layout).

    Leaves: k [batch, slots, kv_heads, head_dim], v [batch, slots, kv_heads, v_head_dim] and lengths
    [batch] int32 (tokens held per row); static: capacity, axis_name, axis_size, mesh and the mesh axes
    batch is sharded over. Global position p of a row is on device p % axis_size, local slot
    p // axis_size; slots at or past a row's length hold nothing. As global arrays (outside
    `shard_map`) slots = capacity, device r's slots contiguous (`positions()` gives each slot's
    position); inside `shard_map` (in_specs `shard_specs()`) the leaves are the device's stripe,
    slots = capacity / axis_size. A pytree: it passes through `jax.jit`, `lax.scan` and `shard_map`.
    """

    def __init__(self, k, v, lengths, *, capacity: int, axis_name: str | None, axis_size: int, mesh=None,
                 batch_axes: tuple[str, ...] = ()):
        self.k, self.v, self.lengths = k, v, lengths
        self.capacity, self.axis_name, self.axis_size = capacity, axis_name, axis_size
        self.mesh, self.batch_axes = mesh, tuple(batch_axes)

    # ------------------------------------------------------------------ pytree

    def replace(self, **changes: Any) -> KVCache:
        """A copy with some leaves (k, v, lengths) or static fields replaced."""
        fields = dict(k=self.k, v=self.v, lengths=self.lengths, capacity=self.capacity, axis_name=self.axis_name,
                      axis_size=self.axis_size, mesh=self.mesh, batch_axes=self.batch_axes)
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise TypeError(f"KVCache has no field(s) {unknown}")
        fields.update(changes)
        return KVCache(**fields)

    def tree_flatten(self):
        return (self.k, self.v, self.lengths), (self.capacity, self.axis_name, self.axis_size, self.mesh,
                                                self.batch_axes)

    @classmethod
    def tree_unflatten(cls, aux, children):
        capacity, axis_name, axis_size, mesh, batch_axes = aux
        return cls(*children, capacity=capacity, axis_name=axis_name, axis_size=axis_size, mesh=mesh,
                   batch_axes=batch_axes)

    def __repr__(self):
        shape = getattr(self.k, "shape", None)
        return (f"KVCache(k={shape}, capacity={self.capacity}, axis_name={self.axis_name!r}, "
                f"axis_size={self.axis_size}, batch_axes={self.batch_axes})")

    # ------------------------------------------------------------------ creation

    @classmethod
    def create(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype=jnp.bfloat16, mesh=None,
               axis_name: str | None = "sp", v_head_dim: int | None = None) -> KVCache:
        """An empty cache of `capacity` tokens per row, sharded over `axis_name`.

        Inside `shard_map` over `axis_name` it holds this device's stripe; otherwise its buffers are
        global arrays sharded over `axis_name` of `mesh` (or the mesh set by `jax.set_mesh`), batch over
        the mesh's other axes where they divide it; with axis_name=None, or no mesh (none given, none set
        with that axis), it lives on one device. axis_name=None with `mesh=` raises ValueError, as in
        `ring_attention`. `capacity` must be a multiple of the axis size. A cache made inside shard_map that
        leaves it (out_specs `shard_specs()` of a cache made outside) is given the same `mesh=`, so that
        both have the same static fields.
        """
        batch, capacity = _positive_int(batch, "batch"), _positive_int(capacity, "capacity")
        kv_heads, head_dim = _positive_int(kv_heads, "kv_heads"), _positive_int(head_dim, "head_dim")
        v_head_dim = head_dim if v_head_dim is None else _positive_int(v_head_dim, "v_head_dim")
        if axis_name is not None and not isinstance(axis_name, str):
            raise TypeError(f"axis_name must be a str or None, got {type(axis_name).__name__}")
        calling.check_mesh(mesh)
        if axis_name is None and mesh is not None:
            # as in ring_attention: a mesh given to shard over but no axis of it named is ambiguous, not one device
            raise ValueError("mesh= needs axis_name: name the mesh axis the cache is sharded over, or leave mesh out "
                             "for a cache on one device")
        check_float_dtype("dtype", dtype)
        bound = None if axis_name is None else _compat.axis_size_or_none(axis_name)
        if mesh is None and bound is None and axis_name is not None:
            context = _compat.context_mesh()
            mesh = context if context is not None and axis_name in context.axis_names else None
        if mesh is not None and bound is None and axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})")
        n = bound if bound is not None else int(mesh.shape[axis_name]) if mesh is not None else 1
        if capacity % n:
            raise ValueError(f"capacity {capacity} must be a multiple of the size of axis {axis_name!r} ({n}): "
                             "every device holds capacity / axis size slots")
        k_shape, v_shape = (batch, capacity, kv_heads, head_dim), (batch, capacity, kv_heads, v_head_dim)
        meta = dict(capacity=capacity, axis_name=axis_name, axis_size=n)
        if bound is not None:  # inside shard_map: this device's stripe, varying over the axis like its appends
            k_shape, v_shape = (batch, capacity // n, kv_heads, head_dim), (batch, capacity // n, kv_heads, v_head_dim)
            k, v = (_compat.to_varying(jnp.zeros(s, dtype), axis_name) for s in (k_shape, v_shape))
            if mesh is not None and int(mesh.shape.get(axis_name, 0)) != n:
                raise ValueError(f"mesh axis {axis_name!r} does not match the enclosing shard_map's (size {n})")
            return cls(k, v, jnp.zeros((batch,), jnp.int32), mesh=mesh, **meta)
        if mesh is None:
            return cls(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype), jnp.zeros((batch,), jnp.int32),
                       **dict(meta, axis_size=1))
        rest = tuple(a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1)
        batch_axes = rest if rest and batch % int(np.prod([mesh.shape[a] for a in rest])) == 0 else ()
        cache = cls(None, None, None, mesh=mesh, batch_axes=batch_axes, **meta)
        specs = cache.shard_specs()
        leaves = [(k_shape, dtype, specs.k), (v_shape, dtype, specs.v), ((batch,), jnp.int32, specs.lengths)]
        cache.k, cache.v, cache.lengths = (_zeros(shape, dtype, mesh, spec) for shape, dtype, spec in leaves)
        return cache

    # ------------------------------------------------------------------ geometry

    @property
    def local_slots(self) -> int:
        """Slots per device: capacity / axis_size."""
        return self.capacity // self.axis_size

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def v_head_dim(self) -> int:
        return self.v.shape[3]

    @property
    def dtype(self):
        return self.k.dtype

    def shard_specs(self) -> KVCache:
        """The cache's PartitionSpecs as a KVCache (for `shard_map`'s in_specs / out_specs)."""
        b = None if not self.batch_axes else self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes
        return self.replace(k=P(b, self.axis_name), v=P(b, self.axis_name), lengths=P(b))

    def call(self) -> Call:
        """How this cache's operations run here: inside shard_map ("local"), on global arrays over a mesh
        ("global") or on one device ("single")."""
        bound = None if self.axis_name is None else _compat.axis_size_or_none(self.axis_name)
        if bound is not None:
            if bound != self.axis_size or self.k.shape[1] != self.local_slots:
                raise ValueError(f"the cache holds {self.k.shape[1]} slots of capacity {self.capacity} for axis "
                                 f"{self.axis_name!r} of size {self.axis_size}, but that axis has size {bound} here: "
                                 "pass it into shard_map with in_specs=cache.shard_specs()")
            return Call("local", self.axis_name, bound)
        mesh = self.mesh
        if mesh is None and self.axis_size > 1:  # made inside shard_map and returned from it: the context mesh
            context = _compat.context_mesh()
            mesh = context if context is not None and self.axis_name in context.axis_names else None
            if mesh is None or int(mesh.shape[self.axis_name]) != self.axis_size:
                raise ValueError(f"this cache is sharded over axis {self.axis_name!r} of size {self.axis_size} but "
                                 "no such mesh is known: use it inside shard_map, or under jax.set_mesh(mesh)")
        if mesh is None:
            return Call("single", None, 1)
        return Call("global", self.axis_name, self.axis_size, mesh, batch_axes=self.batch_axes)

    def positions(self) -> Int[Array, " slots"]:
        """Global token position of each slot of k / v along axis 1 (int32): of the device's stripe inside
        shard_map, of the global buffers otherwise (device r's slots s hold r + s * axis_size)."""
        n, slots = self.axis_size, self.local_slots
        if self.call().mode == "local":
            return local_positions(LAYOUT, lax.axis_index(self.axis_name), n, slots)
        return jnp.asarray(np.concatenate([local_positions(LAYOUT, r, n, slots, xp=np) for r in range(n)]))

    def ordered(self) -> tuple[Array, Array]:
        """k and v (global) with the slot axis in position order: [batch, capacity, kv_heads, head_dim]."""
        if self.call().mode == "local":
            raise ValueError("ordered() gathers the whole cache: call it outside shard_map")
        return tuple(from_layout(x, LAYOUT, self.axis_size, axis=1) for x in (self.k, self.v))

    # ------------------------------------------------------------------ append

    def append(self, k_new: Float[Array, "batch t kv_heads head_dim"], v_new: Float[Array, "batch t kv_heads v_dim"],
               counts: Int[Array, " batch"] | None = None) -> KVCache:
        """The cache with t new tokens per row written after each row's last one; returns a new KVCache.

        k_new, v_new: [batch, t, kv_heads, head_dim] (global arrays, or the same on every device inside
        shard_map), cast to the cache's dtype. `counts` [batch] int (0..t): row b takes only its first
        counts[b] tokens (ragged batches); default t. A row that would pass the capacity raises ValueError
        when the lengths are known on the host; under a trace such a row is left as it was (nothing is
        written, its length does not grow), so nothing in the cache is ever overwritten.
        """
        call = self.call()
        b, kvh = self.k.shape[0], self.k.shape[2]
        for name, x, dim, dim_name in (("k_new", k_new, self.head_dim, "head_dim"),
                                       ("v_new", v_new, self.v_head_dim, "v_head_dim")):
            if not hasattr(x, "shape") or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"{name} must be a floating-point array, got {described(x)}")
            if x.ndim != 4 or x.shape[0] != b or x.shape[2] != kvh or x.shape[3] != dim or x.shape[1] < 1:
                raise ValueError(f"{name} must have shape [batch, t, kv_heads, {dim_name}] = ({b}, t, {kvh}, {dim}) "
                                 f"with t >= 1, got {x.shape}")
        t = k_new.shape[1]
        if v_new.shape[1] != t:
            raise ValueError(f"k_new and v_new must hold the same tokens, got t = {t} and {v_new.shape[1]}")
        if t > self.capacity:
            raise ValueError(f"k_new holds {t} tokens per row, more than the capacity {self.capacity}")
        check_counts(counts, b, t)
        lengths = concrete(self.lengths)
        if lengths is not None:
            grow = np.full(b, t) if counts is None else concrete(counts)
            if grow is not None and (over := np.flatnonzero(lengths + grow > self.capacity)).size:
                row = int(over[0])
                raise ValueError(f"k_new: row {row} holds {int(lengths[row])} tokens; {int(grow[row])} more exceed "
                                 f"the capacity {self.capacity} (create a larger KVCache)")
        n, capacity = self.axis_size, self.capacity

        def per_device(k, v, lengths, k_new, v_new, counts):
            shard = lax.axis_index(call.axis_name) if call.mode != "single" else 0
            return write_stripe(k, v, lengths, k_new, v_new, counts, shard=shard, axis_size=n, capacity=capacity)

        k, v, lengths = calling.run(call, per_device, (self.k, self.v, self.lengths, k_new, v_new, counts),
                                    (SEQ, SEQ, ROWS, ROWS, ROWS, ROWS), (SEQ, SEQ, ROWS),
                                    key=("KVCache.append", capacity))
        return self.replace(k=k, v=v, lengths=lengths)


def _zeros(shape, dtype, mesh, spec):
    """Zeros created directly in their shards (never whole on one device)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return _zeros_jit(shape, jnp.dtype(dtype), NamedSharding(mesh, spec))()
    return _compat.reshard(jnp.zeros(shape, dtype), mesh, spec)  # an abstract mesh: inside a trace


@functools.lru_cache(maxsize=32)
def _zeros_jit(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def write_stripe(k, v, lengths, k_new, v_new, counts, *, shard, axis_size: int, capacity: int):
    """One device's part of an append: (k, v, lengths) with the new tokens that land on stripe `shard`.

    Token i of row b goes to position lengths[b] + i, i.e. device (lengths[b] + i) % n, slot
    (lengths[b] + i) // n: on each device a run of at most ceil(t / n) consecutive slots per row,
    written by one scatter. Rows that would pass `capacity` write nothing and keep their length.
    """
    b, t = k_new.shape[:2]
    n, slots = axis_size, k.shape[1]
    grow = jnp.full((b,), t, jnp.int32) if counts is None else counts.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    fits = lengths + grow <= capacity
    first = (shard - lengths) % n  # [B] index of the first new token that lands on this device
    index = first[:, None] + n * jnp.arange(-(-t // n), dtype=jnp.int32)[None]  # [B, m]
    slot = (lengths[:, None] + index) // n
    # out-of-range slots are dropped by the scatter: padding tokens and rows over capacity write nothing
    slot = jnp.where((index < grow[:, None]) & fits[:, None], slot, slots)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    take = jnp.minimum(index, t - 1)[:, :, None, None]

    def scatter(buf, new):
        vals = jnp.take_along_axis(new, take, axis=1).astype(buf.dtype)
        vals, idx_rows, idx_slots = (_compat.match_vma(x, buf) for x in (vals, rows, slot))
        return buf.at[idx_rows, idx_slots].set(vals, mode="drop")

    return scatter(k, k_new), scatter(v, v_new), jnp.where(fits, lengths + grow, lengths)

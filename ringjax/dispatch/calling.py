"""The three ways an op is called, and one runner for each.

- "local": inside `jax.shard_map` over the ring axis; arrays are this device's shards.
- "global": outside it, under `jax.set_mesh(mesh)` or with `mesh=`; arrays are global and
  the op wraps itself in `shard_map`, keeping batch and heads sharded over the other axes.
- "single": `axis_name=None`; the blockwise algorithm on whole sequences, no ring.

Eager calls (no tracer among the arrays) in the global and single modes run through a
`jax.jit` cached on the call's static plan, so calling the op without `jax.jit` costs a
compile once per shape and options rather than once per call.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from ringjax import _compat

# Array roles: how an argument or result is laid out over the mesh in the global mode.
TOKENS = "tokens"  # [batch, seq, heads, head_dim]
SEQ = "seq"  # [batch, seq] (segment ids)
HEADS = "heads"  # [heads] (sinks, ALiBi slopes)
REPLICATED = "replicated"  # the same on every device (a dropout seed)
LSE = "lse"  # [batch, heads, seq]
ROWS = "rows"  # [batch, ...] replicated over the sequence axes (cache_attention's queries, a cache's lengths)


@dataclasses.dataclass(frozen=True)
class Call:
    """How one call runs: its mode, the ring axis and, for global arrays, the mesh and spare axes."""

    mode: str  # "single" | "local" | "global"
    axis_name: str | tuple[str, ...] | None  # a tuple: the sequence is split over several axes, major first
    axis_size: int
    mesh: Any = None  # Mesh or AbstractMesh (global mode only)
    batch_axes: tuple[str, ...] = ()  # mesh axes batch stays sharded over (global mode)
    head_axes: tuple[str, ...] = ()  # mesh axes heads stay sharded over (global mode)

    @property
    def is_global(self) -> bool:
        return self.mode == "global"

    @property
    def seq_axes(self) -> tuple[str, ...]:
        return _axes(self.axis_name)

    def axis_sizes(self) -> dict[str, int]:
        """Size of each sequence axis."""
        if self.is_global:
            return {a: int(self.mesh.shape[a]) for a in self.seq_axes}
        return {a: int(_compat.axis_size_or_none(a) or 1) for a in self.seq_axes}

    def ways(self, axes: tuple[str, ...]) -> int:
        return math.prod(int(self.mesh.shape[a]) for a in axes) if axes else 1

    def spec(self, role: str) -> P:
        b, h = _entry(self.batch_axes), _entry(self.head_axes)
        return {
            TOKENS: P(b, self.axis_name, h, None),
            SEQ: P(b, self.axis_name),
            HEADS: P(h),
            REPLICATED: P(),
            LSE: P(b, h, self.axis_name),
            ROWS: P(b),
        }[role]

    def local_shape(self, batch: int, seq: int, heads: int) -> tuple[int, int, int]:
        """Per-device (batch, seq, heads) of a global [batch, seq, heads, ...] array."""
        if not self.is_global:
            return batch, seq, heads
        return batch // self.ways(self.batch_axes), seq // self.axis_size, heads // self.ways(self.head_axes)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def check_mesh(mesh) -> None:
    """TypeError unless `mesh` is a mesh or None."""
    if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, or None for the mesh set by jax.set_mesh; got "
                        f"{type(mesh).__name__}")


def _within_shard_map(mesh):
    """`mesh`, or inside a shard_map manual over some of its axes, the enclosing abstract mesh: there the axes
    are typed Manual, and arrays laid out on the concrete mesh (Auto or Explicit axes) are rejected."""
    context = jax.sharding.get_abstract_mesh()
    if context is None or context.empty or not context.manual_axes:
        return mesh
    if dict(context.shape) != dict(mesh.shape):
        raise ValueError(f"mesh= (axes {dict(mesh.shape)}) is not the mesh of the enclosing shard_map (axes "
                         f"{dict(context.shape)}); omit mesh= inside shard_map")
    return context


def resolve(axis_name, mesh=None, *, allow_pair: bool = False) -> Call:
    """Which mode a call with `axis_name` (and optional `mesh`) runs in here.

    `allow_pair`: axis_name may be a tuple of two names (the sequence split over both).
    """
    check_mesh(mesh)
    if axis_name is None:
        if mesh is not None:
            raise ValueError("mesh= needs axis_name: name the mesh axis the sequence is sharded over")
        return Call("single", None, 1)
    if allow_pair and isinstance(axis_name, (tuple, list)) and len(axis_name) == 2:
        names = tuple(axis_name)
    else:
        names = (axis_name,)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"axis_name must be a str or None, got {type(name).__name__}")
    axis_name = names[0] if len(names) == 1 else names
    bound = [_compat.axis_size_or_none(name) for name in names]
    if all(b is not None for b in bound):
        for name, size in zip(names, bound):
            if mesh is not None and mesh.shape.get(name) != size:
                raise ValueError(f"mesh axis {name!r} does not match the enclosing shard_map's (size {size})")
        return Call("local", axis_name, math.prod(int(b or 1) for b in bound))
    target = _within_shard_map(mesh) if mesh is not None else _compat.context_mesh()
    for name in names:
        if target is None or name not in target.axis_names:
            where = f"mesh axes {tuple(target.axis_names)}" if target is not None else "no mesh"
            raise ValueError(
                f"axis_name {name!r} is not bound ({where}). Call inside jax.shard_map over a mesh with that "
                f"axis, on global arrays under jax.set_mesh(mesh) or with mesh=mesh, or pass axis_name=None to run "
                "on one device without a ring"
            )
    assert target is not None  # every name was found on it above
    return Call("global", axis_name, math.prod([int(target.shape[name]) for name in names]), target)


def with_spare_axes(call: Call, x, *, batch: int, kv_heads: int, keep_heads_if=None) -> Call:
    """`call` with the mesh axes that batch and heads of `x` stay sharded over (global mode).

    Read from `x`'s sharding where it has one; otherwise batch is data-parallel over the other
    mesh axes when they divide it. Axes that do not divide batch or kv_heads are dropped (those
    dimensions are then gathered), so a call never fails for an uneven split. `keep_heads_if`
    (a predicate on the head-sharding ways) lets an entry point refuse a head split it cannot use.
    """
    if not call.is_global:
        return call
    mesh, seq_axes = call.mesh, call.seq_axes
    spec = _compat.sharding_spec(x)
    if spec is not None:
        spec = tuple(spec) + (None,) * (4 - len(spec))
        batch_axes, head_axes = _axes(spec[0]), _axes(spec[2])
        for axis in seq_axes:
            if axis in batch_axes + head_axes:
                raise ValueError(f"q is sharded over {axis!r} on batch or heads; the sequence axis must be free")
    else:
        rest = tuple(a for a in mesh.axis_names if a not in seq_axes and mesh.shape[a] > 1)
        batch_axes, head_axes = rest, ()
    call = dataclasses.replace(call, batch_axes=batch_axes, head_axes=head_axes)
    if batch % call.ways(call.batch_axes):
        call = dataclasses.replace(call, batch_axes=())
    if kv_heads % call.ways(call.head_axes) or (keep_heads_if is not None and not keep_heads_if(call.ways(head_axes))):
        call = dataclasses.replace(call, head_axes=())
    return call


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def shard_indices(call: Call):
    """This device's index over the batch and head axes of a global call (traced; 0 elsewhere).

    Lets an op that draws randomness per local (batch, head) give every shard its own stream.
    """
    import jax.numpy as jnp

    index = jnp.uint32(0)
    for axis in call.batch_axes + call.head_axes:
        index = index * jnp.uint32(call.mesh.shape[axis]) + jax.lax.axis_index(axis).astype(jnp.uint32)
    return index


_CACHE_SIZE = 64
_compiled: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
_lock = threading.Lock()


def _cached_jit(key: Hashable, make: Callable[[], Callable]) -> Callable:
    with _lock:
        fn = _compiled.get(key)
        if fn is not None:
            _compiled.move_to_end(key)
            return fn
    fn = jax.jit(make())
    with _lock:
        _compiled[key] = fn
        while len(_compiled) > _CACHE_SIZE:
            _compiled.popitem(last=False)
    return fn


def run(call: Call, per_device: Callable, args: Sequence[Any], roles: Sequence[str], out_roles: Sequence[str],
        *, key: Hashable | None = None, on_compile: Callable[[], None] | None = None):
    """per_device(*args) on every device's shards, in `call`'s mode.

    `args` may hold None (absent optional inputs); `roles` says how each argument is laid
    out in the global mode, `out_roles` each result. With a hashable `key` that fixes
    everything `per_device` depends on besides its array arguments, an eager call reuses
    one compiled function per key and input shapes. `on_compile()` runs when this call is
    traced into a program being compiled, or compiles its own: not when an eager call
    reuses one.
    """
    announce = on_compile or (lambda: None)
    if call.mode == "local":
        announce()
        return per_device(*args)
    present = [i for i, a in enumerate(args) if a is not None]

    def on_present(*xs):
        full = [None] * len(args)
        for i, x in zip(present, xs):
            full[i] = x
        return per_device(*full)

    def whole(*xs):
        if not call.is_global:
            return on_present(*xs)
        in_specs = tuple(call.spec(roles[i]) for i in present)
        out_specs = tuple(call.spec(r) for r in out_roles)
        xs = tuple(_compat.reshard(x, call.mesh, s) for x, s in zip(xs, in_specs))
        return jax.shard_map(on_present, mesh=call.mesh, in_specs=in_specs, out_specs=out_specs)(*xs)

    xs = tuple(args[i] for i in present)
    if key is None or any(_compat.is_traced(x) for x in xs):
        announce()
        if not call.is_global:  # single mode under a trace: numpy inputs still need to become arrays
            xs = tuple(x if _compat.is_traced(x) else jax.numpy.asarray(x) for x in xs)
            return whole(*xs)
        # a shard_map run eagerly under jax.jvp (an eager grad's, or forward mode's) hits jax's own errors (an
        # unhashable key, for forward mode); under jit it is the traced program every other call makes
        return jax.jit(whole)(*xs)
    xs = tuple(x if isinstance(x, jax.Array) else np.asarray(x) for x in xs)

    def make():
        announce()
        return whole

    return _cached_jit((key, call, tuple(present)), make)(*xs)

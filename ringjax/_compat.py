"""The few places where jax versions (0.10.2 to the newest) differ, kept in one module."""

from __future__ import annotations

import contextlib
import logging

import jax
from jax.sharding import AbstractMesh, Mesh


def is_traced(x) -> bool:
    """Whether `x` is a tracer (its value known only when the traced call runs)."""
    return isinstance(x, jax.core.Tracer)


def host_value(x, max_size: int | None = None):
    """`x` as a numpy array where its value is known here: not a tracer (known only when the traced call runs),
    not partly held by other processes, and at most `max_size` elements; else None."""
    import numpy as np

    if x is None or is_traced(x) or not getattr(x, "is_fully_addressable", True):
        return None
    if max_size is not None and np.size(x) > max_size:
        return None
    return np.asarray(x)


def axis_size_or_none(axis_name: str) -> int | None:
    """Size of `axis_name` if it is bound in the current trace (e.g. inside shard_map)."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        return None


def context_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (or the legacy `with mesh:`), if any."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    if get_mesh is not None:
        try:
            mesh = get_mesh()
            if mesh is not None and not mesh.empty:
                return mesh
        except Exception:  # noqa: BLE001 - only an abstract mesh is set
            pass
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    try:  # legacy `with mesh:` sets only the physical mesh
        from jax._src.mesh import thread_resources

        physical = thread_resources.env.physical_mesh
        if physical is not None and not physical.empty:
            return physical
    except (ImportError, AttributeError):
        pass
    return None


def varying_axes(x) -> frozenset:
    """Mesh axes over which `x` varies inside shard_map (empty when not tracked)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def match_vma(x, *refs):
    """Cast `x` to vary over every mesh axis that any of `refs` varies over.

    Loop carries and cond branches must agree on this inside shard_map; fresh
    constants (zeros, -inf) start out invariant.
    """
    axes = frozenset().union(*(varying_axes(r) for r in refs)) - varying_axes(x)
    if not axes:
        return x
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, tuple(sorted(axes)))
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying")


def to_varying(x, axis_name: str):
    """Mark `x` as varying over `axis_name`, so that its cotangent is summed over it.

    Parameters replicated across the ring (sinks, ALiBi slopes) get one gradient
    contribution per device; the transpose of this cast is the psum that adds them.
    """
    if axis_name is None or axis_name in varying_axes(x):
        return x
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, axis_name)
    try:
        return jax.lax.pcast(x, axis_name, to="varying")
    except (ValueError, TypeError):  # shard_map with check_vma=False tracks nothing
        return x


def reshard(x, mesh, spec):
    """Put a global array (or tracer) into `spec` on `mesh`, for explicit or auto axes."""
    from jax.sharding import AxisType, NamedSharding

    explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    if explicit:
        return jax.reshard(x, spec) if isinstance(mesh, AbstractMesh) else jax.reshard(
            x, NamedSharding(mesh, spec)
        )
    if isinstance(mesh, AbstractMesh):
        return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def sharding_spec(x):
    """The PartitionSpec of a global array or explicit-mode tracer, or None if unknown."""
    sharding = getattr(x, "sharding", None)  # concrete jax.Array
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return spec
    try:
        aval_sharding = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001
        return None
    spec = getattr(aval_sharding, "spec", None)
    mesh = getattr(aval_sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True):
        return None
    return spec


def explicit_spec(x):
    """The PartitionSpec of `x` if its type carries one over Explicit mesh axes, else None.

    Under auto axes a traced array's type says nothing about where it lives (XLA decides
    after tracing), so its nominal spec must not be reused as an output sharding.
    """
    from jax.sharding import AxisType

    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - not a jax value
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return sharding.spec


def is_committed(x) -> bool:
    """Whether a concrete jax.Array was placed explicitly (device_put, a sharded result)."""
    committed = getattr(x, "committed", None)
    if committed is None:
        committed = getattr(x, "_committed", True)
    return bool(committed)


def explicit_mesh_context(mesh):
    """`jax.set_mesh(mesh)` if `mesh` has Explicit axes (their gathers need it), else a no-op context."""
    import contextlib

    if mesh is None or not any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def constrain(x, sharding):
    """Place traced `x` at `sharding` (a NamedSharding, or a PartitionSpec under a context mesh)."""
    mesh = getattr(sharding, "mesh", None) or context_mesh()
    if mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def align_vma(*xs) -> tuple:
    """Make every operand vary over the same mesh axes (a pallas_call's operands must agree)."""
    return tuple(match_vma(x, *xs) for x in xs)


def struct_like(shape, dtype, *refs):
    """ShapeDtypeStruct varying over the mesh axes `refs` vary over (pallas_call outputs in shard_map)."""
    varying = frozenset().union(*(varying_axes(r) for r in refs))
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


@contextlib.contextmanager
def unchecked_vma():
    """Trace with shard_map's varying-axes checks off, as `plgpu.kernel` does around its own kernel call."""
    from jax._src import config as jax_config

    with jax_config._check_vma(False):
        yield


_UNCHECKED = None


def _unchecked_primitive():
    """A primitive that traces its body with shard_map's varying-axes checks off.

    The Pallas interpreter evaluates a kernel (traced without those checks) inside
    the enclosing shard_map's lowering, where mixing varying refs with invariant grid
    indices is rejected (jax 0.10-0.11). Only interpret mode goes through here.
    """
    global _UNCHECKED
    if _UNCHECKED is not None:
        return _UNCHECKED
    from jax._src import config as jax_config
    from jax._src import core as jax_core
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("ringjax_unchecked_vma_call")
    prim.multiple_results = True

    def abstract(*avals, fn, out_shapes):
        varying = frozenset().union(*(getattr(getattr(a, "mat", None), "varying", frozenset()) for a in avals))
        if not varying:
            return [jax_core.ShapedArray(s, d) for s, d in out_shapes]
        mat = jax_core.ManualAxisType(varying=varying)
        sharding = jax_core.get_cur_mesh_sharding()
        return [jax_core.ShapedArray(s, d, sharding=sharding, manual_axis_type=mat) for s, d in out_shapes]

    def impl(*args, fn, out_shapes):
        with jax_config._check_vma(False):
            return list(fn(*args))

    def plain(aval):
        return jax_core.ShapedArray(aval.shape, aval.dtype)

    def lowering(ctx, *args, fn, out_shapes):
        # lower the body as if outside shard_map: same local shapes, no varying-axes types
        ctx = ctx.replace(avals_in=[plain(a) for a in ctx.avals_in], avals_out=[plain(a) for a in ctx.avals_out])
        return mlir.lower_fun(impl, multiple_results=True)(ctx, *args, fn=fn, out_shapes=out_shapes)

    prim.def_abstract_eval(abstract)
    prim.def_impl(impl)
    mlir.register_lowering(prim, lowering)
    _UNCHECKED = prim
    return prim


def call_unchecked_vma(fn, out_shapes, *args):
    """fn(*args) -> list of arrays with `out_shapes` [(shape, dtype)], varying like the union of args."""
    out_shapes = tuple((tuple(s), jax.numpy.dtype(d)) for s, d in out_shapes)
    return _unchecked_primitive().bind(*args, fn=fn, out_shapes=out_shapes)


def gather_axis(x, axis: int):
    """Undo explicit sharding of dimension `axis` (the one-device path needs whole sequences)."""
    spec = sharding_spec(x)
    if spec is None or len(spec) <= axis or spec[axis] is None:
        return x
    new = tuple(None if i == axis else e for i, e in enumerate(tuple(spec) + (None,) * (x.ndim - len(spec))))
    from jax.sharding import NamedSharding, PartitionSpec

    concrete = getattr(x, "sharding", None)
    if isinstance(concrete, NamedSharding):
        return jax.device_put(x, NamedSharding(concrete.mesh, PartitionSpec(*new)))
    return jax.reshard(x, PartitionSpec(*new))


class _PrintRaces(logging.Handler):
    """Prints the race reports of jax >= 0.12's TPU interpreter, which logs them on the root logger."""

    def filter(self, record):
        return record.pathname.endswith("race_detection_state.py") and record.getMessage().startswith("RACE")

    def emit(self, record):
        print(record.getMessage(), flush=True)


def tpu_interpret_params(detect_races: bool):
    """Pallas TPU interpreter parameters; a detected race is printed and recorded, never raised.

    jax <= 0.11 prints each race and records it; jax >= 0.12 raises on the first one unless
    told to warn, and then logs it: a handler (installed the first time races are detected)
    prints those records as older versions did.
    """
    from jax.experimental.pallas import tpu as pltpu

    fields = getattr(pltpu.InterpretParams, "__dataclass_fields__", {})
    if not detect_races or "on_race" not in fields:
        return pltpu.InterpretParams(detect_races=detect_races)
    root = logging.getLogger()
    if not any(isinstance(h, _PrintRaces) for h in root.handlers):
        root.addHandler(_PrintRaces())
    return pltpu.InterpretParams(detect_races=True, on_race="warn")


def tpu_races_found() -> bool:
    """Whether the TPU interpreter's race detector recorded a race since its state was last reset."""
    try:  # not public API: jax keeps the detector's state in this module
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
    except ImportError as e:
        raise RuntimeError(f"this jax ({jax.__version__}) does not expose the interpreter's race state") from e
    state = getattr(interpreter, "races", None)
    return bool(state is not None and state.races_found)


# jax 0.12 deprecates the Pallas Triton backend ("jax-pallas-triton"): lowering a kernel warns, or raises where the
# deprecation is accelerated, and a later jax drops the module (an ImportError the registry reports as a refusal)
PALLAS_TRITON_DEPRECATION = "jax-pallas-triton"


def pallas_triton_withdrawn() -> str | None:
    """Why this jax will not lower Pallas kernels with Triton on a GPU, or None while it still does."""
    try:  # not public API: jax keeps its deprecation switches here
        from jax._src import deprecations
        accelerated = deprecations.is_accelerated(PALLAS_TRITON_DEPRECATION)
    except (ImportError, AttributeError, ValueError):  # before jax 0.12 the backend was not deprecated
        return None
    if accelerated:
        return (f"jax {jax.__version__} has withdrawn the Pallas Triton backend (its {PALLAS_TRITON_DEPRECATION!r} "
                "deprecation is an error here)")
    return None

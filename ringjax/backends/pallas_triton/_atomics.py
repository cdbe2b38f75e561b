"""A relaxed float32 atomic add for the Pallas Triton lowering (JAX internals; optional).

`plgpu.atomic_add` lowers to acquire-release atomics at GPU scope, which order every
add against the program's other memory traffic. The fused backward only needs the adds
to land eventually (nothing reads dQ before the kernel ends), so relaxed atomics suffice.
Pallas exposes no memory-ordering argument, so this module registers a twin of its atomic
primitive whose Triton lowering asks for relaxed ordering, reusing Pallas's abstract
evaluation and its discharge rule (interpret mode). If the internals it uses are missing
(another JAX version), `atomic_add` falls back to `plgpu.atomic_add`: same result, slower.
"""

from __future__ import annotations

import functools


@functools.cache
def _relaxed_primitive():
    try:
        from jax._src import core as jax_core
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering
        from jax._src.pallas.triton import primitives as tp
        from jax._src.state import discharge as state_discharge
        from jax._src.state import indexing
        from jax._src.state import primitives as state_primitives

        tp._atomic_abstract_eval, tp._atomic_rmw_discharge_rule, tp.AtomicOpType.ADD  # noqa: B018
        lowering._compute_pointers_from_indices, lowering._ensure_ir_value, lowering._atomic_rmw  # noqa: B018
        tt_dialect.MemSemantic.RELAXED  # noqa: B018
    except (ImportError, AttributeError):
        return None

    prim = jax_core.Primitive("ringjax_relaxed_atomic_add")
    prim.def_effectful_abstract_eval(tp._atomic_abstract_eval)
    state_discharge.register_discharge_rule(prim)(tp._atomic_rmw_discharge_rule)

    def lower(ctx, *args_flat, args_tree, atomic_type):
        del atomic_type  # always ADD
        block_info, *_ = ctx.block_infos
        ptr, indexers, val, mask = args_tree.unflatten(args_flat)
        *_, value_aval, _ = args_tree.unflatten(ctx.avals_in)
        if mask is not None or len(indexers) != 1 or not isinstance(indexers[0], indexing.NDIndexer):
            raise NotImplementedError("relaxed atomic_add takes one explicit index and no mask")
        ptrs = lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
        val = lowering._ensure_ir_value(val, value_aval)
        return lowering._atomic_rmw(tt_dialect.RMWOp.FADD, ptrs, val, semantic=tt_dialect.MemSemantic.RELAXED)

    lowering.register_lowering(prim)(lower)

    def bind(ref, idx, val):
        from jax import tree_util

        x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
        args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, None))
        return prim.bind(*args_flat, args_tree=args_tree, atomic_type=tp.AtomicOpType.ADD)

    return bind


def atomic_add(ref, idx, val) -> None:
    """ref[idx] += val with float32 atomics (relaxed ordering where available)."""
    bind = _relaxed_primitive()
    if bind is None:
        from jax.experimental.pallas import triton as plgpu

        plgpu.atomic_add(ref, idx, val)
    else:
        bind(ref, idx, val)

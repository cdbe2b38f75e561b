"""`ring_attention`: validate, choose the calling mode, ask the registry, run."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ringjax import _compat, autotuning, registry, strategies
from ringjax.masks import Extras
from ringjax.options import check_inputs, make_options

OP = "ring_attention"


def _resolve_axis(axis_name, mesh):
    """Return ("single" | "local" | "global", axis_size, mesh_for_shard_map).

    `axis_name` may be a tuple of names (the hybrid strategy); axis_size is then their product.
    """
    if axis_name is None:
        if mesh is not None:
            raise ValueError("mesh= needs axis_name: name the mesh axis the sequence is sharded over")
        return "single", 1, None
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"axis_name must be a str or None, got {type(name).__name__}")
    bound = [_compat.axis_size_or_none(name) for name in names]
    if all(b is not None for b in bound):
        for name, size in zip(names, bound):
            if mesh is not None and mesh.shape.get(name) != size:
                raise ValueError(f"mesh axis {name!r} does not match the enclosing shard_map's (size {size})")
        return "local", math.prod(bound), None
    target = mesh if mesh is not None else _compat.context_mesh()
    for name in names:
        if target is None or name not in target.axis_names:
            where = f"mesh axes {tuple(target.axis_names)}" if target is not None else "no mesh"
            raise ValueError(
                f"axis_name {name!r} is not bound: call ring_attention inside jax.shard_map over a mesh "
                f"with that axis, or on global arrays under jax.set_mesh(mesh) / mesh=mesh (found {where})"
            )
    return "global", math.prod(int(target.shape[name]) for name in names), target


def _axis_sizes(axis_name, mode, mesh) -> dict[str, int]:
    names = () if axis_name is None else tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if mode == "global":
        return {name: int(mesh.shape[name]) for name in names}
    return {name: _compat.axis_size_or_none(name) for name in names}


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _other_axes(q, mesh, seq_axes: tuple):
    """Mesh axes that batch and heads stay sharded over (never gathered)."""
    spec = _compat.sharding_spec(q)
    if spec is not None:
        spec = tuple(spec) + (None,) * (4 - len(spec))
        batch, heads = _spec_axes(spec[0]), _spec_axes(spec[2])
        for axis_name in seq_axes:
            if axis_name in batch + heads:
                raise ValueError(f"q is sharded over {axis_name!r} on batch or heads; the sequence axis must be free")
        return batch, heads
    # unknown sharding (auto axes under jit): data-parallel over the remaining axes if they divide batch
    rest = tuple(a for a in mesh.axis_names if a not in seq_axes and mesh.shape[a] > 1)
    if rest and q.shape[0] % math.prod(mesh.shape[a] for a in rest) == 0:
        return rest, ()
    return (), ()


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def ring_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    axis_name: str | tuple[str, str] | None = "sp",
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    layout: str = "contiguous",
    chunk_size: int | None = None,
    alibi_slopes: Float[Array, " heads"] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    num_sink_tokens: int = 0,
    return_lse: bool = False,
    mesh=None,
    implementation: str = "auto",
    config=None,
    autotune: str | None = None,
    strategy: str = "ring",
):
    """Exact attention over a sequence sharded along mesh axis `axis_name`.

    Inside `jax.shard_map` the arrays are local shards; outside it they are global
    arrays and the op shards the sequence over `axis_name` of `mesh` (or the mesh
    set by `jax.set_mesh`). `layout` says which global positions each shard holds;
    see `to_layout`. Returns out [batch, seq, heads, head_dim] in q's dtype and,
    with `return_lse`, lse [batch, heads, seq] float32 (natural log, -inf for rows
    that see no key). Mask and logit options are described in the README's table.

    `implementation` is "auto" or a registered name (see `list_implementations`);
    `config` fixes that implementation's config. Otherwise `autotune` ("off" |
    "cached" | "on", default $RINGJAX_AUTOTUNE or "cached") says whether cached
    tuned configs are used and whether missing ones are measured; see docs/autotune.md.

    `strategy` says how the sequence-sharded work is spread: "ring" (default), "all_gather",
    "ulysses", "hybrid" (axis_name=(head_axis, ring_axis), the sequence split over both, head
    axis major) or "auto" (chosen by the cost model in `ringjax.plan`); see docs/strategies.md.
    """
    strategies.check_strategy(strategy, axis_name)
    mode, axis_size, mesh_obj = _resolve_axis(axis_name, mesh)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(implementation, str):
        raise TypeError(f"implementation must be a str, got {type(implementation).__name__}")
    check_inputs(q, k, v, segment_ids, sinks, axis_size=axis_size, layout=layout, local=mode != "global",
                 alibi_slopes=alibi_slopes, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    opts = make_options(
        q,
        causal=causal,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        layout=layout,
        axis_name=None,  # set per strategy (Strategy.problem)
        axis_size=axis_size,
        has_segments=segment_ids is not None,
        has_sinks=sinks is not None,
        chunk_size=chunk_size,
        has_alibi=alibi_slopes is not None,
        dropout_rate=dropout_rate,
        num_sink_tokens=num_sink_tokens,
    )
    seed = None
    if dropout_rng is not None:
        seed = jax.random.bits(dropout_rng, (2,), jnp.uint32)
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    batch_axes = head_axes = ()
    seq_axes = () if axis_name is None else tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (
        axis_name,)
    if mode == "global":
        batch_axes, head_axes = _other_axes(q, mesh_obj, seq_axes)
        for axes, size, what in ((batch_axes, batch, "batch"), (head_axes, kv_heads, "kv_heads")):
            ways = math.prod(mesh_obj.shape[a] for a in axes)
            if size % ways:
                raise ValueError(f"{what} ({size}) must be divisible by the {ways}-way sharding over {axes}")
        batch //= math.prod(mesh_obj.shape[a] for a in batch_axes)
        heads //= math.prod(mesh_obj.shape[a] for a in head_axes)
        kv_heads //= math.prod(mesh_obj.shape[a] for a in head_axes)
        seq //= axis_size
    base = registry.Problem(
        opts=opts,
        batch=batch,
        seq=seq,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=str(q.dtype),
        platform=registry.current_platform(),
    )
    sizes = _axis_sizes(axis_name, mode, mesh_obj)
    if strategy == "auto":
        strat = strategies.choose(base, axis_name, sizes)
    else:
        strat = strategies.bind(strategy, axis_name, sizes)
    problem = strat.problem(base)
    reg, impl = registry.choose(OP, implementation, problem)
    config = autotuning.select_config(OP, reg, impl, problem, config, policy=autotune)

    def per_device(q, k, v, seg, sinks, slopes, seed):
        if seed is not None and (batch_axes or head_axes):
            # other batch/head shards draw other masks (shard_map users fold this in themselves)
            shard = jnp.uint32(0)
            for axis in batch_axes + head_axes:
                shard = shard * jnp.uint32(_compat.axis_size_or_none(axis)) + jax.lax.axis_index(axis).astype(jnp.uint32)
            seed = seed + shard * jnp.asarray([0x9E3779B9, 0x7F4A7C15], jnp.uint32)
        extras = Extras(alibi_slopes=slopes, dropout_seed=seed)
        return strategies.run_per_device(strat, impl, problem, config, q, k, v, seg, sinks, extras)

    if mode == "single":
        q, k, v = (_compat.gather_axis(x, 1) for x in (q, k, v))
        segment_ids = None if segment_ids is None else _compat.gather_axis(segment_ids, 1)
    if mode != "global":
        out, lse = per_device(q, k, v, segment_ids, sinks, alibi_slopes, seed)
    else:
        b, h, sq = _entry(batch_axes), _entry(head_axes), _entry(seq_axes)
        qkv_spec = P(b, sq, h, None)
        seg_spec = None if segment_ids is None else P(b, sq)
        head_spec = P(h)
        args = (q, k, v, segment_ids, sinks, alibi_slopes, seed)
        specs = (qkv_spec, qkv_spec, qkv_spec, seg_spec, head_spec, head_spec, P())
        present = [i for i, a in enumerate(args) if a is not None]

        def per_device_present(*xs):
            full = [None] * len(args)
            for i, x in zip(present, xs):
                full[i] = x
            return per_device(*full)

        out, lse = jax.shard_map(
            per_device_present,
            mesh=mesh_obj,
            in_specs=tuple(specs[i] for i in present),
            out_specs=(qkv_spec, P(b, h, sq)),
        )(*(_compat.reshard(args[i], mesh_obj, specs[i]) for i in present))
    return (out, lse) if return_lse else out

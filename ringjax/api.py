"""`ring_attention`: validate, choose the calling mode, ask the registry, run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ringjax import _compat
from ringjax.core import invariant, precision
from ringjax.core.masks import Extras
from ringjax.dispatch import autotuning, calling, costs, registry, report
from ringjax.dispatch.calling import HEADS, LSE, REPLICATED, SEQ, TOKENS
from ringjax.options import check_inputs, checked_keywords, make_options, option_inputs
from ringjax.strategies import auto as strategy_auto
from ringjax.strategies import spread as strategies

OP = "ring_attention"
# odd constants: each batch/head shard of a global call draws its own dropout stream
_SHARD_SEED_STRIDE = (0x9E3779B9, 0x7F4A7C15)


@checked_keywords
def ring_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads v_head_dim"],
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
    deterministic: bool = False,
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
    set by `jax.set_mesh`); `axis_name=None` runs on one device without a ring.
    `layout` says which global positions each shard holds; see `to_layout`. v may have a
    head_dim of its own (multi-head latent attention: q/k 192, v 128); the default
    softmax_scale is 1/sqrt(q's head_dim). Returns out [batch, seq, heads, v_head_dim] in
    q's dtype and, with `return_lse`, lse [batch, heads, seq] float32 (natural log, -inf
    for rows that see no key). Mask and logit options are described in the README's table.

    `deterministic=True` makes gradients bitwise-identical from run to run at a fixed ring size and
    config (across ring sizes dK/dV are summed over ring steps in another float32 order, so they
    differ in the last bits; so do other block sizes). It makes the fused backwards (`bwd_fused=True` of
    the Triton and Mosaic GPU configs, dQ summed by atomic adds; Mosaic GPU's default at head_dim 64, and at
    128 with dropout or a soft cap) run split, at the split backward's time; every other backward already
    is deterministic. `deterministic="invariant"` also gives the same bits (out, lse and every gradient) on
    any ring size and on the contiguous and zigzag layouts, under the ring and all-gather strategies: each
    kernel call takes fixed granules of the global sequence and the partial results add in fixed point. It
    costs the forward twice and integer sums; the README (Arguments and features) says how much.

    `implementation` is "auto" or a registered name (see `list_implementations`);
    `config` fixes that implementation's config. Otherwise `autotune` ("off" |
    "cached" | "on", default $RINGJAX_AUTOTUNE or "cached") says whether cached
    tuned configs are used and whether missing ones are measured; see docs/autotune.md.

    `strategy` spreads the work over the sequence axis: "ring" (K/V travel around a ring),
    "all_gather" (K/V gathered once), "ulysses" (all-to-all to whole sequences of a slice of
    the heads), "hybrid" (ulysses over one axis, ring over another: axis_name=(head_axis,
    ring_axis), the sequence split over both, head axis major) or "auto" (the cost model of
    `ringjax.strategies.plan` decides; logged to "ringjax.strategy"). See docs/strategies.md.
    What runs and why is logged to "ringjax.implementation" at INFO level, once per compiled call.

    The keywords are declared once in `ringjax.options.KEYWORDS`; one this signature lacks
    (e.g. jax.nn.dot_product_attention's `is_causal`) raises a TypeError naming ours.
    """
    arguments = dict(locals())  # first: the arguments by name, before any is rebound
    strategies.check_strategy(strategy, axis_name)
    call = calling.resolve(axis_name, mesh, allow_pair=strategy in ("hybrid", "auto"))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(implementation, str):
        raise TypeError(f"implementation must be a str, got {type(implementation).__name__}")
    check_inputs(q, k, v, segment_ids, sinks, axis_size=call.axis_size, layout=layout, local=not call.is_global,
                 alibi_slopes=alibi_slopes, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    # axis_name=None: the strategy sets the axes each device's problem runs over
    opts = make_options(q, axis_name=None, axis_size=call.axis_size, **option_inputs(arguments))
    # a strategy named: refused here, before its own shape checks would give a lesser reason
    if opts.invariant and (why := invariant.strategy_refusal(strategy)):
        raise ValueError(why)
    batch, seq, heads, head_dim = q.shape
    call = calling.with_spare_axes(call, q, batch=batch, kv_heads=k.shape[2])
    batch, seq, heads = call.local_shape(batch, seq, heads)
    base = registry.Problem(
        opts=opts,
        batch=batch,
        seq=seq,
        heads=heads,
        kv_heads=k.shape[2] // call.ways(call.head_axes),
        head_dim=head_dim,
        v_head_dim=v.shape[3],
        dtype=str(q.dtype),
        platform=registry.current_platform(),
        precision=precision.current(q.dtype),  # jax's matmul precision now, while the call is traced
        # ids known now (not traced) price what segments skip; inside shard_map a device holds only its shard
        documents=costs.documents_of(segment_ids, layout, call.axis_size) if call.mode != "local" else None,
    )
    if strategy == "auto":
        strat, strategy_reason = strategy_auto.choice(base, call.axis_name, call.axis_sizes(),
                                                      implementation=implementation, autotune=autotune)
    else:
        strat = strategies.bind(strategy, call.axis_name, call.axis_sizes())
        strategy_reason = f"strategy={strategy!r}"
    problem = strat.problem(base)
    if opts.invariant:
        if why := invariant.strategy_refusal(strat.name):  # "auto" over a pair of axes picks hybrid
            raise ValueError(why)
        invariant.check(problem.opts, problem.seq)
    reg, impl = registry.choose(OP, implementation, problem)
    selection = autotuning.select(OP, reg, impl, problem, config, policy=autotune)
    config = selection.config
    seed = None if dropout_rng is None else jax.random.bits(dropout_rng, (2,), jnp.uint32)

    def per_device(q, k, v, seg, sinks, slopes, seed):
        if seed is not None and call.is_global and (call.batch_axes or call.head_axes):
            # other batch/head shards draw other masks (shard_map users fold this in themselves)
            seed = seed + calling.shard_indices(call) * jnp.asarray(_SHARD_SEED_STRIDE, jnp.uint32)
        extras = Extras(alibi_slopes=slopes, dropout_seed=seed)
        return strategies.run_per_device(strat, impl, base, config, q, k, v, seg, sinks, extras)

    if call.mode == "single":  # whole sequences on one device: undo explicit sequence sharding
        q, k, v = (_compat.gather_axis(x, 1) for x in (q, k, v))
        segment_ids = None if segment_ids is None else _compat.gather_axis(segment_ids, 1)
    out, lse = calling.run(
        call,
        per_device,
        (q, k, v, segment_ids, sinks, alibi_slopes, seed),
        (TOKENS, TOKENS, TOKENS, SEQ, HEADS, HEADS, REPLICATED),
        (TOKENS, LSE),
        key=(OP, reg.name, strat, problem, config),
        on_compile=lambda: report.announce(lambda: report.build(
            OP, implementation, problem.resolved(), reg.name, config, selection.source, strat.describe(),
            strategy_reason)),
    )
    return (out, lse) if return_lse else out

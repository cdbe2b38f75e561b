"""`cache_attention`: the queries of the last appended tokens against a sharded `KVCache`."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ringjax import _compat
from ringjax.core import precision
from ringjax.core.masks import Extras
from ringjax.dispatch import calling, registry
from ringjax.dispatch.calling import HEADS, LSE, ROWS, SEQ, TOKENS
from ringjax.inference import spread
from ringjax.inference.cache import LAYOUT, KVCache, check_counts, concrete
from ringjax.merge import add_sinks
from ringjax.options import checked_keywords, described, make_options, option_inputs

OP = "cache_attention"
_LOG = logging.getLogger("ringjax.implementation")  # what runs, once per compiled call
_NO_GRADIENT = ("cache_attention is for inference: it has no gradient with respect to q, the cache's keys and values "
               "or alibi_slopes (sinks only); use ring_attention for training")


def _inference_only(f):
    """f, whose derivative raises TypeError(_NO_GRADIENT) in place of JAX's errors about its loops with traced
    bounds and the merge's pmax; a call whose inputs carry no tangent runs f as it is."""
    f = jax.custom_jvp(f)

    @f.defjvp
    def _(primals, tangents):
        raise TypeError(_NO_GRADIENT)

    return f


def _check_heads_array(x, name: str, heads: int) -> None:
    if x is None:
        return
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array of shape [heads], got {described(x)}")
    if x.shape != (heads,):
        raise ValueError(f"{name} must have shape [heads] = ({heads},), got {x.shape}")


@checked_keywords
def cache_attention(
    q: Float[Array, "batch t heads head_dim"],
    cache: KVCache,
    *,
    counts: Int[Array, " batch"] | None = None,
    causal: bool = True,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    chunk_size: int | None = None,
    alibi_slopes: Float[Array, " heads"] | None = None,
    num_sink_tokens: int = 0,
    return_lse: bool = False,
    implementation: str = "auto",
    config=None,
    strategy: str = "auto",
):
    """Attention of the queries of each row's last appended tokens to everything the cache holds.

    q [batch, t, heads, head_dim]: query i of row b is the token at position lengths[b] - t + i (the
    last t tokens), or with `counts` (the [batch] counts of the ragged append that added them) at
    lengths[b] - counts[b] + i, where queries i >= counts[b] are padding. Append first, then attend:
    a token sees itself. Padding queries, and queries before position 0, give out 0 and lse -inf.
    Positions are global, so the mask and logit options mean what they mean in `ring_attention`;
    heads a multiple of the cache's kv_heads (GQA).

    Outside shard_map q is a global array, and so are the results (replicated over the cache's axis);
    inside `shard_map` over the cache's axis q is the same on every device, or with strategy="pass_kv"
    this device's contiguous block of the t queries (and the results are that block's).
    `strategy` ("auto", "pass_q", "pass_kv") says which of queries or cache stripes travel
    (`ringjax.inference.spread`). Returns out [batch, t, heads, v_head_dim] in q's dtype and, with
    `return_lse`, lse [batch, heads, t] float32. Differentiable with respect to `sinks` only: a gradient
    with respect to q, the cache or `alibi_slopes` raises TypeError (use `ring_attention` to train).
    """
    arguments = dict(locals())
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a ringjax.KVCache, got {type(cache).__name__}")
    spread.check_strategy(strategy)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(implementation, str):
        raise TypeError(f"implementation must be a str, got {type(implementation).__name__}")
    call = cache.call()
    n = cache.axis_size
    if not hasattr(q, "shape") or not hasattr(q, "dtype") or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be a floating-point array, got {described(q)}")
    if q.ndim != 4:
        raise ValueError(f"q must have shape [batch, t, heads, head_dim], got {q.shape}")
    if q.dtype != cache.dtype:
        raise TypeError(f"q must have the cache's dtype {cache.dtype}, got {q.dtype}")
    batch, t, heads, head_dim = q.shape
    kv_heads = cache.kv_heads
    if batch != cache.batch:
        raise ValueError(f"q batch {batch} must equal the cache's {cache.batch}")
    if head_dim != cache.head_dim:
        raise ValueError(f"q head_dim {head_dim} must equal the cache's head_dim {cache.head_dim}")
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if t < 1:
        raise ValueError("q must hold at least one query per row (t >= 1)")
    block = call.mode == "local" and strategy == "pass_kv"  # q is this device's block of the queries
    t_total = t * n if block else t
    if t_total > cache.capacity:
        raise ValueError(f"q holds {t_total} queries per row, more than the cache's capacity {cache.capacity}")
    check_counts(counts, batch, t_total)
    _check_heads_array(sinks, "sinks", heads)
    _check_heads_array(alibi_slopes, "alibi_slopes", heads)
    lengths = concrete(cache.lengths)
    if lengths is not None:
        grow = [t_total] * batch if counts is None else concrete(counts)
        short = [b for b in range(batch) if grow is not None and lengths[b] < grow[b]]
        if short:
            b = short[0]
            what = "counts" if counts is not None else "q"
            raise ValueError(f"{what}: row {b} has {int(grow[b])} new queries but the cache holds only "
                             f"{int(lengths[b])} tokens: append their keys and values first")
    opts = make_options(q, axis_name=None, axis_size=n, layout=LAYOUT, **option_inputs(arguments))
    ways = call.ways(call.batch_axes) if call.is_global else 1
    strategy, why = spread.choose(strategy, local=call.mode == "local", batch=batch // ways, t=t_total, heads=heads,
                                kv_heads=kv_heads, head_dim=head_dim, v_head_dim=cache.v_head_dim,
                                itemsize=jnp.dtype(q.dtype).itemsize, slots=cache.local_slots, axis_size=n)
    if strategy == "pass_kv" and t_total % n:
        raise ValueError(f"strategy='pass_kv' splits the {t_total} queries over the {n} devices of axis "
                         f"{cache.axis_name!r}: t must be a multiple of {n}")
    problem = registry.Problem(opts=opts, batch=batch // ways, seq=cache.local_slots, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, dtype=str(q.dtype), platform=registry.current_platform(),
                               precision=precision.current(q.dtype), v_head_dim=cache.v_head_dim,
                               q_seq=t_total // n if strategy == "pass_kv" else t_total)
    reg, impl = registry.choose(OP, implementation, problem)
    if config is None:
        config = impl.default_config(problem)
    elif not isinstance(config, impl.config_type):
        types = impl.config_type if isinstance(impl.config_type, tuple) else (impl.config_type,)
        raise TypeError(f"config must be a {' or '.join(t.__name__ for t in types)} for implementation "
                        f"{reg.name!r}, got {type(config).__name__}")
    run = spread.RUNS[strategy]

    @_inference_only
    def attend(q, k, v, lengths, counts, slopes):
        shard = lax.axis_index(call.axis_name) if call.mode != "single" else 0
        return run(impl.partials, q, k, v, lengths, counts, shard=shard, axis_name=call.axis_name, axis_size=n,
                   t_total=t_total, opts=opts, extras=Extras(alibi_slopes=slopes), config=config)

    def per_device(q, k, v, lengths, counts, sinks, slopes):
        out, lse, real = attend(q, k, v, lengths, counts, slopes)
        lse = lse.swapaxes(1, 2)  # [B, H, t]
        if sinks is not None:  # outside attend: differentiable, so learnable sinks can be tuned on a cache
            out, lse = add_sinks(out, lse, sinks)
        out = jnp.where(real[:, :, None, None], out, 0.0).astype(q.dtype)
        return out, jnp.where(real[:, None, :], lse, -jnp.inf)

    q_role, out_roles = (TOKENS, (TOKENS, LSE)) if strategy == "pass_kv" else (ROWS, (ROWS, ROWS))
    out, lse = calling.run(call, per_device, (q, cache.k, cache.v, cache.lengths, counts, sinks, alibi_slopes),
                           (q_role, SEQ, SEQ, ROWS, ROWS, HEADS, HEADS), out_roles,
                           key=(OP, reg.name, strategy, problem, config, t_total),
                           on_compile=lambda: _LOG.info(
                               f"{OP}/{reg.name}: {config}; strategy {strategy} ({why}); per device: batch "
                               f"{problem.batch}, t {t_total}, heads {heads}/{kv_heads} kv, head_dim {head_dim}, "
                               f"{cache.local_slots} cache slots, {q.dtype}"))
    if call.is_global and strategy == "pass_kv":
        # global results are replicated over the axis whatever the strategy (one all-gather of the outputs)
        out, lse = (_compat.reshard(x, call.mesh, call.spec(ROWS)) for x in (out, lse))
    return (out, lse) if return_lse else out


__all__ = ["cache_attention"]

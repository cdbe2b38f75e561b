"""`strategy="auto"`: the cost model's choice, overridden by a measurement where the autotuner has one.

Measurements time every runnable strategy on stand-ins of the call's shapes and are cached
like tuned configs (op + ".strategy" keys).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from ringjax.dispatch import autotuning, cache, calling, registry
from ringjax.strategies import spread

STRATEGY_OP_SUFFIX = ".strategy"  # cache entries of measured strategy choices: op + this suffix


def choose(base: registry.Problem, axis_name, sizes: dict[str, int], *, implementation: str = "auto",
           op: str = "ring_attention", autotune: str | None = None) -> spread.Strategy:
    """The strategy "auto" runs (`choice` without its reason)."""
    return choice(base, axis_name, sizes, implementation=implementation, op=op, autotune=autotune)[0]


def choice(base: registry.Problem, axis_name, sizes: dict[str, int], *, implementation: str = "auto",
           op: str = "ring_attention", autotune: str | None = None) -> tuple[spread.Strategy, str]:
    """(strategy, reason): measured where the autotuner has (or, with tuning "on", takes) a measurement,
    else the cost model's. Also logged to the "ringjax.strategy" logger at DEBUG level."""
    strategy, reason, runnable = spread._decide(base, axis_name, sizes, implementation, op, None)
    measured = measured_strategy(op, base, runnable, implementation, autotune)
    if measured is not None and measured.strategy is not None:
        times = ", ".join(f"{name} {t * 1e3:.3g} ms" for name, t, err in measured.timings if err is None)
        reason = (f"measured fastest ({measured.source}{': ' + times if times else ''}); "
                  f"the cost model's choice was {strategy.name} ({reason})")
        strategy = measured.strategy
    spread.log.debug("strategy='auto' chose %s: %s", strategy.describe(), reason)
    return strategy, reason



@dataclasses.dataclass(frozen=True)
class StrategyTiming:
    """Outcome of measuring the strategies for one call (medians in seconds; None: it failed)."""

    strategy: spread.Strategy | None  # the fastest, None if none ran
    source: str  # autotuned | memory | persistent | shipped
    timings: tuple[tuple[str, float | None, str | None], ...] = ()


def measured_strategy(op: str, base: registry.Problem, candidates: Sequence, implementation: str,
                      policy: str | None = None,
                      settings: autotuning.TuneSettings | None = None) -> StrategyTiming | None:
    """The strategy that measured fastest for `base` (a cached measurement, or one taken now when
    `policy` is "on"), or None. `candidates` are `spread.Strategy` over one shared axis."""
    policy = autotuning.resolve_policy(policy)
    if policy == "off" or len(candidates) < 2:
        return None
    base = base.resolved()
    by_name = {s.name: s for s in candidates}
    key = cache.cache_key(op + STRATEGY_OP_SUFFIX, implementation, base)
    kid = cache.key_id(key)
    hit = autotuning.memory_get(kid)
    if hit is not None:
        return None if hit is autotuning.FAILED or hit not in by_name else StrategyTiming(by_name[hit], "memory")
    found = cache.lookup(op + STRATEGY_OP_SUFFIX, implementation, base)
    if found is not None:
        where, entry = found
        name = entry.get("config", {}).get("strategy")
        if name in by_name:
            autotuning.memory_put(kid, name)
            return StrategyTiming(by_name[name], where)
    if policy != "on" or autotuning.recorder() is not None:
        return None
    return tune_strategies(op, base, candidates, implementation, settings or autotuning.ON_USE_SETTINGS)


def tune_strategies(op: str, base: registry.Problem, candidates: Sequence, implementation: str = "auto",
                    settings: autotuning.TuneSettings | None = None) -> StrategyTiming:
    """Time every candidate strategy on stand-in inputs of `base`'s shapes and cache the fastest.

    Each runs the implementation and config a call with that strategy would get (cached or
    heuristic configs: kernel configs are not tuned here). Needs as many devices as the axis.
    """
    settings = settings or autotuning.TuneSettings()
    base = base.resolved()
    key = cache.cache_key(op + STRATEGY_OP_SUFFIX, implementation, base)
    timings = autotuning.in_worker(_time_strategies, op, base, tuple(candidates), implementation, settings)
    ok = [(t, name) for name, t, err in timings if err is None]
    if not ok:
        autotuning.memory_put(cache.key_id(key), autotuning.FAILED)
        return StrategyTiming(None, "autotuned", tuple(timings))
    best_time, best = min(ok)
    autotuning.memory_put(cache.key_id(key), best)
    entry = cache.make_entry(key, "strategy", {"strategy": best}, median_s=best_time, candidates=len(timings),
                             failed=sum(err is not None for _, _, err in timings),
                             measured="fwd+bwd" if settings.backward else "fwd",
                             timings={name: t for name, t, err in timings if err is None})
    cache.user_store(base.device_kind).put(entry)
    return StrategyTiming(next(s for s in candidates if s.name == best), "autotuned", tuple(timings))


def _time_strategies(op, base, candidates, implementation, settings):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    axes = candidates[0].seq_axes
    axes = axes if isinstance(axes, tuple) else (axes,)
    n = candidates[0].num_shards
    devices = jax.devices(base.platform)
    if len(devices) < n:
        return [(s.name, None, f"needs {n} {base.platform} devices, {len(devices)} here") for s in candidates]
    shape = [candidates[0].head_size, candidates[0].ring_size] if len(axes) == 2 else [n]
    mesh = Mesh(np.array(devices[:n]).reshape(shape), axes)
    args = autotuning.placed_stand_ins(base, mesh, candidates[0].seq_axes, n)
    # every strategy compiled first, then all timed in turn over the rounds (as the config tuner does), so
    # that clocks or a neighbour drifting over the measurement do not favour whichever ran first
    compiled, errors = [], []
    for strategy in candidates:
        try:
            problem = strategy.problem(base)
            reg, impl = registry.choose(op, implementation, problem)
            config = autotuning.select(op, reg, impl, problem, policy="cached").config
            run = functools.partial(spread.run_per_device, strategy, impl, base, config)
            call = calling.Call("global", strategy.seq_axes, strategy.num_shards, mesh)
            step = autotuning.timed_step(run, call, settings.backward)
            compiled.append(jax.jit(step).lower(*args).compile())
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - a strategy that does not compile is skipped
            compiled.append(None)
            errors.append(autotuning.short_error(e))
    measured = autotuning.measure_interleaved(compiled, args, settings)
    return [(s.name, None, err) if err is not None else (s.name, *m)
            for s, err, m in zip(candidates, errors, measured)]

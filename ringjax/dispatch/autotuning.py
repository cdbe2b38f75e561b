"""Which config a call runs with, and the autotuner that measures them.

Selection order for one call (`select`): an explicit `config=` (always honoured),
the in-memory cache, the persistent cache (user store, then configs shipped for
this device kind), autotuning if the policy is "on", and finally the
implementation's heuristic `default_config`. Only measured configs are cached.

Timing never happens inside a trace: candidates are compiled and run in a
worker thread, which starts with a clean trace context, on concrete random
stand-in inputs of the call's per-device shapes placed on a mesh of `axis_size`
devices (ring communication included). If fewer devices are present, the
per-device problem is timed without the ring (axis size 1) as a proxy, and the
entry says so (`"proxy": true`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ringjax.core import invariant
from ringjax.dispatch import cache, registry

POLICIES = ("off", "cached", "on")
ENV_POLICY = "RINGJAX_AUTOTUNE"


def resolve_policy(policy: str | None) -> str:
    """`policy`, else $RINGJAX_AUTOTUNE, else "cached"; ValueError for anything else."""
    if policy is None:
        env = os.environ.get(ENV_POLICY, "").strip().lower()
        if not env:
            return "cached"
        if env not in POLICIES:
            raise ValueError(f"{ENV_POLICY} must be one of {POLICIES}, got {env!r}")
        return env
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"autotune must be one of {POLICIES} or None, got {policy!r}")
    return policy


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    """How candidates are measured."""

    warmup: int = 1  # untimed runs after compiling
    repeats: int = 5  # timed runs; the median is kept
    backward: bool = True  # time forward + backward (training); False: forward only
    progress: bool = True  # tqdm progress bar (if tqdm is installed)
    force: bool = False  # ringjax.autotune(): re-tune problems that already have a cached config
    # calls per timed run, dispatched without a host sync between them as a training step runs them; the time per
    # call is kept (1: each call waited for, which adds the host's dispatch and wait, about 0.2 ms on an H200)
    back_to_back: int = 1
    # the tuner times its candidates in this many rounds, each candidate once per round in turn, and keeps the
    # median of all their runs: the GPU's clocks ramp and drift over minutes, and timed one after another the
    # first candidate ran cold (one H200, 2026-12-02: the heuristic's config, timed first, read 7% slower than one
    # the step benchmark then timed the same)
    rounds: int = 3

    def __post_init__(self):
        for name, least in (("warmup", 0), ("repeats", 1), ("back_to_back", 1), ("rounds", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"TuneSettings.{name} must be an int >= {least}, got {value!r}")
        for name in ("backward", "progress", "force"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TuneSettings.{name} must be a bool, got {getattr(self, name)!r}")


# what policy "on" measures with when a call misses the cache; replace to change it process-wide
ON_USE_SETTINGS = TuneSettings()


@dataclasses.dataclass(frozen=True)
class Selection:
    config: Any
    source: str  # explicit | memory | persistent | shipped | autotuned | heuristic


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """Outcome of tuning one problem."""

    op: str
    implementation: str
    problem: registry.Problem
    config: Any | None  # None: every candidate failed
    median_s: float | None
    timings: tuple[tuple[Any, float | None, str | None], ...]  # (config, median seconds, failure)
    source: str  # autotuned | memory | persistent | shipped (when not re-tuned)


# ---------------------------------------------------------------------------- in-memory cache

_memory: dict[str, Any] = {}  # key id -> config (or FAILED)
_memory_lock = threading.Lock()
FAILED = object()  # tuning ran and no candidate worked: do not retry in this process


def clear_memory_cache() -> None:
    with _memory_lock:
        _memory.clear()


def memory_get(kid: str):
    with _memory_lock:
        return _memory.get(kid)


def memory_put(kid: str, config) -> None:
    with _memory_lock:
        _memory[kid] = config


# ---------------------------------------------------------------------------- recording

_recording = threading.local()


def recorder() -> list | None:
    return getattr(_recording, "problems", None)


# ---------------------------------------------------------------------------- selection


def _from_entry(impl, entry, where: str):
    """The config an entry holds, or None (with one warning) if it no longer fits the implementation."""
    if entry.get("config_type") not in (None, impl.config_type.__name__):
        return None
    try:
        return registry.config_from_json(impl.config_type, entry["config"])
    except (TypeError, ValueError) as e:
        cache._warn_once(cache.user_path(entry["key"].get("device_kind", "")), f"ignoring a {where} entry: {e}")
        return None


def select(op: str, reg, impl, problem: registry.Problem, config=None, policy: str | None = None) -> Selection:
    """The config `impl` runs `problem` with, and where it came from (see module docstring)."""
    policy = resolve_policy(policy)
    if problem.opts.invariant:
        # every kernel call is one granule pair: its config must not change with the ring size
        problem = invariant.pair_problem(problem)
    if config is not None:
        if not isinstance(config, impl.config_type):
            raise TypeError(
                f"config for {impl.name!r} must be a {impl.config_type.__name__}, got {type(config).__name__}"
            )
        return Selection(config, "explicit")
    if policy == "off":
        return Selection(impl.default_config(problem), "heuristic")
    problem = problem.resolved()
    recording = recorder()
    if recording is not None:
        recording.append((op, reg, impl, problem))
    key = cache.cache_key(op, impl.name, problem)
    kid = cache.key_id(key)
    hit = memory_get(kid)
    if hit is not None and hit is not FAILED:
        return Selection(hit, "memory")
    if hit is None:
        found = cache.lookup(op, impl.name, problem)
        if found is not None:
            where, entry = found
            cfg = _from_entry(impl, entry, where)
            if cfg is not None:
                memory_put(kid, cfg)
                return Selection(cfg, where)
        if policy == "on" and recording is None:
            result = tune_problem(op, reg, impl, problem, ON_USE_SETTINGS)
            if result.config is not None:
                return Selection(result.config, "autotuned")
    return Selection(impl.default_config(problem), "heuristic")


def select_config(op: str, reg, impl, problem: registry.Problem, config=None, policy: str | None = None):
    """`select(...).config`."""
    return select(op, reg, impl, problem, config, policy).config


# ---------------------------------------------------------------------------- measuring


def in_worker(fn, *args):
    """Run `fn` in a fresh thread: its trace context is clean even if the caller is tracing."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringjax-autotune") as ex:
        return ex.submit(fn, *args).result()


def _stand_ins(problem: registry.Problem, n: int, seed: int = 0):
    """Random q, k, v (+ segment ids, sinks, output cotangent) of the global shapes for n devices."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(problem.dtype)
    t = problem.seq * n
    q = rng.standard_normal((problem.batch, t, problem.heads, problem.head_dim)).astype(dtype)
    k = rng.standard_normal((problem.batch, t, problem.kv_heads, problem.head_dim)).astype(dtype)
    v = rng.standard_normal((problem.batch, t, problem.kv_heads, problem.v_head_dim)).astype(dtype)
    seg = None
    if problem.opts.has_segments:  # four documents: some blocks skip, most do not
        seg = np.broadcast_to((np.arange(t) * 4 // t).astype(np.int32), (problem.batch, t)).copy()
    sinks = rng.standard_normal((problem.heads,)).astype(np.float32) if problem.opts.has_sinks else None
    w = rng.standard_normal((problem.batch, t, problem.heads, problem.v_head_dim)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.5, (problem.heads,)).astype(np.float32) if problem.opts.has_alibi else None
    seed = rng.integers(0, 2**32, (2,), dtype=np.uint32) if problem.opts.dropout_rate else None
    return q, k, v, seg, sinks, w, slopes, seed


def _call_of(problem: registry.Problem, mesh):
    """How a tuning run places its stand-ins: over the problem's ring axis of `mesh`, or one device."""
    from ringjax.dispatch import calling

    if mesh is None:
        return calling.Call("single", None, 1)
    return calling.Call("global", problem.opts.axis_name, problem.opts.axis_size, mesh)


def timed_step(run, call, backward: bool):
    """A jittable f(q, k, v, seg, sinks, w, slopes, seed) that runs `run(q, k, v, seg, sinks, extras)`
    on each device's shards of global stand-ins placed by `call` (a `calling.Call`)."""
    import jax
    import jax.numpy as jnp

    from ringjax.core.masks import Extras
    from ringjax.dispatch import calling

    def per_device(q, k, v, seg, sinks, slopes, seed):
        return run(q, k, v, seg, sinks, Extras(alibi_slopes=slopes, dropout_seed=seed))

    roles = (calling.TOKENS, calling.TOKENS, calling.TOKENS, calling.SEQ, calling.HEADS, calling.HEADS,
             calling.REPLICATED)

    def step(q, k, v, seg, sinks, w, slopes, seed):
        def attn(q, k, v, seg, sinks, slopes, seed):
            return calling.run(call, per_device, (q, k, v, seg, sinks, slopes, seed), roles,
                               (calling.TOKENS, calling.LSE))

        if not backward:
            return attn(q, k, v, seg, sinks, slopes, seed)

        def loss(q, k, v):
            return jnp.sum(attn(q, k, v, seg, sinks, slopes, seed)[0].astype(jnp.float32) * w)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return step


def measure(compiled, args, settings: TuneSettings) -> float:
    """Median seconds per call of `repeats` timed runs of `back_to_back` calls each, after `warmup` calls."""
    _warm(compiled, args, settings)
    return statistics.median(_timed_runs(compiled, args, settings))


def _warm(compiled, args, settings: TuneSettings) -> None:
    import jax

    for _ in range(settings.warmup):
        jax.block_until_ready(compiled(*args))


def _timed_runs(compiled, args, settings: TuneSettings) -> list[float]:
    """Seconds per call of `repeats` timed runs of `back_to_back` calls each."""
    import jax

    times = []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        jax.block_until_ready([compiled(*args) for _ in range(settings.back_to_back)])
        times.append((time.perf_counter() - start) / settings.back_to_back)
    return times


def measure_interleaved(compiled: Sequence, args, settings: TuneSettings,
                        bar=None) -> list[tuple[float | None, str | None]]:
    """(median seconds per call, None) or (None, error) for each of `compiled` (None: did not compile; left
    out): every one warmed up, then timed `repeats` runs per round in `rounds` rounds, in turn, so that what
    drifts over the measurement spreads over all of them; a candidate that fails at run time leaves."""
    runs: list[list[float]] = [[] for _ in compiled]
    errors: list[str | None] = [None] * len(compiled)
    for round_ in range(-1, settings.rounds):  # round -1: the warm-up
        if bar is not None:
            bar.set_postfix_str("warm-up" if round_ < 0 else f"round {round_ + 1}/{settings.rounds}")
        for i, fn in enumerate(compiled):
            if fn is None or errors[i] is not None:
                continue
            try:
                if round_ < 0:
                    _warm(fn, args, settings)
                else:
                    runs[i] += _timed_runs(fn, args, settings)
            except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED at run time
                errors[i] = "run: " + short_error(e)
    return [(None, err) if err is not None else (statistics.median(r) if r else None, None)
            for r, err in zip(runs, errors)]


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def placed_stand_ins(problem: registry.Problem, mesh, seq_axes, n: int):
    """`_stand_ins` for n devices, the sequence sharded over `seq_axes` of `mesh`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    q, k, v, seg, sinks, w, slopes, seed = _stand_ins(problem, n)
    spec = NamedSharding(mesh, P(None, seq_axes))
    rep = NamedSharding(mesh, P())
    return (jax.device_put(q, spec), jax.device_put(k, spec), jax.device_put(v, spec),
            None if seg is None else jax.device_put(seg, spec),
            None if sinks is None else jax.device_put(sinks, rep), jax.device_put(w, spec),
            None if slopes is None else jax.device_put(slopes, rep),
            None if seed is None else jax.device_put(seed, rep))


def _tune_outside_trace(impl, problem: registry.Problem, settings: TuneSettings, bar):
    """Time every candidate; runs in a worker thread. Returns (timings, devices, proxy)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    n = problem.opts.axis_size
    devices = jax.devices(problem.platform)
    proxy = False
    run_problem = problem
    mesh = None
    if problem.opts.axis_name is not None and len(devices) >= n:  # a ring, even of one, needs its axis bound
        mesh = Mesh(np.array(devices[:n]), (problem.opts.axis_name,))
    elif problem.opts.axis_name is not None:  # not enough devices for the ring: time the per-device work alone
        proxy = True
        opts = dataclasses.replace(problem.opts, axis_size=1, axis_name=None)
        run_problem = dataclasses.replace(problem, opts=opts)
        n = 1
    if mesh is not None:
        args = placed_stand_ins(run_problem, mesh, problem.opts.axis_name, n)
    else:
        args = tuple(None if a is None else jax.device_put(a, devices[0]) for a in _stand_ins(run_problem, n))
    candidates = impl.candidate_configs(run_problem)
    compiled, compile_errors = _compile_all(
        [functools.partial(registry.run_per_device, impl, run_problem, c) for c in candidates],
        _call_of(run_problem, mesh), args, settings, bar, first_call=n == 1)
    measured = measure_interleaved(compiled, args, settings, bar)
    timings = [(c, None, why) if why is not None else (c, *m)
               for c, why, m in zip(candidates, compile_errors, measured)]
    return timings, n, proxy


def _compile_all(runs: Sequence, call, args, settings: TuneSettings, bar,
                 first_call: bool) -> tuple[list, list[str | None]]:
    """Each candidate's timed step compiled, or None and why not. Tracing and lowering hold the GIL, so they go
    one by one; compiling, and with `first_call` (one device) the first call, where kernels such as Mosaic
    GPU's are built, run in threads, so that a machine's cores build several candidates at once. Calls over
    several devices stay in one thread: two rings launched at once could wait on each other's collectives."""
    import jax

    lowered: list = []
    errors: list[str | None] = []
    for run in runs:
        try:
            lowered.append(jax.jit(timed_step(run, call, settings.backward)).lower(*args))
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - a candidate that does not lower is skipped
            lowered.append(None)
            errors.append("compile: " + short_error(e))

    def build(low):
        try:
            fn = low.compile()
        except Exception as e:  # noqa: BLE001 - e.g. shared memory exceeded
            return None, "compile: " + short_error(e)
        try:
            if first_call:
                jax.block_until_ready(fn(*args))
        except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED
            return None, "run: " + short_error(e)
        return fn, None

    compiled: list = [None] * len(runs)
    workers = max(1, min(len(runs), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ringjax-compile") as ex:
        futures = {ex.submit(build, low): i for i, low in enumerate(lowered) if low is not None}
        for future in concurrent.futures.as_completed(futures):
            compiled[futures[future]], errors[futures[future]] = future.result()
            if bar is not None:  # the bar counts built candidates; the rounds show in its postfix
                bar.update(1)
    if bar is not None:
        bar.update(sum(low is None for low in lowered))
    return compiled, errors


@contextlib.contextmanager
def _progress(total: int, enabled: bool, desc: str):
    if not enabled or total == 0:
        yield None
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is optional (pip install ringjax[tune])
        yield None
        return
    bar = tqdm(total=total, desc=desc, unit="config", leave=False)
    try:
        yield bar
    finally:
        bar.close()


def tune_problem(op: str, reg, impl, problem: registry.Problem, settings: TuneSettings | None = None,
                 *, bar=None) -> TuneResult:
    """Measure every candidate config of `impl` for `problem` and cache the fastest.

    Safe to call while tracing: the measurement runs in a worker thread on
    concrete stand-in inputs. Writes the in-memory and the persistent cache; if
    no candidate works, warns once and remembers that in memory only.
    """
    settings = settings or TuneSettings()
    problem = problem.resolved()
    key = cache.cache_key(op, impl.name, problem)
    kid = cache.key_id(key)
    with contextlib.ExitStack() as stack:
        if bar is None:
            total = len(impl.candidate_configs(problem))
            bar = stack.enter_context(_progress(total, settings.progress, f"ringjax autotune {impl.name}"))
        timings, devices, proxy = in_worker(_tune_outside_trace, impl, problem, settings, bar)
    ok = [(t, c) for c, t, err in timings if err is None]
    if not ok:
        memory_put(kid, FAILED)
        reasons = "; ".join(f"{c}: {err}" for c, _, err in timings) or "no candidate configs"
        warnings.warn(f"ringjax autotune: no config of {impl.name!r} ran for {problem}: {reasons}; "
                      "using the heuristic config", RuntimeWarning, stacklevel=2)
        return TuneResult(op, impl.name, problem, None, None, tuple(timings), "autotuned")
    best_time, best = min(ok, key=lambda tc: tc[0])
    memory_put(kid, best)
    entry = cache.make_entry(
        key,
        impl.config_type.__name__,
        registry.config_to_json(best),
        median_s=best_time,
        candidates=len(timings),
        failed=sum(err is not None for _, _, err in timings),
        measured="fwd+bwd" if settings.backward else "fwd",
        devices=devices,
        proxy=proxy,
    )
    cache.user_store(problem.device_kind).put(entry)
    return TuneResult(op, impl.name, problem, best, best_time, tuple(timings), "autotuned")


# ---------------------------------------------------------------------------- ahead of time

_retrace_context = None
_retrace_lock = threading.Lock()


def _fresh_trace_context():
    """A jax user context whose fresh value makes jit caches miss, so fn's Python runs again."""
    global _retrace_context
    import jax

    with _retrace_lock:
        if _retrace_context is None:
            _retrace_context = jax.make_user_context(None)
    return _retrace_context(object())


def collect_problems(fn: Callable, *args, **kwargs) -> list[tuple[str, Any, Any, registry.Problem]]:
    """Every distinct (op, registration, implementation, problem) that tracing `fn(*args, **kwargs)` selects.

    `fn` is traced abstractly (`jax.eval_shape`) under a fresh jit-cache context, so
    nested jitted functions are traced again and nothing computed here is reused
    by later real calls. Calls with an explicit `config=` are not collected.
    """
    import jax

    if recorder() is not None:
        raise RuntimeError("ringjax.autotune cannot be nested")
    _recording.problems = found = []
    try:
        with _fresh_trace_context():
            jax.eval_shape(fn, *args, **kwargs)
    finally:
        _recording.problems = None
    unique = {}
    for op, reg, impl, problem in found:
        unique.setdefault(cache.key_id(cache.cache_key(op, impl.name, problem)), (op, reg, impl, problem))
    return list(unique.values())


def autotune(fn: Callable, *args, autotune_settings: TuneSettings | None = None, **kwargs) -> list[TuneResult]:
    """Tune every ring_attention call inside `fn(*args, **kwargs)` ahead of time.

    `args` may be arrays or `jax.ShapeDtypeStruct`s (with shardings where `fn`
    needs them, and under the same `jax.set_mesh` as the real call). Problems that
    already have a cached config are skipped unless `autotune_settings.force`.
    Call this before the first call of a jitted `fn`: jax keeps the trace, and
    with it the configs, that an earlier call chose.
    """
    settings = TuneSettings() if autotune_settings is None else autotune_settings
    if not isinstance(settings, TuneSettings):
        raise TypeError(f"autotune_settings must be a TuneSettings, got {type(settings).__name__}")
    problems = collect_problems(fn, *args, **kwargs)
    results = []
    todo = []
    for op, reg, impl, problem in problems:
        if not settings.force:
            sel = select(op, reg, impl, problem, policy="cached")
            if sel.source != "heuristic":
                results.append(TuneResult(op, impl.name, problem, sel.config, None, (), sel.source))
                continue
        todo.append((op, reg, impl, problem))
    total = sum(len(impl.candidate_configs(problem)) for _, _, impl, problem in todo)
    with _progress(total, settings.progress, "ringjax autotune") as bar:
        for op, reg, impl, problem in todo:
            results.append(tune_problem(op, reg, impl, problem, settings, bar=bar))
    return results


def tune_shapes(
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int | None = None,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype: str = "bfloat16",
    axis_size: int = 1,
    implementation: str = "auto",
    op: str = "ring_attention",
    settings: TuneSettings | None = None,
    **features,
) -> TuneResult:
    """Tune one problem given by global shapes (`seq` is the whole sequence, split `axis_size` ways);
    `v_head_dim` is v's head_dim (None: head_dim).

    `features` are those of `ringjax.options.TUNABLE`: the static feature keywords of `ring_attention`
    (causal, sliding_window, chunk_size, dropout_rate, num_sink_tokens, ...) and, for its arrays, bools
    (segments, sinks, alibi); the dropout key follows dropout_rate. A float32 problem takes jax's matmul
    precision now (`jax.default_matmul_precision(...)` around this call tunes that precision).
    """
    import jax.numpy as jnp

    from ringjax.core import precision
    from ringjax.options import TUNABLE, check_keywords, make_options, sequence_chunks

    arrays = {kw.name: f"it takes no arrays; pass {flag}=True" for flag, kw in TUNABLE.items() if flag != kw.name}
    check_keywords("tune_shapes", features, TUNABLE, hints=arrays)
    kv_heads = heads if kv_heads is None else kv_heads
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    for name, value in (("batch", batch), ("seq", seq), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("v_head_dim", v_head_dim), ("axis_size", axis_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    opts = make_options(head_dim, axis_name="sp" if axis_size > 1 else None, axis_size=axis_size,
                        **{TUNABLE[name].option_name: value for name, value in features.items()})
    chunks = sequence_chunks(opts.layout, axis_size)
    if seq % chunks:
        raise ValueError(f"seq ({seq}) must be divisible by {chunks} for axis_size {axis_size} and layout "
                         f"{opts.layout!r}")
    problem = registry.Problem(
        opts=opts,
        batch=batch,
        seq=seq // axis_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=str(jnp.dtype(dtype)),
        platform=registry.current_platform(),
        precision=precision.current(dtype),
    ).resolved()
    reg, impl = registry.choose(op, implementation, problem)
    return tune_problem(op, reg, impl, problem, settings)

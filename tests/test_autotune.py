"""Config selection order, autotuning (in jit, eager, ahead of time), cache reuse across processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.xla import XlaConfig
from ringjax.backends.xla.implementation import XlaImplementation
from ringjax.dispatch import autotuning, cache, registry
from ringjax.options import AttentionOptions

from harness import check_against_reference, make_inputs, mesh_of, reference_for, rel_err, run_ring

ROOT = Path(__file__).resolve().parents[1]
BROKEN = object()  # a candidate that fails while compiling (it has no block sizes)
QUICK = autotuning.TuneSettings(warmup=1, repeats=2, backward=False, progress=False, rounds=1)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RINGJAX_AUTOTUNE", raising=False)
    monkeypatch.setattr(cache, "_warned", set())
    monkeypatch.setattr(autotuning, "ON_USE_SETTINGS", QUICK)
    autotuning.clear_memory_cache()
    yield tmp_path / "cache"
    autotuning.clear_memory_cache()


@pytest.fixture
def candidates(monkeypatch):
    """Make the XLA implementation offer the given candidates (tiny shapes have only one otherwise)."""

    def use(*configs):
        monkeypatch.setattr(XlaImplementation, "candidate_configs", lambda self, problem: list(configs))

    return use


@pytest.fixture
def measured(monkeypatch):
    """Record what every candidate's first timed runs receive, and whether a trace was active around them (one
    record per compiled candidate, whatever `TuneSettings.rounds`)."""
    calls, seen = [], set()
    original = autotuning._timed_runs

    def spy(compiled, args, settings):
        if id(compiled) not in seen:
            seen.add(id(compiled))
            leaves = jax.tree.leaves(args)
            calls.append({
                "tracer_args": any(isinstance(a, jax.core.Tracer) for a in leaves),
                "concrete_args": all(isinstance(a, jax.Array) for a in leaves),
                "tracing": isinstance(jnp.zeros(()), jax.core.Tracer),  # true inside any trace of this thread
                "compiled": compiled,  # held, so that its id stays its own
            })
        return original(compiled, args, settings)

    monkeypatch.setattr(autotuning, "_timed_runs", spy)
    return calls


@pytest.fixture
def sources(monkeypatch):
    """Sources of every config selection made by ring_attention."""
    seen = []
    original = autotuning.select

    def spy(*args, **kwargs):
        selection = original(*args, **kwargs)
        seen.append(selection.source)
        return selection

    monkeypatch.setattr(autotuning, "select", spy)
    return seen


def _problem(**opts):
    return registry.Problem(opts=AttentionOptions(**opts), batch=1, seq=16, heads=2, kv_heads=1, head_dim=8,
                            dtype="float32", platform="cpu")


def _no_tuning(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("must not tune")

    monkeypatch.setattr(autotuning, "_tune_outside_trace", fail)


def test_selection_order(isolated, monkeypatch):
    p = _problem()
    reg, impl = registry.choose("ring_attention", "auto", p)
    heuristic = impl.default_config(p)

    def select(config=None, policy=None):
        s = autotuning.select("ring_attention", reg, impl, p, config, policy)
        return s.source, s.config

    assert select() == ("heuristic", heuristic)
    assert not isolated.exists()  # a heuristic is never written
    store = cache.user_store("cpu")
    key = cache.cache_key("ring_attention", "xla", p.resolved())
    store.put(cache.make_entry(key, "XlaConfig", {"block_q": 8, "block_kv": 16}))
    assert select() == ("persistent", XlaConfig(8, 16))
    assert select() == ("memory", XlaConfig(8, 16))
    store.put(cache.make_entry(key, "XlaConfig", {"block_q": 16, "block_kv": 8}))
    assert select() == ("memory", XlaConfig(8, 16))  # memory comes before the file
    before = (isolated / "cpu.json").read_text()
    assert select(XlaConfig(4, 4)) == ("explicit", XlaConfig(4, 4))  # always honoured ...
    assert select(XlaConfig(4, 4), "on") == ("explicit", XlaConfig(4, 4))
    assert (isolated / "cpu.json").read_text() == before  # ... and never cached
    assert select(policy="off") == ("heuristic", heuristic)
    monkeypatch.setenv("RINGJAX_AUTOTUNE", "off")
    assert select() == ("heuristic", heuristic)
    assert select(policy="cached") == ("memory", XlaConfig(8, 16))  # the argument beats the environment
    monkeypatch.setenv("RINGJAX_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="RINGJAX_AUTOTUNE must be one of"):
        select()
    monkeypatch.delenv("RINGJAX_AUTOTUNE")
    autotuning.clear_memory_cache()
    _no_tuning(monkeypatch)
    assert select(policy="on") == ("persistent", XlaConfig(16, 8))  # cached: "on" does not re-tune
    # an entry that no longer fits the config type is ignored with a warning
    other = cache.cache_key("ring_attention", "xla", _problem(causal=True).resolved())
    store.put(cache.make_entry(other, "XlaConfig", {"block_q": -1, "block_kv": 8}))
    with pytest.warns(RuntimeWarning, match="ignoring a persistent entry"):
        s = autotuning.select("ring_attention", reg, impl, _problem(causal=True), None, "cached")
    assert s.source == "heuristic"


def test_tuning_inside_jit_times_no_tracers_and_stays_exact(isolated, candidates, measured):
    """autotune="on" while jit traces: concrete stand-ins are timed outside the trace; results stay exact."""
    candidates(XlaConfig(8, 16), XlaConfig(16, 8), BROKEN)
    x = make_inputs(11, batch=1, seq=32, heads=2, kv_heads=1, head_dim=8)
    got = run_ring(x, 2, causal=True, autotune="on", implementation="xla")
    check_against_reference(got, reference_for(x, causal=True), "float32")
    assert len(measured) == 2  # BROKEN never got past compiling
    assert all(c["concrete_args"] and not c["tracer_args"] and not c["tracing"] for c in measured)
    # the ring ran on the default backend's devices: its device kind's store ("cpu", "NVIDIA H200", ...)
    entries = list(cache.user_store(registry.current_device_kind()).entries().values())
    assert len(entries) == 1
    entry = entries[0]
    assert entry["config"] in ({"block_q": 8, "block_kv": 16}, {"block_q": 16, "block_kv": 8})
    assert entry["candidates"] == 3 and entry["failed"] == 1 and entry["devices"] == 2 and not entry["proxy"]
    assert entry["key"]["axis_size"] == 2 and entry["key"]["shape"]["seq"] == 16 and entry["measured"] == "fwd"


def test_eager_on_tunes_on_first_use(candidates, measured, sources):
    candidates(XlaConfig(4, 8), XlaConfig(8, 4))
    x = make_inputs(12, batch=1, seq=16, heads=2, kv_heads=1, head_dim=8)
    q, k, v = (jnp.asarray(x[n]) for n in ("q", "k", "v"))
    out = ringjax.ring_attention(q, k, v, axis_name=None, autotune="on", causal=True)
    assert sources == ["autotuned"] and len(measured) == 2 and not measured[0]["tracing"]
    assert rel_err(out, reference_for(x, causal=True)["out"]) < 1e-5
    ringjax.ring_attention(q, k, v, axis_name=None, autotune="on", causal=True)
    assert sources == ["autotuned", "memory"] and len(measured) == 2


def test_no_working_candidate_falls_back(candidates, sources, isolated):
    candidates(BROKEN)
    x = make_inputs(13, batch=1, seq=16, heads=2, kv_heads=1, head_dim=8)  # shapes as above: eager ops reused
    q, k, v = (jnp.asarray(x[n]) for n in ("q", "k", "v"))
    with pytest.warns(RuntimeWarning, match="no config of 'xla' ran"):
        out = ringjax.ring_attention(q, k, v, axis_name=None, autotune="on", causal=True)
    assert rel_err(out, reference_for(x, causal=True)["out"]) < 1e-5
    # remembered: no second attempt, no second warning
    ringjax.ring_attention(q, k, v, axis_name=None, autotune="on", causal=True)
    assert sources == ["heuristic", "heuristic"] and not isolated.exists()


def test_autotune_ahead_of_time(candidates, measured, sources, monkeypatch):
    """ringjax.autotune traces a jitted function, tunes each ring_attention in it, and its first call uses them."""
    candidates(XlaConfig(4, 8), XlaConfig(8, 4))
    mesh = mesh_of(2)
    spec = P(None, "sp")

    def body(q, k, v):
        a = ringjax.ring_attention(q, k, v, axis_name="sp", causal=True)
        b = ringjax.ring_attention(q, k, v, axis_name="sp", sliding_window=3)
        c = ringjax.ring_attention(q, k, v, axis_name="sp", causal=True)  # same problem as `a`
        return a + b + c

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    x = make_inputs(14, batch=1, seq=16, heads=2, kv_heads=1, head_dim=8)
    q, k, v = (jax.device_put(jnp.asarray(x[n]), NamedSharding(mesh, spec)) for n in ("q", "k", "v"))
    with jax.set_mesh(mesh):
        results = ringjax.autotune(fn, q, k, v, autotune_settings=QUICK)
        assert [r.source for r in results] == ["autotuned", "autotuned"] and len(measured) == 4
        assert {r.problem.opts.causal for r in results} == {True, False}
        assert not any(c["tracing"] or c["tracer_args"] for c in measured)
        sources.clear()
        fn(q, k, v)
        assert sources == ["memory"] * 3  # the recording trace was not reused by the real call
        _no_tuning(monkeypatch)
        assert [r.source for r in ringjax.autotune(fn, q, k, v, autotune_settings=QUICK)] == ["memory"] * 2


CHILD = textwrap.dedent("""
    import json
    import jax.numpy as jnp, numpy as np
    import ringjax
    from ringjax.dispatch import autotuning
    def no_tuning(*a, **k):
        raise AssertionError("tuned again in a new process")
    autotuning._tune_outside_trace = no_tuning
    seen = []
    original = autotuning.select
    def spy(*a, **k):
        s = original(*a, **k)
        seen.append((s.source, ringjax.config_to_json(s.config)))
        return s
    autotuning.select = spy
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 16, 1, 8)), jnp.float32)
    ringjax.ring_attention(q, kv, kv, axis_name=None, autotune="on")
    print(json.dumps(seen))
""")


@pytest.mark.matmul_precision(None)  # the child process and the CLI key the cache at jax's own precision
def test_cache_hit_across_processes(candidates):
    candidates(XlaConfig(4, 8), XlaConfig(8, 4))
    result = autotuning.tune_shapes(batch=1, seq=16, heads=2, kv_heads=1, head_dim=8, dtype="float32",
                                    settings=QUICK)
    assert result.config in (XlaConfig(4, 8), XlaConfig(8, 4)) and result.source == "autotuned"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == [["persistent", ringjax.config_to_json(result.config)]]


@pytest.mark.parametrize("axis_size, devices, proxy", [(1, 1, False), (2 * len(jax.devices("cpu")), 1, True)],
                         ids=["ring-of-one", "ring-larger-than-host"])
def test_ring_sizes(candidates, axis_size, devices, proxy):
    """A ring of one still binds its axis; a ring larger than the host is timed per device as a proxy."""
    candidates(XlaConfig(8, 8))
    p = _problem(axis_name="sp", axis_size=axis_size)
    reg, impl = registry.choose("ring_attention", "auto", p)
    result = autotuning.tune_problem("ring_attention", reg, impl, p, QUICK)
    assert result.config == XlaConfig(8, 8), result.timings
    entry = cache.lookup("ring_attention", "xla", p.resolved())[1]
    assert entry["proxy"] is proxy and entry["devices"] == devices and entry["key"]["axis_size"] == axis_size


def test_tune_settings_validated():
    with pytest.raises(ValueError, match="repeats"):
        autotuning.TuneSettings(repeats=0)
    with pytest.raises(TypeError, match="backward must be a bool"):
        autotuning.TuneSettings(backward=1)
    with pytest.raises(ValueError, match="back_to_back must be an int >= 1"):
        autotuning.TuneSettings(back_to_back=0)
    with pytest.raises(ValueError, match="rounds must be an int >= 1"):
        autotuning.TuneSettings(rounds=0)
    with pytest.raises(TypeError, match="TuneSettings"):
        ringjax.autotune(lambda: None, autotune_settings={"repeats": 3})
    for empty in (0, {}):  # falsy, not None: not quietly the defaults
        with pytest.raises(TypeError, match="autotune_settings must be a TuneSettings"):
            ringjax.autotune(lambda: None, autotune_settings=empty)


@pytest.mark.matmul_precision(None)  # the child process and the CLI key the cache at jax's own precision
def test_cli_tune(candidates, capsys, monkeypatch):
    from ringjax.__main__ import main

    candidates(XlaConfig(8, 8), BROKEN)
    used = []
    original = autotuning.measure_interleaved
    monkeypatch.setattr(autotuning, "measure_interleaved", lambda *a, **k: used.append(a[2]) or original(*a, **k))
    argv = ["tune", "--batch", "1", "--seq", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
            "--axis-size", "2", "--causal", "--dtype", "float32", "--forward-only", "--repeats", "1", "--no-progress",
            "--rounds", "2", "--back-to-back", "3"]
    assert main(argv) == 0
    assert [(s.repeats, s.rounds, s.back_to_back, s.backward) for s in used] == [(1, 2, 3, False)]
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out and "ring of 2" in out and "compile: AttributeError" in out
    assert 'best: {"block_kv": 8, "block_q": 8}' in out
    tuned = dataclasses.replace(_problem(causal=True, axis_name="sp", axis_size=2), platform=jax.default_backend())
    assert cache.lookup("ring_attention", "xla", tuned.resolved())


def test_candidates_are_timed_in_turn_over_rounds():
    """Every candidate warmed up, then `repeats` runs of each in turn per round; the median over all rounds
    kept; one that fails at run time leaves with its error, one that did not compile (None) is not called."""
    calls = []

    def candidate(name, fail_on=None):
        def compiled(x):
            calls.append(name)
            if fail_on is not None and calls.count(name) == fail_on:
                raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
            return jnp.sin(jnp.asarray(x))
        return compiled

    settings = autotuning.TuneSettings(warmup=1, repeats=2, rounds=3)
    out = autotuning.measure_interleaved([candidate("a"), None, candidate("b", fail_on=4)], (1.0,), settings)
    # warm-up a, b; round 1 a a b b; round 2 a a b (b fails on its 4th call); round 3 a a
    assert calls == ["a", "b", "a", "a", "b", "b", "a", "a", "b", "a", "a"]
    assert out[0][0] > 0 and out[0][1] is None
    assert out[1] == (None, None)
    assert out[2][0] is None and out[2][1].startswith("run: RuntimeError: RESOURCE_EXHAUSTED")


def test_measure_times_calls_back_to_back():
    """`back_to_back` calls per timed run, one wait for them all, the time per call kept."""
    calls = []

    def compiled(x):
        calls.append(x)
        return jnp.sin(jnp.asarray(x))

    seconds = autotuning.measure(compiled, (1.0,), autotuning.TuneSettings(warmup=2, repeats=3, back_to_back=4))
    assert len(calls) == 2 + 3 * 4 and seconds > 0


def test_candidates_build_in_threads_in_order(monkeypatch):
    """`_compile_all` keeps the candidates' order whatever order the threads finish in; a candidate that does
    not lower says "compile:", one whose first call fails (on one device, built by that call) says "run:"."""
    monkeypatch.setattr(autotuning, "timed_step", lambda run, call, backward: run)

    def fails_at_run(x):
        def boom(v):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return jax.pure_callback(boom, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def fails_to_lower(x):
        raise ValueError("no such tile")

    runs = [lambda x: jnp.sin(x), fails_to_lower, fails_at_run, lambda x: jnp.cos(x) * 2]
    args = (jnp.arange(4.0),)
    compiled, errors = autotuning._compile_all(runs, None, args, autotuning.TuneSettings(), None, first_call=True)
    assert errors[0] is None and errors[3] is None
    assert errors[1].startswith("compile: ValueError: no such tile") and compiled[1] is None
    assert errors[2].startswith("run: ") and compiled[2] is None
    np.testing.assert_allclose(compiled[0](*args), np.sin(np.arange(4.0)), rtol=1e-6)
    np.testing.assert_allclose(compiled[3](*args), 2 * np.cos(np.arange(4.0)), rtol=1e-6)
    compiled, errors = autotuning._compile_all(runs, None, args, autotuning.TuneSettings(), None, first_call=False)
    assert errors[2] is None and compiled[2] is not None  # over several devices the first call waits for the rounds

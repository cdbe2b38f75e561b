"""The Pallas TPU kernels, run by the Pallas TPU interpreter on CPU, against the float64 reference.

The interpreter is slow (every grid step of every kernel is simulated), so this is a
representative matrix, not the full product: each case combines several features,
and together they cover 1, 2, 4 and 8 devices, the three layouts, causal, windows,
segments with padding, soft cap, sinks, GQA/MQA, float32 and bfloat16, and tiles
that split each shard into several blocks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax import _compat
from ringjax.core.masks import Extras
from ringjax.dispatch import registry
from ringjax.options import AttentionOptions

from harness import check_against_reference, child_env, make_inputs, mesh_of, reference_for, run_ring

pytest.importorskip("jax.experimental.pallas.tpu", reason="this jax has no Pallas TPU module")

from ringjax.backends.pallas_tpu.implementation import (  # noqa: E402
    IMPLEMENTATION,
    INTERPRET_IMPLEMENTATION,
    TpuConfig,
    xla_cpu_threads,
)
from ringjax.backends.pallas_tpu.kernels import races_found, reset_interpreter  # noqa: E402

# pallas_tpu_interpret is registered for CPU only; on a GPU machine these are left to the CPU run
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the Pallas TPU interpreter runs on CPU")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # the interpreter keeps global state (simulated memory, race log) between kernels
    reset_interpreter()
    yield
    reset_interpreter()


def _too_few_threads(n):
    """Why the interpreter refuses n devices in this process for want of XLA CPU threads, or None."""
    threads, source = xla_cpu_threads(len(jax.devices("cpu")))
    if n > 1 and threads < 2 * n:
        return f"the interpreter on {n} devices needs {2 * n} XLA CPU threads, {threads} here ({source})"
    return None


def _in_a_process_with_threads(test, threads):
    """Run one test of this file in a fresh process whose XLA CPU client has `threads` threads
    (the client sizes its pool once, when jax starts; more threads here would slow every other test)."""
    if os.environ.get("RINGJAX_TEST_THREADS_CHILD"):
        pytest.fail(f"PJRT_NPROC={threads} did not give the interpreter its threads")
    env = dict(os.environ, PJRT_NPROC=str(threads), RINGJAX_TEST_THREADS_CHILD="1")
    env.pop("NPROC", None)
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"],
                           capture_output=True, text=True, env=env, timeout=600)
    assert child.returncode == 0, f"exit status {child.returncode}:\n{child.stdout[-3000:]}\n{child.stderr[-2000:]}"
    assert "1 passed" in child.stdout, child.stdout[-3000:]


def _config(**kw):
    kw.setdefault("block_q", 8)
    kw.setdefault("block_kv", 8)
    return TpuConfig(interpret=True, **kw)


# (devices, layout, make_inputs kwargs, ring_attention kwargs)
CASES = {
    "1dev_gqa_multiblock": (1, "contiguous", dict(seq=32, heads=4, kv_heads=2), dict()),
    "2dev_zigzag_causal_segments": (2, "zigzag", dict(seq=64, segments="random"), dict(causal=True)),
    # per-document chunks, run as segments numbering (document, chunk) pairs
    "2dev_striped_chunked_documents": (2, "striped", dict(seq=64, segments="random"), dict(causal=True, chunk_size=5)),
    # chunks without documents: ids position // chunk_size, as segments (kernels.chunks_as_segments); 4 shards of
    # 16, chunks of 12 (so the ring plan skips none) and of 16 (it runs 2 of 4 steps)
    "4dev_zigzag_chunked_causal_gqa": (
        4, "zigzag", dict(seq=64, heads=4, kv_heads=2), dict(causal=True, chunk_size=12)
    ),
    "4dev_contiguous_chunked_skips_steps": (4, "contiguous", dict(seq=64, batch=1), dict(causal=True, chunk_size=16)),
    "1dev_chunked_bidirectional": (1, "contiguous", dict(seq=32, dtype="bfloat16"), dict(chunk_size=6)),
    # ALiBi: a slope per query head (a column over the G heads of a tile's rows), its gradient summed in dQ's kernel
    "2dev_zigzag_alibi_gqa_window": (
        2, "zigzag", dict(seq=64, heads=4, kv_heads=2, alibi=True), dict(causal=True, sliding_window=20)
    ),
    "1dev_alibi_bidirectional_softcap_bf16": (
        1, "contiguous", dict(seq=32, alibi=True, dtype="bfloat16"), dict(logits_soft_cap=3.0)
    ),
    "4dev_striped_alibi_segments_sinks": (
        4, "striped", dict(seq=64, batch=1, alibi=True, sinks=True, segments="random"), dict(causal=True)
    ),
    # dropout: the shared counter-based hash on each tile's positions, a key per (batch row, query head)
    "2dev_zigzag_dropout_gqa": (2, "zigzag", dict(seq=64, dropout_key=7), dict(causal=True, dropout_rate=0.3)),
    "1dev_dropout_alibi_segments_bf16": (
        1, "contiguous", dict(seq=32, dropout_key=11, alibi=True, segments="random", dtype="bfloat16"),
        dict(dropout_rate=0.2)
    ),
    # sink tokens: in every step's mask (one device, a two-sided window), and as the ring's own sink step where a
    # window shortens it (4 shards of 16, window 10: 2 of 4 steps, then the first 64 tokens' sink step)
    "1dev_sinks_two_sided_window_bf16": (
        1, "contiguous", dict(seq=32, dtype="bfloat16"), dict(sliding_window=(5, 3), num_sink_tokens=2)
    ),
    "4dev_contiguous_sinks_window_shortened": (
        4, "contiguous", dict(seq=64, batch=1), dict(causal=True, sliding_window=10, num_sink_tokens=3)
    ),
    # sink tokens of packed documents: each document's first tokens, from any shard (ids carry the flag)
    "2dev_zigzag_sinks_of_documents_window": (
        2, "zigzag", dict(seq=64, segments="random"), dict(causal=True, sliding_window=10, num_sink_tokens=2)
    ),
    "4dev_contiguous_sinks_of_documents_gqa_bf16": (
        4, "contiguous", dict(seq=64, heads=4, kv_heads=2, segments="random", dtype="bfloat16"),
        dict(causal=True, sliding_window=(6, 0), num_sink_tokens=3)
    ),
    "4dev_striped_mqa_softcap_sinks": (
        4, "striped", dict(seq=32, batch=1, heads=2, kv_heads=1, sinks=True), dict(causal=True, logits_soft_cap=2.0)
    ),
    "4dev_contiguous_window_skips_steps": (
        4, "contiguous", dict(seq=64, batch=1), dict(causal=True, sliding_window=10)
    ),
    "8dev_zigzag_causal": (8, "zigzag", dict(seq=128, batch=1, heads=2, kv_heads=1), dict(causal=True)),
}


@on_cpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case):
    n, layout, shape_kw, kw = CASES[case]
    if _too_few_threads(n):  # 8 devices on fewer than 16 cores
        _in_a_process_with_threads(f"test_matches_reference[{case}]", 2 * n)
        return
    x = make_inputs(sorted(CASES).index(case) + 50, **shape_kw)
    got = run_ring(x, n, layout=layout, implementation="pallas_tpu_interpret", config=_config(), **kw)
    assert got["out_dtype"] == x["dtype"]
    check_against_reference(got, reference_for(x, **kw), x["dtype"])
    if "segment_ids" in x:  # padding rows see no key: zero output, -inf lse, zero dq
        padded = np.asarray(x["segment_ids"]) < 0
        assert np.all(got["out"][padded] == 0.0) and np.all(got["dq"][padded] == 0.0)
    assert not races_found()


@on_cpu
def test_invariant_gives_the_same_bits_on_one_and_two_devices(monkeypatch):
    """deterministic="invariant" with the TPU kernels (the interpreter): granule pairs of 32 tokens (a 4th of the
    sequence here), the same bits on 1 device and on a zigzag ring of 2, and the float64 reference."""
    if _too_few_threads(2):
        _in_a_process_with_threads("test_invariant_gives_the_same_bits_on_one_and_two_devices", 4)
        return
    from ringjax.core import invariant

    monkeypatch.setattr(invariant, "FEWEST_GRANULES", 4)
    x = make_inputs(57, seq=128, heads=4, kv_heads=2, head_dim=128, segments="random", sinks=True)
    kw = dict(causal=True, sliding_window=50, implementation="pallas_tpu_interpret", deterministic="invariant")
    one = run_ring(x, 1, **kw)
    check_against_reference(one, reference_for(x, causal=True, sliding_window=50), "float32")
    two = run_ring(x, 2, layout="zigzag", **kw)
    for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
        assert np.array_equal(one[name], two[name]), name
    assert not races_found()


# ---------------------------------------------------------------- the fused rings (remote DMA)

FUSED_CASES = {
    "2dev_zigzag_gqa_softcap_sinks": (
        2, "zigzag", dict(seq=32, heads=4, kv_heads=2, sinks=True), dict(causal=True, logits_soft_cap=2.0)
    ),
    # a two-sided window on 4 shards of 16: the ring starts one shard ahead and runs 3 of 4 steps
    "4dev_window_ahead_segments": (4, "contiguous", dict(seq=64, segments="random"), dict(sliding_window=(10, 5))),
}


@on_cpu
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_ring_matches_reference_without_races(case, capfd):
    n, layout, shape_kw, kw = FUSED_CASES[case]
    x = make_inputs(sorted(FUSED_CASES).index(case) + 70, **shape_kw)
    config = _config(fused=True, detect_races=True)
    got = run_ring(x, n, layout=layout, implementation="pallas_tpu_interpret", config=config, **kw)
    check_against_reference(got, reference_for(x, **kw), x["dtype"])
    # the detector prints every race it finds; its flag covers the last kernel, the fused backward
    assert "RACE DETECTED" not in capfd.readouterr().out
    assert not races_found()


def _fused_run(n, x, backward):
    """Forward (or its gradient) of the fused rings on n devices, with the race detector on."""
    mesh = mesh_of(n)
    spec = P(None, "sp")

    def attn(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name="sp", implementation="pallas_tpu_interpret",
                                      config=_config(fused=True, detect_races=True))

    f = jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    if backward:
        f = jax.grad(lambda q, k, v, f=f: f(q, k, v).sum(), argnums=(0, 1, 2))
    args = [jax.device_put(jnp.asarray(x[name]), NamedSharding(mesh, spec)) for name in ("q", "k", "v")]
    with jax.set_mesh(mesh):
        return jax.block_until_ready(jax.jit(f)(*args))


@on_cpu
@pytest.mark.parametrize("backward", [False, True])
def test_race_detector_catches_a_ring_without_handshake(backward, monkeypatch, capfd):
    """Drop the 'slot is free' handshakes: a neighbour's DMA then overwrites K/V (or dK/dV) in use."""
    from ringjax.backends.pallas_tpu import fused_ring as ring

    monkeypatch.setattr(ring, "_wait_for_capacity", lambda capacity: None)
    monkeypatch.setattr(ring, "_grant_capacity", lambda capacity, opts, left: None)
    x = make_inputs(9, seq=24, batch=1, heads=2, kv_heads=1)
    _fused_run(3, x, backward)
    assert races_found()  # the flag covers the last kernel: the fused backward when backward=True
    assert "RACE DETECTED" in capfd.readouterr().out


@on_cpu
def test_bfloat16_head_dim_64():
    x = make_inputs(7, seq=64, batch=1, heads=4, kv_heads=1, head_dim=64, dtype="bfloat16", sinks=True)
    kw = dict(causal=True, softmax_scale=0.3)
    # bfloat16 tiles are 16 rows: block sizes 8 are raised to the 16-row minimum
    got = run_ring(x, 2, layout="zigzag", implementation="pallas_tpu_interpret", config=_config(), **kw)
    assert got["out_dtype"] == "bfloat16"
    check_against_reference(got, reference_for(x, **kw), "bfloat16")


@on_cpu
def test_reference_check_can_fail():
    """The comparison detects a wrong result: the non-causal run fails against the causal reference."""
    n, layout, shape_kw, kw = CASES["1dev_gqa_multiblock"]  # same shapes: reuses that compiled ring
    assert not kw.get("causal")
    x = make_inputs(3, **shape_kw)
    got = run_ring(x, n, layout=layout, implementation="pallas_tpu_interpret", config=_config(), **kw)
    with pytest.raises(AssertionError):
        check_against_reference(got, reference_for(x, causal=True), "float32")


# ---------------------------------------------------------------- selection and refusals


def _problem(platform="cpu", *, opts=None, seq=64, head_dim=64, dtype="float32"):
    return registry.Problem(opts=opts or AttentionOptions(), batch=1, seq=seq, heads=4, kv_heads=2,
                            head_dim=head_dim, dtype=dtype, platform=platform)


def test_auto_never_picks_the_interpreter_on_cpu():
    reg, _ = registry.choose("ring_attention", "auto", _problem("cpu"))
    assert reg.name == "xla"
    reg, _ = registry.choose("ring_attention", "pallas_tpu_interpret", _problem("cpu"))
    assert reg.name == "pallas_tpu_interpret"
    listed = {i["name"]: i for i in registry.list_implementations()}
    assert listed["pallas_tpu"]["platforms"] == ("tpu",)


def test_auto_picks_pallas_tpu_on_tpu():
    reg, _ = registry.choose("ring_attention", "auto", _problem("tpu"))
    assert reg.name == "pallas_tpu"
    # a problem the kernels refuse falls back to the XLA ring
    reg, _ = registry.choose("ring_attention", "auto", _problem("tpu", head_dim=80))
    assert reg.name == "xla"


def test_naming_pallas_tpu_on_cpu_says_why():
    with pytest.raises(ValueError, match="pallas_tpu: runs on tpu, not cpu"):
        registry.choose("ring_attention", "pallas_tpu", _problem("cpu"))


@dataclasses.dataclass(frozen=True)
class _FutureOptions(AttentionOptions):
    future_rule: int | None = None  # a feature added after these kernels


@pytest.mark.parametrize(
    "problem, reason",
    [
        (_problem("tpu", dtype="float16"), "dtype float16 is not supported"),
        (_problem("tpu", head_dim=80), "head_dim 80 is not supported"),
        (_problem("tpu", seq=24, dtype="bfloat16"), "multiple of 16 for bfloat16"),
        (_problem("tpu", opts=AttentionOptions(num_sink_tokens=2, chunk_size=8)), "sink tokens with chunk_size"),
        (_problem("tpu", opts=_FutureOptions(future_rule=4)), "future_rule is not implemented"),
    ],
)
def test_refusals_name_the_reason(problem, reason):
    assert reason in IMPLEMENTATION.supports(problem)
    assert reason in INTERPRET_IMPLEMENTATION.supports(dataclasses.replace(problem, platform="cpu"))


def test_unknown_option_at_its_default_is_accepted():
    assert IMPLEMENTATION.supports(_problem("tpu", opts=_FutureOptions())) is None


def test_config_validation_and_json_round_trip():
    with pytest.raises(ValueError, match="block_q"):
        TpuConfig(block_q=0)
    with pytest.raises(ValueError, match="detect_races needs interpret"):
        TpuConfig(detect_races=True)
    with pytest.raises(TypeError, match="fused"):
        TpuConfig(fused=1)
    cfg = TpuConfig(block_q=128, block_kv=256, fused=True)
    assert registry.config_from_json(TpuConfig, registry.config_to_json(cfg)) == cfg
    for problem in (_problem("tpu"), _problem("tpu", dtype="bfloat16")):
        assert IMPLEMENTATION.candidate_configs(problem)
        assert not IMPLEMENTATION.default_config(problem).interpret
        assert INTERPRET_IMPLEMENTATION.default_config(problem).interpret


@on_cpu
def test_interpreter_registration_needs_interpret_config():
    x = make_inputs(1, seq=16, batch=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="interpret=True"):
        run_ring(x, 1, implementation="pallas_tpu_interpret", config=TpuConfig(block_q=8, block_kv=8))


# ---------------------------------------------------------------- lowering for TPU


def _export_ring_for_tpu(n, dtype, config, **opts):
    """jax.export of the ring's forward and backward on `n` devices, lowered for TPU (Mosaic)."""
    b, t, h, kvh, d = 2, 256, 8, 2, 128
    options = AttentionOptions(axis_name="sp", axis_size=n, **opts)
    problem = registry.Problem(opts=options, batch=b, seq=t, heads=h, kv_heads=kvh, head_dim=d,
                               dtype=jnp.dtype(dtype).name, platform="tpu")
    assert IMPLEMENTATION.supports(problem) is None
    mesh = mesh_of(n)
    spec = P(None, "sp")
    has_seg = options.has_segments

    def per_device(q, k, v, seg, w, slopes):
        if slopes is not None:  # as ring_attention hands them on: varying like the queries
            slopes = _compat.match_vma(slopes, q)

        def loss(q, k, v, slopes):
            seed = jnp.array([3, 5], jnp.uint32) if options.dropout_rate else None
            out, lse = IMPLEMENTATION.run(problem, config, q, k, v, seg, seg, None,
                                          Extras(alibi_slopes=slopes, dropout_seed=seed))
            return (out.astype(jnp.float32) * w).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v, slopes)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec, spec if has_seg else None, spec,
                                                        P() if options.has_alibi else None),
                       out_specs=(spec, spec, spec))
    sharded = NamedSharding(mesh, spec)
    arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharded)  # noqa: E731
    args = (arg((b, t * n, h, d), dtype), arg((b, t * n, kvh, d), dtype), arg((b, t * n, kvh, d), dtype),
            arg((b, t * n), jnp.int32) if has_seg else None, arg((b, t * n, h, d), jnp.float32),
            jax.ShapeDtypeStruct((h,), jnp.float32, sharding=NamedSharding(mesh, P())) if options.has_alibi else None)
    with jax.set_mesh(mesh):
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return exported.mlir_module()


_BOTH_RINGS = [
    (4, jnp.bfloat16, dict(causal=True, layout="zigzag", has_segments=True, logits_soft_cap=30.0)),
    (2, jnp.float32, dict(window=(100, 10))),
]
# the step ring only (the fused one refuses them: `_fused_refusal`): chunks as segment ids, ALiBi's slope column,
# dropout's keys, and sink tokens in every step's mask
_STEP_RING_ONLY = [
    (2, jnp.bfloat16, dict(causal=True, chunk_size=96, has_alibi=True, dropout_rate=0.1)),
    (2, jnp.float32, dict(causal=True, window=(300, 0), num_sink_tokens=4)),
    (2, jnp.bfloat16, dict(causal=True, window=(300, 0), num_sink_tokens=4, has_segments=True)),  # of documents
]


@pytest.mark.parametrize(
    "n, dtype, opts, fused",
    [(*case, fused) for case in _BOTH_RINGS for fused in (False, True)] + [(*case, False) for case in _STEP_RING_ONLY],
)
def test_kernels_lower_for_tpu(n, dtype, opts, fused):
    text = _export_ring_for_tpu(n, dtype, TpuConfig(block_q=128, block_kv=128, fused=fused), **opts)
    # both cases run the full ring: per step one forward kernel and two backward kernels (dK/dV, dQ),
    # or one fused kernel per direction for the whole ring
    assert text.count("tpu_custom_call") == (2 if fused else 3 * n)
    assert ("ringjax_tpu_fused_ring_fwd" in text) == fused
    assert ("ringjax_tpu_fused_ring_bwd" in text) == fused


# ---------------------------------------------------------------- VMEM budget


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_heuristic_and_candidates_fit_the_vmem_budget(dtype, head_dim):
    from ringjax.backends.pallas_tpu import config as tpu_config

    problem = _problem("tpu", seq=4096, head_dim=head_dim, dtype=dtype)
    for config in [IMPLEMENTATION.default_config(problem), *IMPLEMENTATION.candidate_configs(problem)]:
        assert tpu_config.vmem_bytes(config, problem.gqa_ratio, head_dim, dtype) <= tpu_config.VMEM_BUDGET
    if head_dim <= 128:  # the tiles chosen before the budget was modelled already fit
        assert IMPLEMENTATION.default_config(problem) == TpuConfig(block_q=512, block_kv=512)


@on_cpu
def test_explicit_config_over_the_vmem_budget_is_refused_before_running():
    x = make_inputs(5, batch=1, seq=2048, heads=2, kv_heads=1)
    q, k, v = (jnp.asarray(x[name]) for name in ("q", "k", "v"))
    with pytest.raises(ValueError, match="VMEM"):
        ringjax.ring_attention(q, k, v, axis_name=None, implementation="pallas_tpu_interpret",
                               config=TpuConfig(block_q=2048, block_kv=2048, interpret=True))


# ---------------------------------------------------------------- enough host threads, or a refusal


def test_interpreter_refuses_more_devices_than_its_threads_serve(monkeypatch):
    """2 threads per device: fewer could deadlock XLA's CPU runtime, which then aborts the process."""
    cpu = len(jax.devices("cpu"))  # 8 (conftest)
    if cpu < 4:
        pytest.skip(f"needs 4 CPU devices, {cpu} here")
    ring = registry.Problem(opts=AttentionOptions(axis_name="sp", axis_size=cpu), batch=1, seq=16, heads=2,
                            kv_heads=1, head_dim=16, dtype="float32", platform="cpu")
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("PJRT_NPROC", "2")  # the pool: max(2, cpu devices) threads
    why = INTERPRET_IMPLEMENTATION.supports(ring)
    assert f"on {cpu} devices" in why and f"needs {2 * cpu} threads" in why and f"has {cpu}," in why
    assert f"PJRT_NPROC={2 * cpu} before jax starts" in why and f"at most {cpu // 2} devices" in why
    with pytest.raises(ValueError, match=f"pallas_tpu_interpret: on {cpu} devices"):
        registry.choose("ring_attention", "pallas_tpu_interpret", ring)
    assert IMPLEMENTATION.supports(dataclasses.replace(ring, platform="tpu")) is None  # only the interpreter
    # no ring, no mesh: nothing waits for another device
    assert INTERPRET_IMPLEMENTATION.supports(dataclasses.replace(ring, opts=AttentionOptions())) is None
    # a mesh in context: only its devices run the computation
    half = jax.make_mesh((cpu // 2,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:cpu // 2])
    with jax.set_mesh(half):
        assert INTERPRET_IMPLEMENTATION.supports(dataclasses.replace(ring, opts=AttentionOptions(
            axis_name="sp", axis_size=cpu // 2))) is None
    monkeypatch.setenv("PJRT_NPROC", str(2 * cpu))
    assert INTERPRET_IMPLEMENTATION.supports(ring) is None
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.setenv("NPROC", "1")
    assert "the larger of NPROC=1 and" in INTERPRET_IMPLEMENTATION.supports(ring)


# a new user's first call: global arrays under jax.set_mesh on 8 simulated devices, default config
USER_CALL = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType
    import ringjax

    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 128, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 128, 1, 16)), jnp.float32) for _ in range(2))
    try:
        with jax.set_mesh(mesh):
            out = ringjax.ring_attention(q, k, v, causal=True, implementation="pallas_tpu_interpret")
    except ValueError as e:
        print(json.dumps({"refused": str(e)}))
    else:
        ref = ringjax.ring_attention(q, k, v, causal=True, axis_name=None, implementation="xla")
        print(json.dumps({"max_error": float(jnp.abs(out - ref).max())}))
""")


@pytest.mark.parametrize("threads", [None, "16"], ids=["as_the_machine_is", "PJRT_NPROC=16"])
def test_a_users_call_on_8_devices_gives_a_result_or_a_refusal_never_an_abort(threads):
    """In a fresh process (the CPU client's threads are fixed when it starts): on a machine with fewer than
    16 cores the call is refused before any device work, with the remedy; with PJRT_NPROC=16 it runs."""
    env = {k: v for k, v in child_env(8).items() if k not in ("PJRT_NPROC", "NPROC")}
    if threads is not None:
        env["PJRT_NPROC"] = threads
    child = subprocess.run([sys.executable, "-c", USER_CALL], capture_output=True, text=True, env=env, timeout=170)
    assert child.returncode == 0, f"exit status {child.returncode}:\n{child.stderr[-3000:]}"
    result = json.loads(child.stdout.strip().splitlines()[-1])
    if "refused" in result:
        assert threads is None, result["refused"]
        why = result["refused"]
        assert "on 8 devices" in why and "cores" in why and "PJRT_NPROC=16" in why, why
    else:
        assert result["max_error"] < 1e-5, result


@pytest.mark.parametrize("kw, why", [(dict(chunk_size=16), "chunk_size without segment_ids"),
                                     (dict(has_alibi=True), "ALiBi, dropout and sink tokens"),
                                     (dict(dropout_rate=0.1), "ALiBi, dropout and sink tokens"),
                                     (dict(num_sink_tokens=2), "ALiBi, dropout and sink tokens")])
def test_step_ring_only_features_keep_off_the_fused_ring(kw, why):
    """Plain chunks (segment ids made per step) and ALiBi (a slope column per step) run in the step ring's
    kernels; the fused ring, which builds its tiles itself, is left out of the candidates and refused by name
    when asked for."""
    ring = AttentionOptions(causal=True, axis_name="sp", axis_size=4)
    problem = _problem("tpu", opts=dataclasses.replace(ring, **kw), seq=64)
    assert IMPLEMENTATION.supports(problem) is None
    assert not any(c.fused for c in IMPLEMENTATION.candidate_configs(problem))
    assert any(c.fused for c in IMPLEMENTATION.candidate_configs(_problem("tpu", opts=ring, seq=64)))
    q = jnp.ones((1, 64, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match=f"fused=True cannot run this call: {why}"):
        IMPLEMENTATION.run(problem, TpuConfig(fused=True), q, q, q, None, None, None, Extras())

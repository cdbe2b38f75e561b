"""float32 follows jax's matmul precision: the policy (core/precision.py), the dots each backend traces, the
dispatch and cache keys, and the results against the float64 reference."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import ringjax
from ringjax.backends.xla import XlaConfig
from ringjax.core import precision
from ringjax.dispatch import cache, registry
from ringjax.options import AttentionOptions

from harness import check_against_reference, make_inputs, reference_for, run_ring

# these tests set the precision themselves; conftest's GPU default ("highest") would hide "default"
pytestmark = pytest.mark.matmul_precision("default")


def _under(setting):
    return contextlib.nullcontext() if setting is None else jax.default_matmul_precision(setting)


@pytest.mark.parametrize("setting, name", [(None, "default"), ("default", "default"), ("bfloat16", "default"),
                                           ("high", "high"), ("tensorfloat32", "high"), ("highest", "highest"),
                                           ("float32", "highest"), ("F32_F32_F32", "F32_F32_F32"),
                                           ("TF32_TF32_F32", "TF32_TF32_F32")])
def test_current_reads_jax_setting_for_float32_only(setting, name):
    with _under(setting):
        assert precision.current(jnp.float32) == name
        assert precision.current(jnp.bfloat16) == precision.current("float16") == "default"
    with jax.default_matmul_precision("highest"):  # nested: the innermost wins, as for jax's own dots
        with _under(setting):
            assert precision.current("float32") == (name if setting is not None else "highest")


@pytest.mark.matmul_precision(None)  # a context set around the test would win over the global value
def test_current_reads_the_config_value():
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "float32")
    try:
        assert precision.current("float32") == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", before)


def test_dot_precision_per_dtype():
    assert precision.dot_precision(jnp.float32, "default") == lax.Precision.DEFAULT
    assert precision.dot_precision(jnp.float32, "high") == lax.Precision.HIGH
    assert precision.dot_precision(jnp.float32, "highest") == lax.Precision.HIGHEST
    assert precision.dot_precision(jnp.float32, "F32_F32_F32") == lax.DotAlgorithmPreset.F32_F32_F32
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float64):  # the setting is about float32 only
        assert precision.dot_precision(dtype, "highest") == lax.Precision.DEFAULT
    with pytest.raises(ValueError, match="unknown matmul precision 'fp32'"):
        precision.canonical("fp32")


def _dot_precisions(jaxpr) -> set[str]:
    """`precision` of every dot_general in `jaxpr` and the jaxprs inside it (loops, conds, custom_vjp)."""
    found = set()

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(str(eqn.params["precision"]))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return found


EXPECTED = {None: "(Precision.DEFAULT, Precision.DEFAULT)", "tensorfloat32": "(Precision.HIGH, Precision.HIGH)",
            "highest": "(Precision.HIGHEST, Precision.HIGHEST)", "F32_F32_F32": "F32_F32_F32"}


@pytest.mark.parametrize("setting", list(EXPECTED))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_dots_carry_the_precision(setting, dtype):
    """Forward and backward tile dots of the xla backend carry jax's setting (float32) or DEFAULT (bf16)."""
    q = jnp.ones((1, 32, 2, 16), dtype)

    def loss(q):
        return ringjax.ring_attention(q, q, q, axis_name=None, causal=True, implementation="xla",
                                      config=XlaConfig(block_q=16, block_kv=16)).astype(jnp.float32).sum()

    with _under(setting):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
    want = EXPECTED[setting] if dtype == "float32" else EXPECTED[None]
    assert _dot_precisions(jaxpr) == {want}


def test_backward_keeps_the_forward_precision():
    """A vjp taken under "highest" and applied outside it still multiplies in full float32."""
    q = jnp.ones((1, 32, 2, 16), jnp.float32)
    f = jax.jit(lambda q: ringjax.ring_attention(q, q, q, axis_name=None, causal=True, implementation="xla"))
    with jax.default_matmul_precision("highest"):
        _, vjp = jax.vjp(f, q)
    jaxpr = jax.make_jaxpr(vjp)(q)
    assert _dot_precisions(jaxpr) <= {EXPECTED["highest"]} and _dot_precisions(jaxpr)


@pytest.mark.parametrize("prec", ["default", "high", "TF32_TF32_F32"])
def test_triton_dots_carry_the_problems_precision(prec):
    """The compiled Triton kernels' dots, forward and backward, carry the problem's precision (traced, not
    lowered, so a CPU can look): Triton lowers each of these to TF32 on float32."""
    from ringjax.backends.pallas_triton import GpuConfig
    from ringjax.backends.pallas_triton.implementation import IMPLEMENTATION
    from ringjax.core.masks import Extras

    problem = _problem(prec=prec, seq=32, heads=2, kv_heads=2, head_dim=16)

    def loss(q):
        out, _ = IMPLEMENTATION.run(problem, GpuConfig(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16),
                                    q, q, q, None, None, None, Extras())
        return out.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((1, 32, 2, 16), jnp.float32))
    want = {"default": EXPECTED[None], "high": EXPECTED["tensorfloat32"], "TF32_TF32_F32": "TF32_TF32_F32"}[prec]
    assert _dot_precisions(jaxpr) == {want}


def _problem(dtype="float32", prec="default", **kw):
    base = dict(opts=AttentionOptions(causal=True), batch=1, seq=1024, heads=8, kv_heads=2, head_dim=128,
                dtype=dtype, platform="gpu", precision=prec)
    return registry.Problem(**{**base, **kw})


@pytest.mark.parametrize("batch, heads, side", [(1, 32, 2048), (1, 8, 2048), (4, 32, 1024), (8, 32, 512),
                                                (64, 32, 512)])
def test_xla_blocks_grow_on_gpus_within_the_score_budget(batch, heads, side):
    """On a GPU the XLA step takes blocks as large as 2048 (measured faster on an H200, float32 and bf16) while one
    block pair's float32 scores stay within GPU_SCORES; never below the 512 every other platform keeps."""
    from ringjax.backends.xla.implementation import IMPLEMENTATION
    from ringjax.core.blockwise import GPU_SCORES

    config = IMPLEMENTATION.default_config(_problem(batch=batch, heads=heads, seq=32768))
    assert (config.block_q, config.block_kv) == (side, side)
    assert side == 512 or batch * heads * side * side <= GPU_SCORES
    assert IMPLEMENTATION.default_config(_problem(batch=batch, heads=heads, platform="cpu")) == XlaConfig()
    assert IMPLEMENTATION.default_config(_problem(batch=batch, heads=heads, dtype="bfloat16")) == config


def test_triton_refuses_full_float32_and_auto_falls_back_to_xla():
    triton = next(r for r in registry.registrations("ring_attention") if r.name == "pallas_triton")
    for prec in ("highest", "F32_F32_F32"):
        why = registry.refusal(triton, _problem(prec=prec))
        assert why is not None and f"matmul precision {prec!r}" in why and "TF32" in why
        reg, _ = registry.choose("ring_attention", "auto", _problem(prec=prec))
        assert reg.name == "xla"
    for prec in ("default", "high", "TF32_TF32_F32"):
        assert registry.refusal(triton, _problem(prec=prec)) is None
    assert registry.refusal(triton, _problem(dtype="bfloat16")) is None  # bf16 never carries "highest"


def test_explicit_triton_under_highest_raises_naming_the_precision():
    q = jnp.ones((1, 32, 2, 16), jnp.float32)
    with jax.default_matmul_precision("highest"):
        with pytest.raises(ValueError, match="matmul precision 'highest'"):
            ringjax.ring_attention(q, q, q, axis_name=None, implementation="pallas_triton_interpret")


def test_precision_is_in_the_keys_for_float32_only():
    a, b = _problem(prec="default"), _problem(prec="highest")
    assert a != b and hash(a) != hash(b)  # the compiled-call and dispatch keys
    key_a, key_b = (cache.portable_key("ring_attention", "pallas_triton", p) for p in (a, b))
    assert key_a["precision"] == "default" and key_b["precision"] == "highest"
    assert cache.key_id(key_a) != cache.key_id(key_b)
    assert "precision" not in cache.portable_key("ring_attention", "pallas_triton", _problem(dtype="bfloat16"))


def test_tune_shapes_takes_the_precision(monkeypatch):
    from ringjax.dispatch import autotuning

    seen = []
    monkeypatch.setattr(autotuning, "tune_problem", lambda op, reg, impl, problem, settings: seen.append(problem))
    with jax.default_matmul_precision("highest"):
        autotuning.tune_shapes(batch=1, seq=64, heads=2, head_dim=16, dtype="float32", implementation="xla")
    autotuning.tune_shapes(batch=1, seq=64, heads=2, head_dim=16, dtype="float32", implementation="xla")
    assert [p.precision for p in seen] == ["highest", "default"]


@pytest.mark.parametrize("impl, setting", [("xla", "highest"), ("xla", None), ("pallas_triton_interpret", None)])
def test_float32_matches_the_float64_reference(impl, setting):
    """Full float32 as tight as ever; the default too on CPUs (no TF32 there; GPUs check at the TF32 tolerance)."""
    if impl != "xla" and jax.default_backend() == "gpu":
        impl = "pallas_triton"
    x = make_inputs(3, seq=64, dtype="float32")
    with _under(setting):
        got = run_ring(x, 2, layout="zigzag", implementation=impl, causal=True)
        check_against_reference(got, reference_for(x, causal=True), "float32")
    assert np.isfinite(got["out"]).all()

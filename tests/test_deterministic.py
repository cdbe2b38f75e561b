"""`deterministic=True`: bitwise-identical gradients run to run; the fused backwards (dQ by atomic adds) run split.
`deterministic="invariant"`: the same bits on any ring size and layout."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringjax
from ringjax.backends.pallas_triton import GpuConfig
from ringjax.layers.core import AttentionLayerConfig
from ringjax.options import AttentionOptions

from harness import check_against_reference, make_inputs, reference_for, run_ring

needs_flax = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")
needs_equinox = pytest.mark.skipif(importlib.util.find_spec("equinox") is None, reason="needs equinox")
GRADS = ("dq", "dk", "dv", "dsinks")


def _qkv(seed=0, seq=16):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((1, seq, 2, 8)), jnp.float32) for _ in range(3)]


@pytest.mark.parametrize("call", [
    lambda q, k, v, bad: ringjax.ring_attention(q, k, v, axis_name=None, deterministic=bad),
    lambda q, k, v, bad: ringjax.dilated_attention(q, k, v, segment_lengths=8, dilation_rates=1, axis_name=None,
                                                   deterministic=bad),
    lambda q, k, v, bad: ringjax.ring_attention_varlen(q[0], k[0], v[0], jnp.asarray([0, 16]), axis_name=None,
                                                       deterministic=bad),
    lambda q, k, v, bad: AttentionLayerConfig(in_features=16, num_heads=2, deterministic=bad),
])
@pytest.mark.parametrize("bad", [1, "yes", None])
def test_deterministic_must_be_a_bool(call, bad):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        call(q, k, v, bad)


@pytest.mark.parametrize("n, layout, xkw, kw", [
    (1, "contiguous", dict(), dict(causal=True)),
    (2, "zigzag", dict(segments="random"), dict(causal=True)),
    (4, "striped", dict(sinks=True), dict(sliding_window=9, logits_soft_cap=5.0)),
])
def test_xla_gradients_are_bitwise_identical_run_to_run(n, layout, xkw, kw):
    x = make_inputs(40 + n, **xkw)
    runs = [run_ring(x, n, layout=layout, implementation="xla", deterministic=True, **kw) for _ in range(5)]
    check_against_reference(runs[0], reference_for(x, **kw), "float32")
    for run in runs[1:]:
        for name in GRADS:
            if name in run:
                assert np.array_equal(run[name], runs[0][name]), name
    # the default (XLA's backward is deterministic already) computes bitwise the same
    default = run_ring(x, n, layout=layout, implementation="xla", **kw)
    for name in GRADS:
        if name in default:
            assert np.array_equal(default[name], runs[0][name]), name


@pytest.mark.parametrize("module, call", [
    ("ringjax.dilated", lambda q, k, v: ringjax.dilated_attention(q, k, v, segment_lengths=8, dilation_rates=2,
                                                                  axis_name=None, deterministic=True)),
    ("ringjax.packed", lambda q, k, v: ringjax.ring_attention_varlen(q[0], k[0], v[0], jnp.asarray([0, 5, 16]),
                                                                     axis_name=None, deterministic=True)),
    ("ringjax.packed", lambda q, k, v: ringjax.ring_attention_kvpacked(q, jnp.stack([k, v], axis=2),
                                                                       axis_name=None, deterministic=True)),
])
def test_other_entry_points_pass_it_on(monkeypatch, module, call):
    module = importlib.import_module(module)
    seen, op = [], module.ring_attention

    def spy(*args, **kw):
        seen.append(kw.get("deterministic"))
        return op(*args, **kw)

    monkeypatch.setattr(module, "ring_attention", spy)
    call(*_qkv(1))
    assert seen and all(s is True for s in seen)


def test_mosaic_gpu_fused_backward_is_off_when_deterministic():
    from ringjax.backends.pallas_mosaic_gpu.implementation import MosaicGpuConfig
    from ringjax.backends.pallas_mosaic_gpu.kernels import fuses_backward

    fused = MosaicGpuConfig(bwd_fused=True, dkv_num_stages=2)
    assert fuses_backward(AttentionOptions(causal=True), fused, 128, 128)
    assert not fuses_backward(AttentionOptions(causal=True, deterministic=True), fused, 128, 128)
    assert not fuses_backward(AttentionOptions(causal=True), MosaicGpuConfig(dkv_num_stages=2), 128, 128)


@pytest.mark.parametrize("head_dim, fused", [(64, True), (96, False), (128, False), (256, False)])
def test_mosaic_gpu_heuristic_fuses_the_backward_at_head_dim_64_unless_deterministic(head_dim, fused):
    """What `auto` runs untuned: the fused backward where it measured faster (head_dim 64), and never under
    deterministic=True."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import IMPLEMENTATION
    from ringjax.backends.pallas_mosaic_gpu.kernels import fuses_backward
    from ringjax.dispatch import registry

    for deterministic in (False, True):
        opts = AttentionOptions(causal=True, deterministic=deterministic)
        problem = registry.Problem(opts=opts, batch=1, seq=1024, heads=8, kv_heads=2, head_dim=head_dim,
                                   dtype="bfloat16", platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
        config = IMPLEMENTATION.default_config(problem)
        assert fuses_backward(opts, config, head_dim, head_dim) is (fused and not deterministic)


def _triton_kernels_launched(monkeypatch, opts, config) -> list[str]:
    """Names of the Pallas calls the Triton `block_bwd` makes for `opts` and `config` (traced, not run)."""
    from ringjax.backends.pallas_triton import kernels
    from ringjax.core.masks import TokenInfo

    names = []
    launch = kernels._Step.launch

    def spy(self, kernel, name, *args, **kw):
        names.append(name)
        return launch(self, kernel, name, *args, **kw)

    monkeypatch.setattr(kernels._Step, "launch", spy)
    t, s = 64, jax.ShapeDtypeStruct

    def bwd(q, k, v, do, lse, delta):
        info = TokenInfo(jnp.arange(t, dtype=jnp.int32), None)
        return kernels.block_bwd(q, k, v, do, lse, delta, info, info, opts, config)

    rows = s((1, 2, t), jnp.float32)
    jax.make_jaxpr(bwd)(*[s((1, t, 2, 16), jnp.float32)] * 4, rows, rows)
    return names


def test_triton_fused_backward_is_off_when_deterministic(monkeypatch):
    from ringjax.backends.pallas_triton.kernels import fuses_backward

    fused = GpuConfig(bwd_fused=True)
    opts = AttentionOptions(causal=True, softmax_scale=0.25)
    deterministic = AttentionOptions(causal=True, softmax_scale=0.25, deterministic=True)
    assert fuses_backward(opts, fused) and not fuses_backward(deterministic, fused)
    assert not fuses_backward(opts, GpuConfig())
    assert _triton_kernels_launched(monkeypatch, opts, fused) == ["ringjax_bwd_dkv_dq"]
    assert _triton_kernels_launched(monkeypatch, deterministic, fused) == ["ringjax_bwd_dq", "ringjax_bwd_dkv"]


@pytest.mark.parametrize("deterministic, says", [
    (False, "backward: one fused kernel (dQ added by float32 atomics)"),
    (True, "backward: the dQ and dK/dV kernels, not the fused one asked for: deterministic=True"),
])
def test_triton_config_note_says_which_backward_runs(deterministic, says):
    from ringjax.backends.pallas_triton.implementation import IMPLEMENTATION
    from ringjax.core.problem import Problem

    problem = Problem(AttentionOptions(causal=True, deterministic=deterministic), batch=1, seq=256, heads=4,
                      kv_heads=2, head_dim=64, dtype="bfloat16", platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert IMPLEMENTATION.config_note(problem, GpuConfig(bwd_fused=True)).startswith(says)
    assert IMPLEMENTATION.config_note(problem, GpuConfig()) == ""  # not asked for: nothing to say


def test_triton_fused_config_with_deterministic_matches_reference(caplog):
    """bwd_fused=True with deterministic=True (the split kernels) in the Triton interpreter, on a ring of 2; the
    implementation report says the split kernels ran, and why."""
    on_gpu = jax.default_backend() == "gpu"
    impl = "pallas_triton" if on_gpu else "pallas_triton_interpret"
    config = GpuConfig(block_q=16, block_kv=16, num_warps=4, num_stages=2, bwd_block_q=16, bwd_block_kv=16,
                       bwd_fused=True, interpret=not on_gpu)
    x = make_inputs(7, seq=64)
    with jax.default_matmul_precision("default"), caplog.at_level(logging.INFO, logger="ringjax.implementation"):
        got = run_ring(x, 2, layout="zigzag", implementation=impl, config=config, causal=True, deterministic=True)
    check_against_reference(got, reference_for(x, causal=True), "float32")
    assert "not the fused one asked for: deterministic=True" in caplog.text
    assert "deterministic gradients" in caplog.text and "(no fused backward)" not in caplog.text


# ---------------------------------------------------------------------------- the layers pass it to the op


def _make_layer(framework, **kw):
    if framework == "nnx":
        from flax import nnx

        from ringjax.flax import MultiHeadAttention

        return MultiHeadAttention(16, 2, axis_name=None, rngs=nnx.Rngs(0), **kw)
    if framework == "equinox":
        from ringjax.equinox import MultiHeadAttention

        return MultiHeadAttention(16, 2, axis_name=None, key=jax.random.key(0), **kw)
    from ringjax.flax import LinenMultiHeadAttention

    return LinenMultiHeadAttention(num_heads=2, axis_name=None, **kw)


@pytest.mark.parametrize("framework", [pytest.param("nnx", marks=needs_flax), pytest.param("linen", marks=needs_flax),
                                       pytest.param("equinox", marks=needs_equinox)])
@pytest.mark.parametrize("deterministic", [True, False, "invariant"])
def test_layers_pass_deterministic_to_the_op(monkeypatch, framework, deterministic):
    from ringjax.layers import core

    seen = []
    op = core.ring_attention

    def spy(*args, **kw):
        seen.append(kw["deterministic"])
        return op(*args, **kw)

    monkeypatch.setattr(core, "ring_attention", spy)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 8, 16)), jnp.float32)
    layer = _make_layer(framework, **({"deterministic": deterministic} if deterministic else {}))
    if framework == "linen":
        layer.init(jax.random.key(0), x)
    else:
        assert layer.config.deterministic == deterministic
        layer(x)
    assert seen and all(s == deterministic and type(s) is type(deterministic) for s in seen)


# ---------------------------------------------------------------------------- deterministic="invariant"

INVARIANT_CASES = [
    (dict(), dict(causal=True)),
    (dict(segments="random", sinks=True), dict(causal=True, sliding_window=23)),
    (dict(alibi=True), dict(logits_soft_cap=4.0, num_sink_tokens=3, sliding_window=(17, 9))),
    (dict(segments="random", dropout_key=5), dict(causal=True, dropout_rate=0.25, chunk_size=24)),
    (dict(segments="random", heads=4, kv_heads=1, v_head_dim=24), dict(causal=True, num_sink_tokens=2)),
]


@pytest.mark.parametrize("xkw, kw", INVARIANT_CASES)
def test_invariant_gives_the_same_bits_on_every_ring_size_and_layout(xkw, kw):
    """Outputs, lse and every gradient of deterministic="invariant" are bitwise equal on 1, 2, 4 and 8 devices,
    contiguous and zigzag, ring and all-gather, in shard_map and on global arrays; and match the float64
    reference."""
    x = make_inputs(60, seq=128, **xkw)
    first = run_ring(x, 1, implementation="xla", deterministic="invariant", **kw)
    check_against_reference(first, reference_for(x, **kw), "float32")
    runs = [((n, layout, mode, strategy), run_ring(x, n, layout=layout, mode=mode, implementation="xla",
                                                   deterministic="invariant", strategy=strategy, **kw))
            for n, layout, mode, strategy in [(2, "zigzag", "shard_map", "ring"), (4, "contiguous", "global", "ring"),
                                              (8, "zigzag", "global", "ring"), (8, "contiguous", "shard_map", "ring"),
                                              (4, "zigzag", "global", "all_gather")]]
    for how, run in runs:
        for name in ("out", "lse", *GRADS, "dalibi"):
            if name in first:
                assert np.array_equal(run[name], first[name]), (how, name)
    # without it, the sums over ring steps group differently on 8 devices: the test can tell
    plain = run_ring(x, 8, layout="zigzag", implementation="xla", **kw)
    assert not all(np.array_equal(plain[name], first[name]) for name in ("out", "dq", "dk", "dv"))


def test_invariant_in_bfloat16_on_global_arrays():
    x = make_inputs(61, seq=256, dtype="bfloat16", sinks=True)
    kw = dict(causal=True, sliding_window=40)
    runs = [run_ring(x, n, layout=layout, mode="global", implementation="xla", deterministic="invariant", **kw)
            for n, layout in [(1, "contiguous"), (4, "zigzag"), (8, "contiguous")]]
    check_against_reference(runs[0], reference_for(x, **kw), "bfloat16")
    for run in runs[1:]:
        for name in ("out", "lse", *GRADS):
            assert np.array_equal(run[name], runs[0][name]), name


@pytest.mark.parametrize("seq, granule", [(64, 1), (128, 2), (8192, 128), (65536, 1024), (1 << 20, 1024),
                                          (2016, 16), (96, 1), (3 * 4096, 128)])
def test_granules_are_a_function_of_the_sequence_alone(seq, granule):
    from ringjax.core import invariant

    g = invariant.granule(seq)
    assert g == granule and seq % g == 0 and g & (g - 1) == 0


def test_fixed_point_sums_do_not_depend_on_order():
    from ringjax.core import fixed

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(4000) * np.exp(rng.uniform(-20, 20, 4000)), jnp.float32)
    e = fixed.exponent(jnp.abs(x).sum() * 2)
    terms = fixed.encode(x, e)
    back = np.asarray(fixed.decode(fixed.normalize(terms), e), np.float64)
    grid = 2.0 ** float(e)
    assert np.all(np.abs(back - np.asarray(x, np.float64)) <= grid / 2)  # each term rounds to the grid
    assert np.array_equal(back[np.abs(x) >= grid * 2**24], np.asarray(x)[np.abs(x) >= grid * 2**24])
    whole = fixed.total(terms, 0)
    shuffled = fixed.total(terms[:, rng.permutation(4000)], 0)
    halves = fixed.add(fixed.total(terms[:, 1000:], 0), fixed.total(terms[:, :1000], 0))
    assert np.array_equal(whole, shuffled) and np.array_equal(whole, halves)
    exact = np.sum(np.asarray(x, np.float64))
    assert abs(float(fixed.decode(whole, e)) - exact) <= 1e-6 * np.abs(np.asarray(x, np.float64)).sum()
    # the property is not free: float32 addition of [1e8, 1, -1e8] gives 0 in this order and 1 in another,
    # where the fixed-point sums agree, and are exact
    three = np.asarray([1e8, 1.0, -1e8], np.float32)
    in_order = three[0] + three[1] + three[2]
    reordered = three[0] + three[2] + three[1]
    assert in_order == 0.0 and reordered == 1.0
    e3 = fixed.exponent(jnp.asarray(4e8, jnp.float32))
    t3 = fixed.encode(jnp.asarray(three), e3)
    sums = [float(fixed.decode(fixed.total(t3[:, list(order)], 0), e3)) for order in ((0, 1, 2), (0, 2, 1), (2, 1, 0))]
    assert sums == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kw, says", [
    (dict(layout="striped"), "needs layout 'contiguous' or 'zigzag'"),
    (dict(strategy="ulysses"), "runs strategy 'ring' or 'all_gather', not 'ulysses'"),
    (dict(deterministic="yes"), "deterministic must be a bool or 'invariant'"),
])
def test_invariant_refusals_name_the_argument(kw, says):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((8,), ("sp",), devices=jax.devices()[:8])
    q, k, v = _qkv(seq=64)
    kw = {"deterministic": "invariant", **kw}
    error = TypeError if kw["deterministic"] == "yes" else ValueError
    with jax.set_mesh(mesh), pytest.raises(error, match=says):
        ringjax.ring_attention(q, k, v, axis_name="sp", **kw)


def test_invariant_refuses_hybrid_that_auto_would_pick():
    """strategy="auto" over a (head_axis, ring_axis) pair is hybrid, which invariant cannot run: a ValueError."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("hp", "sp"), devices=jax.devices()[:4])
    q, k, v = _qkv(seq=64)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="not 'hybrid'"):
        ringjax.ring_attention(q, k, v, axis_name=("hp", "sp"), strategy="auto", deterministic="invariant")


def test_invariant_refuses_granules_that_straddle_a_device_run():
    """2016 tokens cut into granules of 16: zigzag on 8 devices leaves runs of 126 tokens."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((8,), ("sp",), devices=jax.devices()[:8])
    q, k, v = _qkv(seq=2016)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="granules of 16, which must divide each contiguous run"):
        jax.eval_shape(lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name="sp", layout="zigzag",
                                                              deterministic="invariant"), q, k, v)


def test_invariant_asks_kernels_about_their_granule_pairs():
    """An implementation is asked whether it runs one granule pair: the Triton kernels' 16-token tiles refuse the
    2-token granules of a 128-token sequence, and say why."""
    from ringjax.dispatch import registry

    problem = registry.Problem(AttentionOptions(causal=True, deterministic="invariant", axis_size=2), batch=1,
                               seq=64, heads=4, kv_heads=2, head_dim=64, dtype="float32", platform="cpu")
    reg = next(r for r in registry.registrations("ring_attention") if r.name == "pallas_triton_interpret")
    assert "deterministic='invariant' calls it on pairs of 2-token granules" in registry.refusal(reg, problem)
    plain = dataclasses.replace(problem, opts=AttentionOptions(causal=True, axis_size=2))
    assert registry.refusal(reg, plain) is None


@pytest.mark.parametrize("entry", ["dilated", "varlen"])
def test_other_entry_points_are_invariant_too(entry):
    """dilated_attention (one branch: strided sub-sequences) and ring_attention_varlen (documents from
    cu_seqlens) give the same gradient bits on 1 and 4 devices."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    rng = np.random.default_rng(8)
    q, k, v, w = (jnp.asarray(rng.standard_normal((1, 128, h, 16)), jnp.float32) for h in (4, 2, 2, 4))
    cu = jnp.asarray([0, 37, 100, 128], jnp.int32)

    def call(q, k, v, mesh):
        if entry == "dilated":
            return ringjax.dilated_attention(q, k, v, segment_lengths=64, dilation_rates=2, causal=True,
                                             axis_name="sp", mesh=mesh, deterministic="invariant")
        return ringjax.ring_attention_varlen(q[0], k[0], v[0], cu, causal=True, axis_name="sp", mesh=mesh,
                                             deterministic="invariant")[None]

    grads = []
    for n in (1, 4):
        mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
        grads.append(jax.jit(jax.grad(lambda q, k, v: (call(q, k, v, mesh) * w).sum(), argnums=(0, 1, 2)))(q, k, v))
    for a, b in zip(*grads):
        assert np.array_equal(a, b)


def test_dilated_refuses_branches_it_cannot_merge_invariantly():
    q, k, v = _qkv(seq=64)
    with pytest.raises(ValueError, match="takes one branch, and sinks only with dilation rate 1"):
        ringjax.dilated_attention(q, k, v, segment_lengths=[16, 32], dilation_rates=[1, 2], axis_name=None,
                                  deterministic="invariant")


def test_explain_takes_invariant_and_names_the_granules():
    """`python -m ringjax explain --deterministic invariant`: the config is the granule pair's (no fused ring on
    one device) and the report names the granules."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-m", "ringjax", "explain", "--shape", "1,65536,8,128", "--kv-heads", "2",
                            "--devices", "8", "--causal", "--deterministic", "invariant", "--platform", "gpu",
                            "--device-kind", "NVIDIA H100 80GB HBM3"], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "kernels on 1024-token granule pairs" in child.stdout
    assert '"fused": false' in child.stdout.splitlines()[0]

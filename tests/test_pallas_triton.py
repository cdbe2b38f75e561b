"""The Pallas GPU (Triton) ring step against the float64 reference.

On a GPU the kernels run compiled ("pallas_triton"); on CPU the very same kernels run
in the Pallas interpreter ("pallas_triton_interpret"), so CI checks their arithmetic
and masks, and a lowering test checks that they lower to Triton for CUDA.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringjax
from ringjax.backends.pallas_triton import GpuConfig
from ringjax.dispatch import registry
from ringjax.options import AttentionOptions

from harness import check_against_reference, make_inputs, reference_for, run_ring

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas_triton" if ON_GPU else "pallas_triton_interpret"
# its float32 runs at jax's default precision: TF32 on a GPU (checked at harness's "tf32" tolerance); it refuses
# "highest" (tests/test_precision.py)
pytestmark = pytest.mark.matmul_precision("default")
# smallest legal blocks, so tiny shards still have several blocks per step
SMALL = GpuConfig(block_q=16, block_kv=16, num_warps=4, num_stages=2, bwd_block_q=16, bwd_block_kv=16,
                  interpret=not ON_GPU)
FUSED = GpuConfig(block_q=16, block_kv=16, num_warps=4, num_stages=2, bwd_block_q=16, bwd_block_kv=16,
                  bwd_fused=True, interpret=not ON_GPU)

CASES = [
    # (devices, layout, dtype, input kwargs, attention kwargs)
    (1, "contiguous", "float32", dict(seq=64), dict(causal=True)),
    (2, "zigzag", "float32", dict(seq=64), dict(causal=True)),
    (4, "zigzag", "bfloat16", dict(seq=128), dict(causal=True)),
    (4, "contiguous", "float32", dict(seq=64), dict(causal=True, sliding_window=8, logits_soft_cap=3.0)),
    (2, "contiguous", "float32", dict(seq=64, segments="random", sinks=True), dict(causal=True)),
    (4, "striped", "float32", dict(seq=64, heads=4, kv_heads=1), dict()),
    (2, "contiguous", "float32", dict(seq=64, batch=1, head_dim=32), dict(sliding_window=(5, 20))),
    (2, "zigzag", "float32", dict(seq=64), dict(causal=True, chunk_size=24)),
    # per-document chunks, run as segments numbering (document, chunk) pairs
    (4, "zigzag", "float32", dict(seq=128, segments="random"), dict(causal=True, chunk_size=6)),
    (2, "striped", "float32", dict(seq=64, segments="random"), dict(chunk_size=8, sliding_window=(9, 4))),
]


@pytest.mark.parametrize("n, layout, dtype, xkw, kw", CASES)
def test_matches_reference(n, layout, dtype, xkw, kw):
    x = make_inputs(n * 7 + len(kw), dtype=dtype, **xkw)
    got = run_ring(x, n, layout=layout, implementation=IMPL, config=SMALL, **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


# the fused backward (dQ by atomic adds) on each walk: ranges (causal, window), list (segments), dense
FUSED_CASES = [
    (2, "zigzag", "float32", dict(seq=64), dict(causal=True)),
    (2, "contiguous", "float32", dict(seq=64, segments="random"), dict(causal=True, sliding_window=20)),
    (2, "striped", "bfloat16", dict(seq=64, heads=4, kv_heads=1), dict(logits_soft_cap=3.0)),
]


@pytest.mark.parametrize("n, layout, dtype, xkw, kw", FUSED_CASES)
def test_fused_backward_matches_reference(n, layout, dtype, xkw, kw):
    x = make_inputs(n * 11 + len(kw), dtype=dtype, **xkw)
    got = run_ring(x, n, layout=layout, implementation=IMPL, config=FUSED, **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


XLA_BWD_CASES = [
    (2, "zigzag", "float32", dict(seq=64), dict(causal=True)),
    (4, "contiguous", "float32", dict(seq=64, segments="random", sinks=True), dict(causal=True, sliding_window=20)),
    (2, "striped", "bfloat16", dict(seq=64, heads=4, kv_heads=1), dict(logits_soft_cap=3.0)),
]


@pytest.mark.parametrize("n, layout, dtype, xkw, kw", XLA_BWD_CASES)
def test_xla_backward_after_the_triton_forward_matches_reference(n, layout, dtype, xkw, kw):
    """`bwd_xla=True`: the Triton forward's lse feeds the XLA step's backward, on every ring step."""
    x = make_inputs(n * 13 + len(kw), dtype=dtype, **xkw)
    config = dataclasses.replace(SMALL, bwd_xla=True)
    got = run_ring(x, n, layout=layout, implementation=IMPL, config=config, **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


def test_range_table():
    """Bounds cover every visible column; a non-contiguous fully visible set is all masked."""
    import numpy as np

    from ringjax.core.visits import bounds

    cat = jnp.asarray([[[2, 0, 0, 1, 2],    # causal-like: full prefix then the diagonal
                        [1, 0, 1, 0, 2],    # full columns 1 and 3 are not contiguous
                        [2, 2, 2, 2, 2],    # nothing visible
                        [1, 2, 1, 2, 2]]])  # visible but never fully
    got = np.asarray(bounds(cat < 2, cat == 0))[0].tolist()
    assert got == [[1, 1, 3, 4], [0, 0, 0, 4], [0, 0, 0, 0], [0, 0, 0, 3]]


def test_default_config_matches_reference():
    """The production block sizes (not only the tiny ones) on a multi-block shard."""
    x = make_inputs(3, batch=1, seq=512, heads=2, kv_heads=1, head_dim=16)
    got = run_ring(x, 2, layout="zigzag", implementation=IMPL, causal=True)
    check_against_reference(got, reference_for(x, causal=True), "float32")
    got = run_ring(x, 2, layout="zigzag", implementation=IMPL, causal=True,
                   config=GpuConfig(interpret=not ON_GPU, bwd_fused=not GpuConfig().bwd_fused))
    check_against_reference(got, reference_for(x, causal=True), "float32")


def _problem(**kw):
    base = dict(opts=AttentionOptions(causal=True), batch=1, seq=1024, heads=8, kv_heads=2, head_dim=128,
                dtype="bfloat16", platform="gpu")
    base.update(kw)
    return registry.Problem(**base)


@pytest.mark.parametrize("kw", [dict(dropout_rate=0.1), dict(num_sink_tokens=2), dict(alibi=True),
                                dict(num_sink_tokens=2, segment_ids=jnp.zeros((1, 32), jnp.int32))])
def test_refuses_what_it_lacks(kw):
    kw = dict(kw)
    q = jnp.ones((1, 32, 2, 16))
    extra = {"alibi_slopes": jnp.ones(2)} if kw.pop("alibi", False) else {}
    if "dropout_rate" in kw:
        extra["dropout_rng"] = jax.random.key(0)
    with pytest.raises(ValueError, match="is not implemented in pallas_triton"):
        ringjax.ring_attention(q, q, q, axis_name=None, implementation=IMPL, **kw, **extra)


def test_auto_never_picks_it_on_cpu():
    reg, _ = registry.choose("ring_attention", "auto", _problem(platform="cpu"))
    assert reg.name == "xla"
    with pytest.raises(ValueError, match="pallas_triton: runs on gpu, not cpu"):
        registry.choose("ring_attention", "pallas_triton", _problem(platform="cpu"))


def test_auto_picks_it_on_gpu_and_falls_back_with_reasons():
    # on Hopper "auto" prefers the Mosaic GPU kernels (tests/test_pallas_mosaic_gpu.py); elsewhere these
    mosaic = next(r for r in registry.registrations("ring_attention") if r.name == "pallas_mosaic_gpu")
    big = _problem(seq=8192, heads=32, kv_heads=8)  # a GPU's calibration may price a 1K call's kernels otherwise
    expected = "pallas_triton" if registry.refusal(mosaic, big) else "pallas_mosaic_gpu"
    assert registry.choose("ring_attention", "auto", big)[0].name == expected
    assert registry.choose("ring_attention", "auto", _problem(head_dim=80))[0].name == "xla"
    with pytest.raises(ValueError, match="head_dim 80 is not supported: needs a power of two"):
        registry.choose("ring_attention", "pallas_triton", _problem(head_dim=80))
    zig = AttentionOptions(causal=True, layout="zigzag", axis_name="sp", axis_size=4)
    with pytest.raises(ValueError, match="half the per-device sequence .zigzag. is 40: must be a multiple of 16"):
        registry.choose("ring_attention", "pallas_triton", _problem(opts=zig, seq=80))


@pytest.mark.parametrize("bad", [dict(block_q=48), dict(block_kv=8), dict(num_warps=3), dict(num_stages=0),
                                 dict(interpret=1), dict(bwd_fused=1)])
def test_config_validation(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        GpuConfig(**bad)


def test_config_json_round_trip():
    cfg = GpuConfig(block_q=64, bwd_num_warps=8)
    assert GpuConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.skipif(ON_GPU, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
def test_kernels_lower_to_triton_for_cuda():
    from jax import export

    from ringjax.backends.pallas_triton.kernels import block_bwd, block_fwd
    from ringjax.core.masks import TokenInfo

    t = 256
    opts = AttentionOptions(causal=True, window=(100, 0), logits_soft_cap=30.0, has_segments=True, softmax_scale=0.1)

    def f(q, k, v, do, lse, delta, seg):
        qi = TokenInfo(jnp.arange(t, dtype=jnp.int32), seg)
        ki = TokenInfo(jnp.arange(t, dtype=jnp.int32) - t, seg)
        return block_fwd(q, k, v, qi, ki, opts, GpuConfig()), block_bwd(q, k, v, do, lse, delta, qi, ki, opts,
                                                                         GpuConfig())

    s = jax.ShapeDtypeStruct
    args = (s((1, t, 8, 128), jnp.bfloat16), s((1, t, 2, 128), jnp.bfloat16), s((1, t, 2, 128), jnp.bfloat16),
            s((1, t, 8, 128), jnp.bfloat16), s((1, 8, t), jnp.float32), s((1, 8, t), jnp.float32),
            s((1, t), jnp.int32))
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    try:
        exported = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(*args)
    except RuntimeError as e:
        if "No supported GPU devices found" in str(e):
            pytest.skip(f"this jax cannot lower Triton kernels without a GPU ({jax.__version__})")
        raise
    assert exported.mlir_module().count("xla.gpu.triton") == 3
    fused = GpuConfig(bwd_fused=True)
    exported = export.export(jax.jit(lambda *a: block_bwd(*a[:6], TokenInfo(jnp.arange(t, dtype=jnp.int32), None),
                                                          TokenInfo(jnp.arange(t, dtype=jnp.int32), None),
                                                          AttentionOptions(causal=True, softmax_scale=0.1), fused)),
                             platforms=["cuda"], disabled_checks=[check])(*args[:6])
    assert exported.mlir_module().count("xla.gpu.triton") == 1



@pytest.fixture
def triton_withdrawn():
    """jax's Pallas Triton deprecation made an error, as a jax that withdraws the backend does (jax >= 0.12)."""
    deprecations = pytest.importorskip("jax._src.deprecations")
    from ringjax._compat import PALLAS_TRITON_DEPRECATION

    try:
        was = deprecations.is_accelerated(PALLAS_TRITON_DEPRECATION)
    except ValueError:
        pytest.skip(f"jax {jax.__version__} does not deprecate the Pallas Triton backend")
    deprecations.accelerate(PALLAS_TRITON_DEPRECATION)
    yield
    deprecations._registered_deprecations[PALLAS_TRITON_DEPRECATION].accelerated = was


@pytest.mark.skipif(ON_GPU, reason="lowering check is for CPU-only CI")
def test_a_withdrawn_triton_backend_is_refused_not_raised(triton_withdrawn):
    from jax import export

    from ringjax.backends.pallas_triton.implementation import PallasTritonImplementation
    from ringjax.backends.pallas_triton.kernels import block_fwd
    from ringjax.core.masks import TokenInfo

    # the premise: such a jax raises when it lowers a kernel for a GPU, which `auto` must never reach
    info = TokenInfo(jnp.arange(128, dtype=jnp.int32), None)
    s = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with pytest.raises(ValueError, match="Pallas Triton backend is deprecated"):
        export.export(jax.jit(lambda q: block_fwd(q, q, q, info, info, AttentionOptions(causal=True), GpuConfig())),
                      platforms=["cuda"], disabled_checks=[check])(s)
    assert "withdrawn the Pallas Triton backend" in PallasTritonImplementation().supports(_problem())
    assert PallasTritonImplementation(interpret=True).supports(_problem()) is None  # the interpreter lowers no Triton


def test_supported_while_jax_keeps_triton():
    from ringjax import _compat
    from ringjax.backends.pallas_triton.implementation import PallasTritonImplementation

    assert _compat.pallas_triton_withdrawn() is None
    assert PallasTritonImplementation().supports(_problem()) is None

# ----------------------------------------------------------------------------- shared memory (issue 12, defect 2)

SM90, SM80, SM86 = 232448, 166912, 101376  # bytes of shared memory per block on H100/H200, A100, RTX 30/40


def test_shared_memory_estimate_covers_the_measured_request():
    """float32, head_dim 128, 128 x 128 x 3 stages asked an H200 for 394240 bytes and failed to compile."""
    from ringjax.backends.pallas_triton import config as cfg

    need = cfg.shared_memory_bytes(GpuConfig(), head_dim=128, itemsize=4)["forward"]
    assert need >= 394240
    assert cfg.over_limit(GpuConfig(), 128, 4, SM90) is not None


@pytest.mark.parametrize("limit", [SM90, SM80, SM86])
@pytest.mark.parametrize("dtype, head_dim", [("float32", 128), ("float32", 256), ("bfloat16", 256),
                                             ("float16", 128), ("bfloat16", 64)])
def test_every_supported_shape_gets_a_fitting_config(dtype, head_dim, limit):
    from ringjax.backends.pallas_triton import config as cfg

    itemsize = jnp.dtype(dtype).itemsize
    fitted = cfg.fit(GpuConfig(), head_dim, itemsize, limit)
    assert fitted is not None and cfg.over_limit(fitted, head_dim, itemsize, limit) is None
    # only tiles and stages shrink; a config that fits is kept as it is
    assert (fitted.num_warps, fitted.bwd_num_warps, fitted.bwd_fused) == (8, 4, False)
    assert cfg.fit(fitted, head_dim, itemsize, limit) == fitted


def test_fused_backward_estimate_covers_its_measured_request():
    """The fused float32 dK/dV kernel at 64 x 64, 2 stages asked an H200 for 247296 bytes (the split one's estimate
    is 48640 less) and failed to compile: `fit` now shrinks it, and the split config keeps its tiles."""
    from ringjax.backends.pallas_triton import config as cfg

    fused = GpuConfig(bwd_fused=True)
    assert cfg.shared_memory_bytes(fused, 128, 4)["dkv"] >= 247296
    assert cfg.shared_memory_bytes(GpuConfig(), 128, 4)["dkv"] < 247296
    fitted = cfg.fit(fused, 128, 4, SM90)
    assert fitted is not None and fitted.bwd_block_kv < fused.bwd_block_kv
    assert cfg.over_limit(fitted, 128, 4, SM90) is None
    assert cfg.fit(GpuConfig(), 128, 4, SM90).bwd_block_kv == GpuConfig().bwd_block_kv


def test_float32_backward_takes_narrower_key_blocks():
    """float32's default dK/dV key blocks are 32 wide (64 spill registers: measured on an H200); bf16 keeps 64."""
    impl = registry.choose("ring_attention", "pallas_triton", _problem())[1]
    assert impl.default_config(_problem()).bwd_block_kv == 64
    assert impl.default_config(_problem(dtype="float32")).bwd_block_kv == 32
    # and XLA's backward runs by default in float32 (the faster one), Triton's in bf16
    assert impl.default_config(_problem(dtype="float32")).bwd_xla and not impl.default_config(_problem()).bwd_xla
    # the tuner tries both backwards after each forward in float32, only Triton's in bf16
    fp32 = impl.candidate_configs(_problem(dtype="float32"))
    assert impl.default_config(_problem(dtype="float32")) in fp32 and any(not c.bwd_xla for c in fp32)
    assert not any(c.bwd_xla for c in impl.candidate_configs(_problem()))
    assert any(c.bwd_block_kv == 32 for c in impl.candidate_configs(_problem(dtype="float32")))


def test_fitting_keeps_the_measured_bf16_config_and_shrinks_float32():
    """bf16 / head_dim 128 keeps the tiles measured fastest on an H200; float32 gets smaller key blocks."""
    impl = registry.choose("ring_attention", "pallas_triton", _problem())[1]
    assert impl.default_config(_problem()) == GpuConfig()
    fp32 = impl.default_config(_problem(dtype="float32"))
    assert (fp32.block_q, fp32.block_kv, fp32.num_stages) == (128, 64, 2)
    for config in impl.candidate_configs(_problem(dtype="float32")):
        assert ringjax.backends.pallas_triton.config.over_limit(config, 128, 4, SM90) is None


def test_refusals_name_the_limit():
    from ringjax.backends.pallas_triton.implementation import refusal

    assert refusal(_problem(dtype="float32"), (9, 0), SM90) is None
    why = refusal(_problem(dtype="float32", head_dim=256), (9, 0), 40000)
    assert "shared memory" in why and "40000" in why
    assert "compute capability >= 8.0" in refusal(_problem(), (7, 5), 65536)


def test_explicit_config_that_does_not_fit_is_refused_before_running():
    x = make_inputs(41, batch=1, seq=256, heads=2, kv_heads=1, head_dim=128)
    q, k, v = (jnp.asarray(x[name]) for name in ("q", "k", "v"))
    too_big = GpuConfig(interpret=not ON_GPU)  # 128 x 128 tiles, 3 stages: float32 needs ~460 KB
    with pytest.raises(ValueError, match="shared memory"):
        ringjax.ring_attention(q, k, v, axis_name=None, implementation=IMPL, config=too_big)


def test_shrunk_tiles_match_reference():
    """float32 / head_dim 256 runs with fitted tiles (forward 64 x 32, backward 32 x 32), still exact."""
    x = make_inputs(43, batch=1, seq=256, heads=2, kv_heads=1, head_dim=256)
    impl = registry.choose("ring_attention", IMPL, _problem(dtype="float32", head_dim=256, seq=128,
                                                            platform=jax.default_backend()))[1]
    config = impl.default_config(_problem(dtype="float32", head_dim=256, seq=128, platform=jax.default_backend()))
    if not ON_GPU:
        assert (config.block_q, config.block_kv, config.bwd_block_q, config.bwd_block_kv) == (64, 32, 32, 32)
    got = run_ring(x, 2, implementation=IMPL, causal=True)  # no config: the fitted default
    check_against_reference(got, reference_for(x, causal=True), "float32")


def test_invariant_gives_the_same_bits_on_every_ring(monkeypatch):
    """deterministic="invariant" with the Triton kernels: 32-token granule pairs (a 4th of the sequence here),
    the same bits on 1, 2 (zigzag) and 4 (contiguous) devices, and the float64 reference."""
    from ringjax.core import invariant

    monkeypatch.setattr(invariant, "FEWEST_GRANULES", 4)
    x = make_inputs(58, seq=128, segments="random", sinks=True)
    kw = dict(causal=True, sliding_window=50, implementation=IMPL, deterministic="invariant")
    one = run_ring(x, 1, **kw)
    check_against_reference(one, reference_for(x, causal=True, sliding_window=50), "float32")
    for n, layout in [(2, "zigzag"), (4, "contiguous")]:
        if n > len(jax.devices()):
            continue
        got = run_ring(x, n, layout=layout, **kw)
        for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
            assert np.array_equal(one[name], got[name]), (n, name)

"""v with a head_dim of its own (multi-head latent attention: q/k 192, v 128) against the float64 reference.

Every implementation that runs here (xla; pallas_triton and pallas_tpu in their interpreters), every
strategy, the entry points built on ring_attention, the layers, what dispatch sees (Problem, feature
table, costs, cache keys) and the errors for shapes that cannot work.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.pallas_tpu.config import TpuConfig
from ringjax.backends.pallas_triton import GpuConfig
from ringjax.backends.xla import XlaConfig
from ringjax.dispatch import cache, costs, registry
from ringjax.options import AttentionOptions

from harness import check_against_reference, make_inputs, mesh_of, reference_for, rel_err, run_ring
from reference import attention_reference

ON_CPU = jax.default_backend() == "cpu"
BLOCKS = XlaConfig(block_q=8, block_kv=8)  # several blocks per shard


# ---------------------------------------------------------------------------- xla, 1 to 8 devices

# (devices, layout, dtype, make_inputs kwargs, ring_attention kwargs)
XLA_CASES = {
    "1dev_gqa_wider_v": (1, "contiguous", "float32", dict(head_dim=24, v_head_dim=40), dict(causal=True)),
    "2dev_zigzag_window_chunks_softcap_bf16": (2, "zigzag", "bfloat16", dict(head_dim=64, v_head_dim=32),
                                               dict(causal=True, sliding_window=10, chunk_size=12,
                                                    logits_soft_cap=3.0)),
    "4dev_striped_mqa_segments_sinks_alibi_dropout": (
        4, "striped", "float32", dict(heads=4, kv_heads=1, head_dim=12, v_head_dim=20, segments="random", sinks=True,
                                      alibi=True, dropout_key=3), dict(causal=True, dropout_rate=0.2)),
    # a window shortens the ring: the sink tokens get a step of their own
    "8dev_window_sink_tokens_bf16": (8, "contiguous", "bfloat16", dict(batch=1, head_dim=48, v_head_dim=32),
                                     dict(causal=True, sliding_window=5, num_sink_tokens=3)),
}


@pytest.mark.parametrize("case", sorted(XLA_CASES))
def test_xla_ring_matches_reference(case):
    n, layout, dtype, xkw, kw = XLA_CASES[case]
    x = make_inputs(sorted(XLA_CASES).index(case) + 900, seq=32, dtype=dtype, **xkw)
    got = run_ring(x, n, layout=layout, implementation="xla", config=BLOCKS, **kw)
    assert got["out"].shape[-1] == got["dv"].shape[-1] == xkw["v_head_dim"] != got["dq"].shape[-1]
    check_against_reference(got, reference_for(x, **kw), dtype)


def test_default_scale_is_one_over_sqrt_of_q_head_dim():
    x = make_inputs(1, batch=1, seq=16, head_dim=16, v_head_dim=64)
    q, k, v = (jnp.asarray(x[name]) for name in ("q", "k", "v"))
    default = ringjax.ring_attention(q, k, v, axis_name=None, causal=True)
    explicit = ringjax.ring_attention(q, k, v, axis_name=None, causal=True, softmax_scale=16 ** -0.5)
    assert default.shape == (1, 16, 4, 64)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(explicit))
    other = ringjax.ring_attention(q, k, v, axis_name=None, causal=True, softmax_scale=64 ** -0.5)
    assert rel_err(other, default) > 1e-3


# ---------------------------------------------------------------------------- strategies

STRATEGY_CASES = [
    # (mesh shape, strategy, layout, make_inputs kwargs, ring_attention kwargs)
    ((4,), "all_gather", "zigzag", dict(head_dim=24, v_head_dim=8), dict(causal=True, sliding_window=30)),
    ((4,), "ulysses", "striped", dict(heads=4, kv_heads=2, head_dim=8, v_head_dim=24, segments="random"),
     dict(causal=True)),
    ((2, 2), "hybrid", "zigzag", dict(heads=4, kv_heads=1, head_dim=16, v_head_dim=32, sinks=True),
     dict(causal=True, logits_soft_cap=4.0)),
]


@pytest.mark.parametrize("shape, strategy, layout, xkw, kw", STRATEGY_CASES)
def test_strategies_match_reference(shape, strategy, layout, xkw, kw):
    from test_strategies import run_strategy  # the strategies' runner (one axis or a (head, ring) pair)

    x = make_inputs(len(shape) * 10 + len(kw), batch=1, seq=32, **xkw)
    got = run_strategy(x, shape, strategy, layout=layout, **kw)
    check_against_reference(got, reference_for(x, **kw), "float32")


# ---------------------------------------------------------------------------- pallas_triton

TRITON_IMPL = "pallas_triton" if jax.default_backend() == "gpu" else "pallas_triton_interpret"
TRITON = dict(block_q=16, block_kv=16, num_warps=4, num_stages=2, bwd_block_q=16, bwd_block_kv=16,
              interpret=TRITON_IMPL.endswith("interpret"))


@pytest.mark.matmul_precision("default")
@pytest.mark.parametrize("n, layout, dtype, xkw, kw, fused", [
    (2, "zigzag", "float32", dict(head_dim=32, v_head_dim=16), dict(causal=True), False),
    (2, "contiguous", "bfloat16", dict(head_dim=16, v_head_dim=64, segments="random"),
     dict(causal=True, sliding_window=20), True),
])
def test_triton_matches_reference(n, layout, dtype, xkw, kw, fused):
    x = make_inputs(n * 3 + fused, batch=1, seq=64, dtype=dtype, **xkw)
    got = run_ring(x, n, layout=layout, implementation=TRITON_IMPL, config=GpuConfig(bwd_fused=fused, **TRITON), **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


def test_triton_shared_memory_counts_both_head_dims():
    from ringjax.backends.pallas_triton import config as cfg

    same = cfg.shared_memory_bytes(GpuConfig(), 128, 2)
    assert cfg.shared_memory_bytes(GpuConfig(), 128, 2, v_head_dim=128) == same
    wide = cfg.shared_memory_bytes(GpuConfig(), 128, 2, v_head_dim=256)
    assert all(wide[k] > same[k] for k in same)
    assert cfg.shared_memory_bytes(GpuConfig(), 256, 2, v_head_dim=128)["forward"] > wide["forward"]  # Q is d wide


# ---------------------------------------------------------------------------- pallas_tpu (interpreter)

needs_tpu_interpreter = pytest.mark.skipif(not ON_CPU or importlib.util.find_spec("jax.experimental.pallas.tpu")
                                           is None, reason="the Pallas TPU interpreter runs on CPU")


@needs_tpu_interpreter
@pytest.mark.parametrize("fused, dtype, xkw, kw", [
    (False, "float32", dict(head_dim=32, v_head_dim=16, segments="random"), dict(causal=True, logits_soft_cap=2.0)),
    (True, "float32", dict(head_dim=16, v_head_dim=64, sinks=True), dict(causal=True, sliding_window=(9, 0))),
])
def test_tpu_interpreter_matches_reference(fused, dtype, xkw, kw, capfd):
    """The per-step kernels take both head_dims; the fused ring pads to the wider one."""
    from ringjax.backends.pallas_tpu.kernels import races_found, reset_interpreter

    reset_interpreter()
    x = make_inputs(5 + fused, batch=1, seq=32, dtype=dtype, **xkw)
    config = TpuConfig(block_q=8, block_kv=8, fused=fused, interpret=True, detect_races=fused)
    got = run_ring(x, 2, layout="zigzag", implementation="pallas_tpu_interpret", config=config, **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)
    assert not races_found() and "RACE DETECTED" not in capfd.readouterr().out
    reset_interpreter()


@pytest.mark.skipif(importlib.util.find_spec("jax.experimental.pallas.tpu") is None, reason="no Pallas TPU module")
@pytest.mark.parametrize("fused", [False, True])
def test_tpu_kernels_lower_with_two_head_dims(fused):
    """Both the per-step kernels and the fused ring lower to Mosaic TPU at 256 / 128."""
    from ringjax.backends.pallas_tpu.implementation import IMPLEMENTATION
    from ringjax.core.masks import Extras

    n, b, t, h, kvh, d, dv = 2, 1, 256, 4, 2, 256, 128
    problem = registry.Problem(opts=AttentionOptions(axis_name="sp", axis_size=n, causal=True, layout="zigzag"),
                               batch=b, seq=t, heads=h, kv_heads=kvh, head_dim=d, v_head_dim=dv, dtype="bfloat16",
                               platform="tpu")
    assert IMPLEMENTATION.supports(problem) is None
    config = TpuConfig(block_q=128, block_kv=128, fused=fused)
    mesh, spec = mesh_of(n), P(None, "sp")

    def per_device(q, k, v, w):
        def loss(q, k, v):
            out, lse = IMPLEMENTATION.run(problem, config, q, k, v, None, None, None, Extras())
            return (out.astype(jnp.float32) * w).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3)
    arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    args = (arg((b, t * n, h, d), jnp.bfloat16), arg((b, t * n, kvh, d), jnp.bfloat16),
            arg((b, t * n, kvh, dv), jnp.bfloat16), arg((b, t * n, h, dv), jnp.float32))
    with jax.set_mesh(mesh):
        text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") == (2 if fused else 3 * n)


def test_tpu_vmem_counts_both_head_dims():
    from ringjax.backends.pallas_tpu.config import vmem_bytes

    config = TpuConfig(block_q=256, block_kv=512)
    same = vmem_bytes(config, 4, 128, "bfloat16")
    assert vmem_bytes(config, 4, 128, "bfloat16", 128) == same
    assert vmem_bytes(config, 4, 128, "bfloat16", 64) < same < vmem_bytes(config, 4, 128, "bfloat16", 256)
    # the fused ring pads both to the wider head_dim
    fused = TpuConfig(block_q=256, block_kv=512, fused=True)
    assert vmem_bytes(fused, 4, 128, "bfloat16", 64) == vmem_bytes(fused, 4, 128, "bfloat16")


# ---------------------------------------------------------------------------- what dispatch sees


def _problem(**kw):
    base = dict(opts=AttentionOptions(causal=True), batch=1, seq=1024, heads=8, kv_heads=2, head_dim=192,
                v_head_dim=128, dtype="bfloat16", platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    base.update(kw)
    return registry.Problem(**base)


def test_problem_fills_v_head_dim_in():
    plain = registry.Problem(opts=AttentionOptions(), batch=1, seq=64, heads=2, kv_heads=1, head_dim=32,
                             dtype="float32", platform="cpu")
    assert plain.v_head_dim == 32 and plain == registry.Problem(**{**plain.__dict__, "v_head_dim": 32})
    assert _problem().head_dims == (192, 128)


def test_feature_table_declares_it_for_every_implementation():
    regs = {r.name: r for r in registry.registrations("ring_attention")}
    for name, reg in regs.items():
        why = reg.support.refusal(name, _problem(head_dim=64, v_head_dim=128))
        if reg.support.v_head_dim_refusal is None:
            assert why is None or "v head_dim" not in why, (name, why)
        else:
            assert f"v head_dim 128 other than q/k's head_dim 64 is not implemented in {name}" in why
    assert "| v head_dim differs |" in registry.feature_table()


def test_a_support_can_refuse_it_with_its_reason():
    from ringjax.core.features import BY_NAME, Support

    support = Support(features=frozenset(BY_NAME), dtypes=("bfloat16",), v_head_dim_refusal="one tile width")
    assert support.refusal("mine", _problem(v_head_dim=192)) is None
    why = support.refusal("mine", _problem())
    assert why == "v head_dim 128 other than q/k's head_dim 192 is not implemented in mine: one tile width"


@pytest.mark.parametrize("name, kw, match", [
    ("pallas_triton", dict(head_dim=64, v_head_dim=48), "v head_dim 48 is not supported: needs a power of two"),
    ("pallas_triton", dict(head_dim=192, v_head_dim=128), "head_dim 192 is not supported"),
    ("pallas_tpu", dict(head_dim=128, v_head_dim=96, platform="tpu"), "v head_dim 96 is not supported"),
])
def test_each_head_dim_is_checked(name, kw, match):
    reg = next(r for r in registry.registrations("ring_attention") if r.name == name)
    why = registry.refusal(reg, _problem(**kw))
    assert why is not None and match in why, why


def test_forward_flops_count_qk_at_head_dim_and_pv_at_v_head_dim():
    mla, square = _problem(), _problem(v_head_dim=192)
    pairs = costs.visible_pairs(mla.opts, mla.seq)
    assert costs.forward_flops(mla) == 2.0 * 8 * (192 + 128) * pairs
    assert costs.forward_flops(square) == 4.0 * 8 * 192 * pairs  # as before for one head_dim


def test_cache_keys_tell_v_head_dims_apart():
    mla, square = _problem(), _problem(v_head_dim=192)
    assert cache.key_id(cache.portable_key("ring_attention", "xla", mla)) != \
        cache.key_id(cache.portable_key("ring_attention", "xla", square))
    assert cache.portable_key("ring_attention", "xla", mla)["shape"]["v_head_dim"] == 128
    assert "v_head_dim" not in cache.portable_key("ring_attention", "xla", square)["shape"]  # keys as before


def test_explain_reports_both_head_dims():
    from ringjax.__main__ import explain

    text = explain(shape=(1, 8192, 16, 192), kv_heads=16, v_head_dim=128, causal=True,
                   device_kind="NVIDIA H100 80GB HBM3")
    assert "head_dim 192 (v 128)" in text


# ---------------------------------------------------------------------------- errors

BAD = [
    ("v must have shape \\[batch, seq, kv_heads, v_head_dim\\] = \\[1, 16, 2, v_head_dim\\]",
     lambda q, k, v: ringjax.ring_attention(q, k, v[:, :, :1], axis_name=None)),
    ("v must have shape", lambda q, k, v: ringjax.ring_attention(q, k, v[:, :8], axis_name=None)),
    ("v must have shape", lambda q, k, v: ringjax.ring_attention(q, k, jnp.concatenate([v, v]), axis_name=None)),
    ("k head_dim 12 must equal q head_dim 8", lambda q, k, v: ringjax.ring_attention(
        q, jnp.concatenate([k, k[..., :4]], -1), v, axis_name=None)),
    ("kv packs K and V with one head_dim \\(12\\), which must equal q's head_dim \\(8\\)",
     lambda q, k, v: ringjax.ring_attention_kvpacked(q, jnp.stack([v, v], axis=2), axis_name=None)),
    ("out must have part 0's shape", lambda q, k, v: ringjax.merge_attention(
        v, jnp.zeros((1, 2, 16)), k, jnp.zeros((1, 2, 16)))),
]


@pytest.mark.parametrize("match, call", BAD, ids=[m[:30] for m, _ in BAD])
def test_bad_shapes_raise_naming_the_argument(match, call):
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 16, h, 8)), jnp.float32) for h in (4, 2))
    v = jnp.asarray(rng.standard_normal((1, 16, 2, 12)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


# ---------------------------------------------------------------------------- entry points and layouts


def test_merge_and_layouts_keep_v_head_dim():
    x = make_inputs(2, batch=1, seq=32, head_dim=8, v_head_dim=24)
    out, lse = ringjax.ring_attention(*(jnp.asarray(x[n]) for n in ("q", "k", "v")), axis_name=None, return_lse=True)
    merged, merged_lse = ringjax.merge_attention(out, lse, out, lse)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged_lse), np.asarray(lse) + np.log(2.0), rtol=1e-6)
    z = ringjax.to_layout(out, "zigzag", axis_size=4)
    np.testing.assert_array_equal(np.asarray(ringjax.from_layout(z, "zigzag", axis_size=4)), np.asarray(out))


def test_varlen_with_its_own_v_head_dim():
    x = make_inputs(4, batch=1, seq=32, head_dim=8, v_head_dim=16)
    cu = jnp.asarray([0, 11, 27], jnp.int32)
    got = ringjax.ring_attention_varlen(*(jnp.asarray(x[n][0]) for n in ("q", "k", "v")), cu, axis_name=None,
                                        causal=True)
    seg = np.where(np.arange(32) < 11, 0, np.where(np.arange(32) < 27, 1, -1))[None]
    ref = attention_reference(x["q"], x["k"], x["v"], causal=True, segment_ids=seg)
    assert got.shape == (32, 4, 16)
    assert rel_err(got, ref["out"][0]) < 1e-5


def test_dilated_attention_with_its_own_v_head_dim():
    from test_dilated import reference, run_dilated  # the dilated runner and its per-head reference

    x = make_inputs(6, batch=1, seq=32, heads=4, head_dim=8, v_head_dim=12)
    branches = ((16, 2),)
    got = run_dilated(x, 2, branches, layout="zigzag", causal=True)
    assert got["out"].shape[-1] == 12
    check_against_reference(got, reference(x, branches, causal=True), "float32")


# ---------------------------------------------------------------------------- layers


def _layer(framework, **kw):
    """(apply(params, x), params) of a layer with head_dim 8 and v_head_dim 12, no rotary embeddings."""
    kw = dict(num_kv_heads=2, head_dim=8, v_head_dim=12, rope_base=None, causal=True, **kw)
    if framework == "nnx":
        from flax import nnx

        from ringjax.flax import MultiHeadAttention

        graphdef, params = nnx.split(MultiHeadAttention(16, 4, rngs=nnx.Rngs(0), **kw))
        return (lambda p, x: nnx.merge(graphdef, p)(x)), params
    if framework == "linen":
        from ringjax.flax import LinenMultiHeadAttention

        model = LinenMultiHeadAttention(4, **kw)
        return model.apply, model.clone(axis_name=None).init(jax.random.key(0), jnp.zeros((1, 32, 16)))
    import equinox as eqx

    from ringjax.equinox import MultiHeadAttention

    params, static = eqx.partition(MultiHeadAttention(16, 4, key=jax.random.key(0), **kw), eqx.is_array)
    return (lambda p, x: eqx.combine(p, static)(x)), params


def _projections(framework, params):
    if framework == "linen":
        return {n: np.asarray(params["params"][f"{n}_proj"]) for n in "qkvo"}
    if framework == "nnx":
        return {n: np.asarray(getattr(params, f"{n}_proj")[...]) for n in "qkvo"}
    return {n: np.asarray(getattr(params, f"{n}_proj")) for n in "qkvo"}


@pytest.mark.parametrize("framework", [
    pytest.param(f, marks=pytest.mark.skipif(importlib.util.find_spec(m) is None, reason=f"needs {m}"))
    for f, m in (("nnx", "flax"), ("linen", "flax"), ("equinox", "equinox"))])
def test_layers_take_a_v_head_dim(framework):
    apply, params = _layer(framework, axis_name="sp")
    w = _projections(framework, params)
    assert w["v"].shape == (16, 2, 12) and w["o"].shape == (4, 12, 16) and w["k"].shape == (16, 2, 8)
    x = np.random.default_rng(1).standard_normal((2, 32, 16)).astype(np.float32)
    qkv = {n: np.einsum("btf,fhd->bthd", x.astype(np.float64), w[n]) for n in "qkv"}
    want = np.einsum("bthd,hdf->btf", attention_reference(qkv["q"], qkv["k"], qkv["v"], causal=True)["out"], w["o"])
    mesh, spec = mesh_of(2), P(None, "sp")
    sharded = jax.shard_map(apply, mesh=mesh, in_specs=(P(), spec), out_specs=spec)
    with jax.default_matmul_precision("highest"), jax.set_mesh(mesh):
        got = jax.jit(sharded)(params, jax.device_put(x, NamedSharding(mesh, spec)))
    assert rel_err(got, want) < 1e-5


def test_layer_config_checks_v_head_dim():
    from ringjax.layers.core import AttentionLayerConfig

    with pytest.raises(ValueError, match="v_head_dim must be a positive int or None"):
        AttentionLayerConfig(in_features=16, num_heads=4, v_head_dim=0)
    cfg = AttentionLayerConfig(in_features=16, num_heads=4)
    assert cfg.param_shapes()["o"] == (4, 4, 16)  # v_head_dim defaults to head_dim

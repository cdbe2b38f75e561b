"""The Flax NNX, Flax Linen and Equinox layers: sharded sequence == unsharded sequence.

Each layer runs inside jax.shard_map on 4 simulated devices with the sequence
sharded (zigzag / contiguous layout) and is compared, output and every parameter
gradient, with the same parameters run with axis_name=None on the whole sequence
in natural order.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.layers.rotary import apply_rotary, token_positions

from harness import rel_err

needs_flax = pytest.mark.skipif(importlib.util.find_spec("flax") is None,
                                reason="the Flax layers need flax (pip install ringjax[flax])")
needs_equinox = pytest.mark.skipif(importlib.util.find_spec("equinox") is None,
                                   reason="the Equinox layer needs equinox (pip install ringjax[equinox])")

N = 4
BATCH, SEQ, FEATURES, HEADS, KV_HEADS = 2, 32, 16, 4, 2
FEATURES_BY_LAYOUT = {
    "zigzag": dict(causal=True, use_sinks=True, logits_soft_cap=5.0),
    "contiguous": dict(causal=True, use_sinks=True, sliding_window=9),
}


def _mesh():
    if len(jax.devices()) < N:
        pytest.skip(f"needs {N} devices, {len(jax.devices())} {jax.default_backend()} devices here")
    return jax.make_mesh((N,), ("sp",), devices=jax.devices()[:N])


def _randomize(tree, seed):
    """Replace every parameter with fresh random values (sinks included, so they matter)."""
    leaves, treedef = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, new)


def _nnx(axis_name, layout, kw):
    from flax import nnx

    from ringjax.flax import MultiHeadAttention

    model = MultiHeadAttention(FEATURES, HEADS, num_kv_heads=KV_HEADS, axis_name=axis_name, layout=layout,
                               rngs=nnx.Rngs(0), **kw)
    graphdef, state = nnx.split(model)
    return (lambda p, x, seg, **kw: nnx.merge(graphdef, p)(x, segment_ids=seg, **kw)), state


def _linen(axis_name, layout, kw):
    from ringjax.flax import LinenMultiHeadAttention

    model = LinenMultiHeadAttention(HEADS, num_kv_heads=KV_HEADS, axis_name=axis_name, layout=layout, **kw)
    # parameters do not depend on the axis; init runs the forward, so do it unsharded
    params = jax.eval_shape(model.clone(axis_name=None).init, jax.random.key(0), jnp.zeros((BATCH, SEQ, FEATURES)))
    return (lambda p, x, seg, **kw: model.apply(p, x, segment_ids=seg, **kw)), params


def _equinox(axis_name, layout, kw):
    import equinox as eqx

    from ringjax.equinox import MultiHeadAttention

    model = MultiHeadAttention(FEATURES, HEADS, num_kv_heads=KV_HEADS, axis_name=axis_name, layout=layout,
                               key=jax.random.key(0), **kw)
    params, static = eqx.partition(model, eqx.is_array)
    return (lambda p, x, seg, **kw: eqx.combine(p, static)(x, segment_ids=seg, **kw)), params


LAYERS = {"nnx": _nnx, "linen": _linen, "equinox": _equinox}
MARKS = {"nnx": needs_flax, "linen": needs_flax, "equinox": needs_equinox}


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SEQ, FEATURES)).astype(np.float32)
    dout = rng.standard_normal((BATCH, SEQ, FEATURES)).astype(np.float32)
    # packed documents crossing shard boundaries
    cuts = np.sort(rng.choice(np.arange(1, SEQ), size=3, replace=False))
    seg = np.broadcast_to(np.searchsorted(cuts, np.arange(SEQ), side="right"), (BATCH, SEQ)).astype(np.int32)
    return x, dout, seg


def _loss_and_grads(apply, params, x, seg, dout):
    def loss(p, x):
        out = apply(p, x, seg)
        return (out * dout).sum(), out

    # float32 projections in full precision: GPUs would otherwise round them to TF32, and this test
    # is about sharding, not about matmul precision
    with jax.default_matmul_precision("highest"):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("framework", [pytest.param(name, marks=MARKS[name]) for name in sorted(LAYERS)])
def test_sharded_layer_matches_unsharded(framework, layout):
    kw = FEATURES_BY_LAYOUT[layout]
    dense_apply, params = LAYERS[framework](None, layout, kw)
    ring_apply, ring_params = LAYERS[framework]("sp", layout, kw)
    assert [p.shape for p in jax.tree.leaves(params)] == [p.shape for p in jax.tree.leaves(ring_params)]
    seed = 2 * sorted(LAYERS).index(framework) + sorted(FEATURES_BY_LAYOUT).index(layout)
    # the same values in both (the Equinox treedef also holds the static config, so keep each tree)
    params, ring_params = _randomize(params, seed=seed), _randomize(ring_params, seed=seed)
    x, dout, seg = _inputs(seed=100 + seed)

    ref_out, (ref_dp, ref_dx) = _loss_and_grads(dense_apply, params, x, seg, dout)

    mesh = _mesh()
    spec = P(None, "sp")
    sharded = jax.shard_map(ring_apply, mesh=mesh, in_specs=(P(), spec, spec), out_specs=spec)
    to = lambda a: jax.device_put(ringjax.to_layout(jnp.asarray(a), layout, N), NamedSharding(mesh, spec))  # noqa: E731
    out, (dp, dx) = _loss_and_grads(sharded, ring_params, to(x), to(seg), to(dout))
    back = lambda a: ringjax.from_layout(np.asarray(a), layout, N)  # noqa: E731

    assert rel_err(back(out), ref_out) < 1e-5
    assert rel_err(back(dx), ref_dx) < 1e-5
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_dp)[0]
    flat = jax.tree.leaves(dp)
    assert len(flat) == len(flat_ref) == 5  # q, k, v, o projections and sinks
    for (path, want), got in zip(flat_ref, flat):
        assert np.abs(np.asarray(want)).max() > 0, f"{jax.tree_util.keystr(path)} has a zero gradient"
        err = rel_err(got, want)
        assert err < 1e-5, f"{framework}/{layout} d{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("framework", [pytest.param(name, marks=MARKS[name]) for name in sorted(LAYERS)])
def test_decode_with_a_cache_matches_the_full_sequence(framework):
    """A prompt, then one token at a time into a cache sharded over 4 devices: the outputs of the whole
    sequence in one call (rotary embeddings at global positions, window, soft cap, sinks)."""
    kw = dict(causal=True, use_sinks=True, sliding_window=5, logits_soft_cap=5.0)
    apply, params = LAYERS[framework](None, "contiguous", kw)
    params = _randomize(params, seed=7)
    x = _inputs(seed=8)[0][:, :12]
    with jax.default_matmul_precision("highest"):
        full = jax.jit(apply)(params, x, None)
        step = jax.jit(lambda p, x, cache: apply(p, x, None, cache=cache))
        cache = ringjax.KVCache.create(BATCH, 16, KV_HEADS, FEATURES // HEADS, dtype=jnp.float32, mesh=_mesh())
        outs = []
        for lo, hi in [(0, 6)] + [(i, i + 1) for i in range(6, 12)]:
            y, cache = step(params, x[:, lo:hi], cache)
            outs.append(y)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])
    assert rel_err(np.concatenate(outs, axis=1), full) < 1e-5


@needs_equinox
def test_global_arrays_under_set_mesh():
    """Called on global arrays (no shard_map), the layer shards the sequence itself."""
    import equinox as eqx

    from ringjax.equinox import MultiHeadAttention

    layout, kw = "zigzag", dict(causal=True, num_kv_heads=KV_HEADS)
    ring = MultiHeadAttention(FEATURES, HEADS, axis_name="sp", layout=layout, key=jax.random.key(1), **kw)
    dense = MultiHeadAttention(FEATURES, HEADS, axis_name=None, key=jax.random.key(1), **kw)
    x, _, seg = _inputs(seed=7)
    mesh = _mesh()
    with jax.default_matmul_precision("highest"):  # float32 projections: no TF32 rounding on a GPU
        with jax.set_mesh(mesh):
            xs = jax.device_put(ringjax.to_layout(jnp.asarray(x), layout, N), NamedSharding(mesh, P(None, "sp")))
            out = eqx.filter_jit(lambda m, x: m(x))(ring, xs)
        want = eqx.filter_jit(dense)(jnp.asarray(x))
    assert rel_err(ringjax.from_layout(np.asarray(out), layout, N), want) < 1e-5


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_rotary_positions_are_global(layout):
    mesh = _mesh()
    seq = 16
    local = jax.shard_map(lambda: token_positions(seq // N, axis_name="sp", layout=layout),
                          mesh=mesh, in_specs=(), out_specs=P("sp"))()
    np.testing.assert_array_equal(ringjax.from_layout(np.asarray(local), layout, N, axis=0), np.arange(seq))
    with jax.set_mesh(mesh):
        global_order = token_positions(seq, axis_name="sp", layout=layout)
    np.testing.assert_array_equal(np.asarray(global_order), np.asarray(local))
    np.testing.assert_array_equal(np.asarray(token_positions(seq, axis_name=None)), np.arange(seq))

    # rotary at the layout's positions, put back in natural order == rotary in natural order
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, seq, 2, 8)), jnp.float32)
    rotated = apply_rotary(ringjax.to_layout(q, layout, N), local)
    np.testing.assert_allclose(ringjax.from_layout(rotated, layout, N), apply_rotary(q, jnp.arange(seq)),
                               rtol=1e-6, atol=1e-6)


def test_rotary_scores_depend_on_relative_position():
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)

    def score(i, j):
        return float((apply_rotary(q, jnp.array([i])) * apply_rotary(k, jnp.array([j]))).sum())

    assert score(5, 2) == pytest.approx(score(103, 100), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-2)


@needs_equinox
def test_layer_config_validation():
    from ringjax.equinox import MultiHeadAttention

    key = jax.random.key(0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(16, 4, num_kv_heads=3, key=key)
    with pytest.raises(ValueError, match="layout"):
        MultiHeadAttention(16, 4, layout="diagonal", key=key)
    with pytest.raises(ValueError, match="even head_dim"):
        MultiHeadAttention(12, 4, key=key)
    with pytest.raises(ValueError, match="in_features"):
        MultiHeadAttention(16, 4, axis_name=None, key=key)(jnp.ones((1, 8, 12)))
    with pytest.raises(ValueError, match="sliding_window"):
        MultiHeadAttention(16, 4, sliding_window=-1, key=key)
    with pytest.raises(TypeError, match="key must be one jax.random key .*got int"):
        MultiHeadAttention(16, 4, key=0)
    with pytest.raises(ValueError, match="implementation must be 'auto' or one of: .*xla.*; got 'foo'"):
        MultiHeadAttention(16, 4, key=key, implementation="foo")  # at construction, not at the first call
    with pytest.raises(TypeError, match="param_dtype must be a floating-point dtype"):
        MultiHeadAttention(16, 4, key=key, param_dtype=jnp.int32)
    with pytest.raises(TypeError, match="positions must be an array of shape \\[seq\\] or \\[batch, seq\\], got list"):
        MultiHeadAttention(16, 4, axis_name=None, key=key)(jnp.ones((1, 8, 16)), positions=list(range(8)))
    with pytest.raises(ValueError, match="counts .* applies only with a cache"):
        MultiHeadAttention(16, 4, axis_name=None, key=key)(jnp.ones((1, 8, 16)), counts=jnp.array([8]))
    layer = MultiHeadAttention(16, 4, axis_name=None, num_kv_heads=2, key=key)
    wrong = ringjax.KVCache.create(1, 16, 4, 4, dtype=jnp.float32)  # 4 kv heads where the layer has 2
    with pytest.raises(ValueError, match=r"cache must hold \(batch, kv_heads, head_dim, v_head_dim\) = \(1, 2, 4, 4\)"):
        layer(jnp.ones((1, 3, 16)), cache=wrong)
    y, cache = layer(jnp.ones((1, 3, 16)), cache=ringjax.KVCache.create(1, 16, 2, 4, dtype=jnp.float32))
    assert y.shape == (1, 3, 16) and int(cache.lengths[0]) == 3


def test_core_import_does_not_import_optional_packages():
    code = ("import sys, ringjax, ringjax.layers.rotary; "
            "bad = [m for m in ('flax', 'equinox', 'optax', 'matplotlib', 'tqdm') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@needs_flax
@pytest.mark.parametrize("framework", [pytest.param(name, marks=MARKS[name]) for name in LAYERS])
@pytest.mark.parametrize("field, value", [("dtype", "foo"), ("dtype", jnp.int32), ("param_dtype", None)])
def test_layer_dtypes_are_refused_by_name(framework, field, value):
    """A dtype that is not floating names the layer's argument (it was refused at the first call, as q's)."""
    with pytest.raises(TypeError, match=f"{field} must be a floating-point dtype"):
        LAYERS[framework](None, "contiguous", {field: value})


def test_linen_attributes_are_the_layer_config_fields():
    """Linen declares its attributes; they must stay the config's fields (but in_features), defaults included."""
    import dataclasses

    from ringjax.flax import LinenMultiHeadAttention
    from ringjax.layers.core import AttentionLayerConfig

    config = {f.name: f.default for f in dataclasses.fields(AttentionLayerConfig) if f.name != "in_features"}
    linen = {f.name: f.default for f in dataclasses.fields(LinenMultiHeadAttention) if f.name in config}
    assert linen == config


@pytest.mark.parametrize("framework", [pytest.param("nnx", marks=needs_flax),
                                       pytest.param("equinox", marks=needs_equinox)])
def test_layer_takes_a_config_or_its_fields(framework):
    from ringjax.layers.core import AttentionLayerConfig

    if framework == "nnx":
        from flax import nnx

        from ringjax.flax import MultiHeadAttention

        make = lambda *a, **kw: MultiHeadAttention(*a, rngs=nnx.Rngs(0), **kw)  # noqa: E731
    else:
        from ringjax.equinox import MultiHeadAttention

        make = lambda *a, **kw: MultiHeadAttention(*a, key=jax.random.key(0), **kw)  # noqa: E731
    config = AttentionLayerConfig(in_features=16, num_heads=4, num_kv_heads=2, causal=True, axis_name=None)
    by_fields = make(16, 4, num_kv_heads=2, causal=True, axis_name=None)
    by_config = make(config=config)
    assert by_fields.config == by_config.config == config
    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 8, 16)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(by_fields(x)), np.asarray(by_config(x)))
    with pytest.raises(TypeError, match="not both"):
        make(16, config=config)
    with pytest.raises(TypeError, match="not both"):
        make(config=config, causal=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        make(16, 4, num_kv_head=2)

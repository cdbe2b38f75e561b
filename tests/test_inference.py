"""KVCache and cache_attention against the float64 reference: decode, prefill (whole and chunked),
ragged rows, every mask feature, both strategies, global arrays and shard_map, jit and lax.scan;
gradients (sinks only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.xla import XlaCacheConfig
from ringjax.backends.xla.kernels import cache_partials
from ringjax.core.masks import Extras
from ringjax.options import AttentionOptions

from harness import ON_HOPPER, TOLERANCE, mesh_of, rel_err, tolerance_key
from reference import attention_reference

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# several query blocks, chunks and loop steps even at these sizes
SMALL = XlaCacheConfig(block_q=2, block_kv=2, max_scores=64)


def _tokens(seed, batch, length, dtype="float32", heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """q [B, L, H, D], k, v [B, L, KVH, D] of a whole sequence in position order, exact in `dtype`."""
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal((batch, length, h, head_dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads)]
    return [np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in x]


def _check(got_out, got_lse, ref_out, ref_lse, dtype="float32"):
    got_out, got_lse = np.asarray(got_out, np.float64), np.asarray(got_lse, np.float64)
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any()
    tol = TOLERANCE[tolerance_key(dtype)]
    assert rel_err(got_out, ref_out) < tol, rel_err(got_out, ref_out)
    assert rel_err(got_lse, ref_lse) < tol, rel_err(got_lse, ref_lse)


def _session(cache, q, k, v, schedule, *, dtype="float32", **kw):
    """Append each (t, counts, strategy) of `schedule` to `cache` and attend with the queries of those
    tokens; every step is checked against one reference call over the whole rows, where a count mask lets
    the query at each position see the keys the cache held when it was appended. Returns the cache."""
    batch, seq = q.shape[:2]
    lengths = np.zeros(batch, int)
    limit = np.zeros((batch, seq), int)  # how many keys the query at each position saw
    steps = []
    for t, counts, strategy in schedule:
        grow = np.full(batch, t) if counts is None else np.asarray(counts)
        # the new tokens of each row, padded to t
        qc, kc, vc = (jnp.asarray(np.stack([np.pad(x[b, lengths[b]:lengths[b] + grow[b]], ((0, t - grow[b]), (0, 0),
                                                                                        (0, 0)))
                                            for b in range(batch)]), dtype) for x in (q, k, v))
        c = None if counts is None else jnp.asarray(counts, jnp.int32)
        cache = cache.append(kc, vc, c)
        out, lse = ringjax.cache_attention(qc, cache, counts=c, return_lse=True, strategy=strategy, **kw)
        assert out.shape == (batch, t, q.shape[2], v.shape[3]) and out.dtype == jnp.dtype(dtype)
        steps.append((out, lse, lengths.copy(), grow))
        for b in range(batch):
            limit[b, lengths[b]:lengths[b] + grow[b]] = lengths[b] + grow[b]
        lengths = lengths + grow
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    total = int(lengths.max())
    ref_kw = {"causal": True}  # cache_attention's default
    ref_kw.update({("window" if name == "sliding_window" else name): np.asarray(value) if hasattr(value, "shape")
                   else value for name, value in kw.items() if name not in ("config", "implementation")})
    seen = (np.arange(total)[None, None, :] < limit[:, :total, None])[:, None]  # [B, 1, T, T]
    ref = attention_reference(q[:, :total], k[:, :total], v[:, :total], counts=seen, **ref_kw)
    for out, lse, before, grow in steps:
        want_out, want_lse = np.zeros(out.shape), np.full(lse.shape, -np.inf)  # padding queries: 0, -inf
        for b in range(batch):
            rows = slice(before[b], before[b] + grow[b])
            want_out[b, :grow[b]], want_lse[b, :, :grow[b]] = ref["out"][b, rows], ref["lse"][b, :, rows]
        _check(out, lse, want_out, want_lse, dtype=dtype)
    return cache


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_prefill_then_decode_matches_reference(n):
    """A prompt, a second chunk, two single-token steps and a 4-token (speculative) step."""
    q, k, v = _tokens(n, 2, 24)
    cache = ringjax.KVCache.create(2, 24 if n != 8 else 32, KV_HEADS, HEAD_DIM, dtype=jnp.float32,
                                   mesh=mesh_of(n))
    assert cache.k.addressable_shards[0].data.shape[1] == cache.capacity // n  # the cache per device
    schedule = [(8, None, "auto"), (8, None, "auto"), (1, None, "auto"), (1, None, "auto"), (4, None, "auto")]
    cache = _session(cache, q, k, v, schedule)
    k_ord, v_ord = (np.asarray(x) for x in cache.ordered())
    np.testing.assert_array_equal(k_ord[:, :22], k[:, :22])
    assert not k_ord[:, 22:].any() and not v_ord[:, 22:].any()  # nothing written past the lengths


@pytest.mark.parametrize("strategy", ["pass_q", "pass_kv"])
def test_prefill_strategies(strategy, n=4):
    q, k, v = _tokens(10 + n, 2, 20)
    cache = ringjax.KVCache.create(2, 24, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh_of(n))
    # a whole 8-token prompt, a second chunk of 8 after it, then decode
    _session(cache, q, k, v, [(8, None, strategy), (8, None, strategy), (1, None, "pass_q")], config=SMALL)


# each mask and logit feature, two at a time where they are independent
FEATURES = {
    "window_soft_cap": dict(sliding_window=3, logits_soft_cap=2.0),
    "alibi_scale": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 1.0], np.float32), softmax_scale=0.7),
    "learnable_sinks_chunked": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32), chunk_size=5),
    "sink_tokens_window": dict(num_sink_tokens=2, sliding_window=3),
    "not_causal": dict(causal=False),
    "not_causal_window": dict(causal=False, sliding_window=(3, 1)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature):
    kw = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in FEATURES[feature].items()}
    q, k, v = _tokens(hash(feature) % 1000, 2, 20)
    cache = ringjax.KVCache.create(2, 24, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh_of(4))
    _session(cache, q, k, v, [(12, None, "pass_kv"), (2, None, "auto")], config=SMALL, **kw)


def test_ragged_rows_via_counts():
    q, k, v = _tokens(3, 3, 16)
    cache = ringjax.KVCache.create(3, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh_of(4))
    schedule = [(6, [6, 3, 0], "auto"), (4, [1, 4, 2], "pass_kv"), (3, [3, 0, 1], "pass_q")]
    cache = _session(cache, q, k, v, schedule, config=SMALL)
    k_ord = np.asarray(cache.ordered()[0])
    for b, length in enumerate(np.asarray(cache.lengths)):
        np.testing.assert_array_equal(k_ord[b, :length], k[b, :length])
        assert not k_ord[b, length:].any()


def test_bfloat16():
    q, k, v = _tokens(5, 2, 20, dtype="bfloat16")
    cache = ringjax.KVCache.create(2, 24, KV_HEADS, HEAD_DIM, mesh=mesh_of(2))
    assert cache.dtype == jnp.bfloat16
    _session(cache, q, k, v, [(12, None, "auto"), (4, None, "auto")], dtype="bfloat16", sliding_window=6)


def test_meshes_as_users_build_them():
    """jax.sharding.Mesh (auto axes) under jax.set_mesh, and a data x sequence mesh with batch sharded."""
    if len(jax.devices()) < 8:
        pytest.skip(f"needs 8 devices, {len(jax.devices())} {jax.default_backend()} devices here")
    q, k, v = _tokens(7, 2, 12)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("sp",))
    with jax.set_mesh(mesh):
        cache = ringjax.KVCache.create(2, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32)
        assert cache.mesh is not None and cache.axis_size == 4
        _session(cache, q, k, v, [(8, None, "auto")])
    mesh2 = jax.make_mesh((2, 4), ("data", "sp"))
    cache = ringjax.KVCache.create(2, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh2)
    assert cache.batch_axes == ("data",) and cache.k.sharding.spec == P("data", "sp")
    assert cache.k.addressable_shards[0].data.shape[:2] == (1, 4)
    _session(cache, q, k, v, [(8, None, "pass_kv"), (2, None, "auto")])


def _decode_loop(cache, q, k, v):
    """append + attend one token per scan step; returns the outputs [B, T, H, D] and the cache."""
    def step(cache, x):
        qi, ki, vi = x
        cache = cache.append(ki[:, None], vi[:, None])
        return cache, ringjax.cache_attention(qi[:, None], cache, sliding_window=5)[:, 0]

    cache, out = jax.lax.scan(step, cache, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
    return jnp.swapaxes(out, 0, 1), cache


def test_decode_loop_in_jit_and_scan():
    q, k, v = _tokens(11, 2, 10)
    cache = ringjax.KVCache.create(2, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh_of(4))
    out, cache = jax.jit(_decode_loop)(cache, *(jnp.asarray(x) for x in (q, k, v)))
    ref = attention_reference(q, k, v, causal=True, window=5)
    assert rel_err(out, ref["out"]) < 1e-5
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 10])


@pytest.mark.parametrize("n", [2, 8])
def test_inside_shard_map_on_local_shards(n):
    """The cache made inside shard_map, a prompt appended and attended with pass_kv (q a block per device),
    then a decode loop in lax.scan."""
    mesh = mesh_of(n)
    q, k, v = _tokens(20 + n, 2, 8 + 4)
    specs = ringjax.KVCache.create(2, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh).shard_specs()

    def local(q, k, v):
        cache = ringjax.KVCache.create(2, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh)
        assert cache.k.shape[1] == 16 // n and cache.axis_size == n
        cache = cache.append(k[:, :8], v[:, :8])
        r = jax.lax.axis_index("sp")
        block = jax.lax.dynamic_slice_in_dim(q[:, :8], r * (8 // n), 8 // n, axis=1)
        prompt = ringjax.cache_attention(block, cache, strategy="pass_kv")
        steps, cache = _decode_loop(cache, q[:, 8:], k[:, 8:], v[:, 8:])
        return prompt, steps, cache

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=(P(None, "sp"), P(), specs)))
    prompt, steps, cache = f(*(jnp.asarray(x) for x in (q, k, v)))
    assert isinstance(cache, ringjax.KVCache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])
    assert rel_err(prompt, attention_reference(q[:, :8], k[:, :8], v[:, :8], causal=True)["out"]) < 1e-5
    assert rel_err(steps, attention_reference(q, k, v, causal=True, window=5)["out"][:, 8:]) < 1e-5


def test_global_cache_passed_into_shard_map():
    mesh = mesh_of(4)
    q, k, v = _tokens(30, 2, 9)
    cache = ringjax.KVCache.create(2, 16, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh).append(
        jnp.asarray(k[:, :8]), jnp.asarray(v[:, :8]))

    def local(cache, q, k, v):
        cache = cache.append(k, v)
        assert cache.positions().shape == (4,)
        return ringjax.cache_attention(q, cache, return_lse=True), cache

    specs = cache.shard_specs()
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=((P(), P()), specs)))
    (out, lse), cache = f(cache, *(jnp.asarray(x[:, 8:]) for x in (q, k, v)))
    ref = attention_reference(q, k, v, causal=True)
    assert rel_err(out, ref["out"][:, 8:]) < 1e-5 and rel_err(lse, ref["lse"][:, :, 8:]) < 1e-5
    np.testing.assert_array_equal(np.asarray(cache.positions()), np.concatenate([np.arange(4) * 4 + r
                                                                                 for r in range(4)]))


def test_one_device_without_a_mesh():
    q, k, v = _tokens(31, 2, 10)
    cache = ringjax.KVCache.create(2, 12, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=None)
    assert cache.axis_size == 1 and cache.mesh is None
    _session(cache, q, k, v, [(6, [6, 4], "auto")])


def test_axis_name_none_is_one_device_and_refuses_a_mesh_like_ring_attention():
    mesh = mesh_of(4)
    with jax.set_mesh(mesh):  # the context mesh is not used without an axis to shard over
        cache = ringjax.KVCache.create(1, 8, KV_HEADS, HEAD_DIM, axis_name=None)
    assert cache.axis_size == 1 and cache.mesh is None and cache.call().mode == "single"
    x = jnp.ones((1, 8, KV_HEADS, HEAD_DIM))
    for make in (lambda: ringjax.KVCache.create(1, 32, KV_HEADS, HEAD_DIM, mesh=mesh, axis_name=None),
                 lambda: ringjax.ring_attention(x, x, x, mesh=mesh, axis_name=None)):
        with pytest.raises(ValueError, match="mesh= needs axis_name"):
            make()


@pytest.mark.parametrize("n", [1, 4])
def test_gradient_only_with_respect_to_sinks(n):
    """d/d sinks matches the reference (one device, and a mesh under jit); d/d q, the cache or the ALiBi
    slopes, forward or reverse, raises the op's own error instead of JAX's about its loops or pmax."""
    q, k, v = _tokens(40 + n, 2, 8)
    mesh = mesh_of(n) if n > 1 else None
    cache = ringjax.KVCache.create(2, 8, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh,
                                   axis_name="sp" if mesh else None).append(jnp.asarray(k), jnp.asarray(v))
    q, sinks = jnp.asarray(q), jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    dout = np.random.default_rng(n).standard_normal(q.shape).astype(np.float32)
    ref = attention_reference(np.asarray(q), k, v, causal=True, sinks=np.asarray(sinks), dout=dout)
    loss = lambda q, cache, sinks, strategy="auto", **kw: (  # noqa: E731
        ringjax.cache_attention(q, cache, sinks=sinks, strategy=strategy, **kw) * dout).sum()
    got = jax.jit(jax.grad(loss, argnums=2))(q, cache, sinks)
    assert rel_err(got, ref["dsinks"], ref["dsinks_terms"]) < 1e-5
    with pytest.raises(TypeError, match="cache_attention is for inference: it has no gradient with respect to q"):
        jax.grad(loss)(q, cache, sinks)
    for strategy in ("pass_q", "pass_kv"):
        with pytest.raises(TypeError, match="use ring_attention for training"):
            jax.jit(jax.grad(loss), static_argnums=3)(q, cache, sinks, strategy)
    with pytest.raises(TypeError, match="cache_attention is for inference"):
        jax.grad(loss, argnums=1, allow_int=True)(q, cache, sinks)
    with pytest.raises(TypeError, match="cache_attention is for inference"):
        jax.jvp(lambda a: loss(q, cache, sinks, alibi_slopes=a), (sinks,), (sinks,))


def test_capacity_overflow_raises_and_never_overwrites():
    mesh = mesh_of(2)
    q, k, v = _tokens(4, 2, 10)
    cache = ringjax.KVCache.create(2, 8, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh)
    cache = cache.append(jnp.asarray(k[:, :6]), jnp.asarray(v[:, :6]))
    with pytest.raises(ValueError, match="row 0 holds 6 tokens; 3 more exceed the capacity 8"):
        cache.append(jnp.asarray(k[:, 6:9]), jnp.asarray(v[:, 6:9]))
    # under jit the lengths are traced: a row that would overflow is left as it was
    counts = jnp.asarray([3, 2], jnp.int32)
    grown = jax.jit(lambda c, a, b: c.append(a, b, counts))(cache, jnp.asarray(k[:, 6:9]), jnp.asarray(v[:, 6:9]))
    np.testing.assert_array_equal(np.asarray(grown.lengths), [6, 8])
    before, after = np.asarray(cache.ordered()[0]), np.asarray(grown.ordered()[0])
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1, :8], k[1, :8])


def test_errors_name_the_argument():
    mesh = mesh_of(4)
    with pytest.raises(ValueError, match="capacity 10 must be a multiple"):
        ringjax.KVCache.create(1, 10, 2, 16, mesh=mesh)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        ringjax.KVCache.create(0, 8, 2, 16, mesh=mesh)
    cache = ringjax.KVCache.create(2, 8, 2, 16, dtype=jnp.float32, mesh=mesh)
    kv = jnp.ones((2, 3, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="k_new must have shape"):
        cache.append(jnp.ones((2, 3, 1, 16)), kv)
    with pytest.raises(ValueError, match="counts must lie in 0..3"):
        cache.append(kv, kv, jnp.asarray([4, 1]))
    with pytest.raises(ValueError, match="k_new holds 9 tokens"):
        cache.append(jnp.ones((2, 9, 2, 16)), jnp.ones((2, 9, 2, 16)))
    cache = cache.append(kv, kv)
    q = jnp.ones((2, 1, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="q head_dim 8 must equal"):
        ringjax.cache_attention(jnp.ones((2, 1, 4, 8)), cache)
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple"):
        ringjax.cache_attention(jnp.ones((2, 1, 3, 16)), cache)
    with pytest.raises(ValueError, match="row 0 has 4 new queries but the cache holds only 3"):
        ringjax.cache_attention(jnp.ones((2, 4, 4, 16)), cache)
    with pytest.raises(TypeError, match="dtype"):
        ringjax.cache_attention(q.astype(jnp.bfloat16), cache)
    with pytest.raises(ValueError, match="t must be a multiple of 4"):
        ringjax.cache_attention(q, cache, strategy="pass_kv")
    with pytest.raises(ValueError, match="strategy must be one of"):
        ringjax.cache_attention(q, cache, strategy="ring")
    with pytest.raises(TypeError, match="softmax_scale"):
        ringjax.cache_attention(q, cache, scale=1.0)
    with pytest.raises(ValueError, match="implementation must be 'auto' or one of: pallas_mosaic_gpu, xla"):
        ringjax.cache_attention(q, cache, implementation="nope")
    with pytest.raises(ValueError, match="sinks must have shape"):
        ringjax.cache_attention(q, cache, sinks=jnp.ones(3))
    with pytest.raises(TypeError, match="q must be a floating-point array, got int32 array"):
        ringjax.cache_attention(q.astype(jnp.int32), cache)
    with pytest.raises(TypeError, match="sinks must be a float array of shape \\[heads\\], got int32 array"):
        ringjax.cache_attention(q, cache, sinks=jnp.ones(4, jnp.int32))
    with pytest.raises(TypeError, match="k_new must be a floating-point array, got int32 array"):
        cache.append(kv.astype(jnp.int32), kv)
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype, got 'foo'"):
        ringjax.KVCache.create(1, 8, 2, 16, dtype="foo", mesh=mesh)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, or None .*; got str"):
        ringjax.KVCache.create(1, 8, 2, 16, mesh="sp", axis_name="sp")


def test_partials_fully_masked_rows_are_zero_not_nan():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32)
    q_pos = jnp.asarray([[-3, -2, 7], [0, 1, 2]], jnp.int32)
    k_pos = jnp.arange(6, dtype=jnp.int32) * 2 + 1  # a stripe: positions 1, 3, ...
    k_len = jnp.asarray([8, 0], jnp.int32)  # row 1 holds nothing
    opts = AttentionOptions(causal=True, softmax_scale=0.3)
    out, lse = cache_partials(q, k, v, q_pos, k_pos, k_len, opts, config=SMALL)
    assert not np.isnan(np.asarray(out)).any()
    assert np.isneginf(np.asarray(lse)).tolist() == [[[True] * 4, [True] * 4, [False] * 4], [[True] * 4] * 3]
    assert not np.asarray(out)[1].any() and not np.asarray(out)[0, :2].any()
    # query at 7 sees keys at 1, 3, 5, 7 of row 0
    s = np.einsum("hd,khd->hk", np.asarray(q[0, 2]), np.repeat(np.asarray(k[0, :4]), 2, axis=1)) * 0.3
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), np.repeat(np.asarray(v[0, :4]), 2, axis=1))
    np.testing.assert_allclose(np.asarray(out[0, 2]), want, rtol=1e-5, atol=1e-6)


def test_partials_as_dots_or_reductions_agree():
    """XlaCacheConfig(dots=False) computes QK and PV as multiply-and-reduce fusions: the same results."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 12, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 12, 2, 8)), jnp.float32)
    q_pos = jnp.asarray([[20, 21, 22], [5, 6, 7]], jnp.int32)
    k_pos = jnp.arange(12, dtype=jnp.int32) * 2
    opts = AttentionOptions(causal=True, softmax_scale=0.3, window=(9, 0), logits_soft_cap=3.0, has_alibi=True)
    extras = Extras(alibi_slopes=jnp.asarray([0.1, 0.2, 0.3, 0.4]))
    results = [cache_partials(q, k, v, q_pos, k_pos, jnp.asarray([23, 8]), opts, extras=extras,
                              config=XlaCacheConfig(block_q=2, block_kv=4, max_scores=64, dots=dots))
               for dots in (True, False)]
    for a, b in zip(*results):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_strategy_cost_rule():
    from ringjax.inference import spread

    shape = dict(batch=1, heads=32, kv_heads=8, head_dim=128, v_head_dim=128, itemsize=2, axis_size=8)
    # decode against a long cache: the queries travel
    assert spread.choose("auto", local=False, t=8, slots=1 << 17, **shape)[0] == "pass_q"
    # a long prompt into a cache not much longer than it: the cache stripes travel
    assert spread.choose("auto", local=False, t=1 << 16, slots=1 << 14, **shape)[0] == "pass_kv"
    assert spread.choose("auto", local=True, t=1 << 16, slots=1 << 14, **shape)[0] == "pass_q"
    assert spread.choose("pass_kv", local=False, t=8, slots=1 << 17, **shape)[0] == "pass_kv"


def test_registered_as_an_op():
    names = [row["name"] for row in ringjax.list_implementations("cache_attention")]
    assert names == ["pallas_mosaic_gpu", "xla"]
    cache = ringjax.KVCache.create(1, 8, 1, 8, dtype=jnp.float32, mesh=mesh_of(2))
    cache = cache.append(jnp.ones((1, 2, 1, 8)), jnp.ones((1, 2, 1, 8)))
    sharding = NamedSharding(cache.mesh, P())
    q = jax.device_put(jnp.ones((1, 2, 2, 8)), sharding)
    out = ringjax.cache_attention(q, cache, implementation="xla", config=XlaCacheConfig(block_kv=2))
    np.testing.assert_allclose(np.asarray(out), 1.0)
    with pytest.raises(TypeError, match="config must be a XlaCacheConfig"):
        ringjax.cache_attention(q, cache, config=object())


def test_mosaic_decode_refused_off_hopper_with_a_reason():
    if ON_HOPPER:
        pytest.skip("runs the kernel here: see test_mosaic_decode_on_hopper")
    cache = ringjax.KVCache.create(1, 128, 2, 64, dtype=jnp.bfloat16)
    cache = cache.append(*(jnp.ones((1, 1, 2, 64), jnp.bfloat16),) * 2)
    q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu: .*(runs on gpu|sm90|jax)"):
        ringjax.cache_attention(q, cache, implementation="pallas_mosaic_gpu")


@pytest.mark.parametrize("t, window", [(1, None), (4, None), (4, 300)])
def test_mosaic_decode_on_hopper(t, window):
    """`auto` runs the split-K Mosaic kernel for decode on Hopper; exact like the XLA partials."""
    if not ON_HOPPER:
        pytest.skip("needs an sm90+ GPU (the Mosaic GPU decode kernel)")
    batch, heads, kv_heads, d, length = 2, 8, 2, 128, 1000
    q, k, v = _tokens(11, batch, length, "bfloat16", heads=heads, kv_heads=kv_heads, head_dim=d)
    cache = ringjax.KVCache.create(batch, 1024, kv_heads, d, dtype=jnp.bfloat16)
    cache = cache.append(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))
    qt = jnp.asarray(q[:, length - t:], jnp.bfloat16)
    kw = {} if window is None else {"sliding_window": window}
    out, lse = ringjax.cache_attention(qt, cache, return_lse=True, **kw)
    ref = attention_reference(q, k, v, causal=True, **({} if window is None else {"window": window}))
    _check(out, lse, ref["out"][:, length - t:], ref["lse"][:, :, length - t:], dtype="bfloat16")
    xla_out = ringjax.cache_attention(qt, cache, implementation="xla", **kw)
    assert rel_err(np.asarray(out, np.float64), np.asarray(xla_out, np.float64)) < TOLERANCE[tolerance_key("bfloat16")]


@pytest.mark.parametrize("strategy, kw", [
    ("pass_q", dict()),
    ("pass_kv", dict(sliding_window=200, logits_soft_cap=20.0)),
    ("pass_q", dict(causal=False)),
    ("pass_kv", dict(alibi_slopes=True)),
])
def test_mosaic_prefill_on_hopper(strategy, kw):
    """A 300-token chunk after 700 cached tokens (1200 query rows per KV head) runs the forward kernel on
    every GPU here: exact against the reference and the XLA partials."""
    if not ON_HOPPER:
        pytest.skip("needs an sm90+ GPU (the Mosaic GPU forward kernel)")
    n = jax.device_count()
    batch, heads, kv_heads, d, first, t = 2, 8, 2, 128, 700, 300
    q, k, v = _tokens(12, batch, first + t, "bfloat16", heads=heads, kv_heads=kv_heads, head_dim=d)
    cache = ringjax.KVCache.create(batch, 1024, kv_heads, d, dtype=jnp.bfloat16, mesh=mesh_of(n) if n > 1 else None)
    for lo, hi in ((0, first), (first, first + t)):
        cache = cache.append(jnp.asarray(k[:, lo:hi], jnp.bfloat16), jnp.asarray(v[:, lo:hi], jnp.bfloat16))
    slopes = np.linspace(0.05, 0.4, heads) if kw.get("alibi_slopes") else None
    kw = dict(kw, alibi_slopes=None if slopes is None else jnp.asarray(slopes, jnp.float32))
    qt = jnp.asarray(q[:, first:], jnp.bfloat16)
    out, lse = ringjax.cache_attention(qt, cache, return_lse=True, strategy=strategy, **kw)
    ref = attention_reference(q, k, v, causal=kw.get("causal", True), window=kw.get("sliding_window"),
                              logits_soft_cap=kw.get("logits_soft_cap"), alibi_slopes=slopes)
    _check(out, lse, ref["out"][:, first:], ref["lse"][:, :, first:], dtype="bfloat16")
    xla_out = ringjax.cache_attention(qt, cache, strategy=strategy, implementation="xla", **kw)
    assert rel_err(np.asarray(out, np.float64), np.asarray(xla_out, np.float64)) < TOLERANCE[tolerance_key("bfloat16")]


@pytest.mark.parametrize("strategy", ["pass_q", "pass_kv"])
def test_collectives_per_call(strategy):
    """pass_q: one pmax and one psum of the partial results, nothing travels; pass_kv: the K and V stripes
    travel the ring (n - 1 steps), no reduction of outputs."""
    n = 4
    cache = ringjax.KVCache.create(1, 32, KV_HEADS, HEAD_DIM, dtype=jnp.float32, mesh=mesh_of(n))
    q = jnp.zeros((1, 4, HEADS, HEAD_DIM), jnp.float32)
    text = jax.jit(lambda q, c: ringjax.cache_attention(q, c, strategy=strategy)).lower(q, cache).as_text()
    count = lambda op: sum(line.count(op) for line in text.splitlines())  # noqa: E731
    if strategy == "pass_q":
        assert count("all_reduce") == 2 and count("collective_permute") == 0
    else:
        assert count("collective_permute") == 2 * (n - 1) and count("all_reduce") == 0

"""The XLA ring against the float64 reference: outputs, lse and gradients.

Every case runs on simulated CPU devices; each feature is checked on 1, 2, 4 and 8.
"""

import numpy as np
import pytest

from harness import check_against_reference, make_inputs, need_devices, reference_for, run_ring

DEVICES = [1, 2, 4, 8]
LAYOUTS = ["contiguous", "zigzag", "striped"]


def _check(x, n, layout="contiguous", **kw):
    got = run_ring(x, n, layout=layout, implementation="xla", config=_small_blocks(), **kw)
    assert got["out_dtype"] == x["dtype"]
    check_against_reference(got, reference_for(x, **kw), x["dtype"])
    return got


def _small_blocks():
    from ringjax.backends.xla import XlaConfig

    # several blocks per shard so block skipping and the online softmax are exercised
    return XlaConfig(block_q=4, block_kv=4)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_layouts(n, layout, causal):
    x = make_inputs(100 * n + LAYOUTS.index(layout), seq=32, heads=4, kv_heads=2)
    _check(x, n, layout, causal=causal)


FEATURES = {
    "mqa": (dict(heads=4, kv_heads=1), dict(causal=True)),
    "window_small": ({}, dict(causal=True, sliding_window=3)),
    "window_large": ({}, dict(causal=True, sliding_window=21)),
    "window_two_sided": ({}, dict(sliding_window=(5, 2))),
    "window_wider_than_seq": ({}, dict(sliding_window=(100, 100))),
    "segments": (dict(segments="random"), dict(causal=True)),
    "segments_noncausal_window": (dict(segments="random"), dict(sliding_window=(4, 6))),
    "soft_cap": ({}, dict(causal=True, logits_soft_cap=2.0)),
    "sinks": (dict(sinks=True), dict(causal=True)),
    "sinks_segments": (dict(sinks=True, segments="random"), dict()),
    "scale": ({}, dict(softmax_scale=0.7)),
    "head_dim_80": (dict(head_dim=80, heads=2, kv_heads=1), dict(causal=True)),
}


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features(feature, n):
    shape_kw, kw = FEATURES[feature]
    layout = LAYOUTS[(n + sorted(FEATURES).index(feature)) % 3]
    x = make_inputs(n * 1000 + sorted(FEATURES).index(feature), seq=32, **shape_kw)
    _check(x, n, layout, **kw)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(dtype, n):
    x = make_inputs(7 + n, seq=64, dtype=dtype, segments="random", sinks=True)
    _check(x, n, "zigzag", causal=True, logits_soft_cap=20.0)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    x = make_inputs(3, seq=32, segments="random")
    got = _check(x, 4, "striped", causal=True)
    padded = np.asarray(x["segment_ids"]) < 0
    assert padded.any()
    assert np.all(got["out"][padded] == 0.0)
    assert np.all(np.isneginf(got["lse"].transpose(0, 2, 1)[padded]))
    assert np.all(got["dq"][padded] == 0.0)
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(got[name]).all()


@pytest.mark.parametrize("n, kw", [(1, {}), (4, {}), (4, dict(deterministic="invariant"))])
def test_sinks_of_minus_inf_leave_rows_that_see_no_key_zero(n, kw):
    """A sink of -inf (a head without one) meets rows that see no key: the sink's share exp(sink - lse) is
    -inf - -inf there, which was NaN in the output, dQ and dsinks."""
    x = make_inputs(17 + n, seq=32, segments="random", sinks=True)
    x["sinks"][[0, 2]] = -np.inf
    got = _check(x, n, "zigzag", causal=True, **kw)
    padded = np.asarray(x["segment_ids"]) < 0
    assert padded.any()
    assert np.all(got["out"][padded] == 0.0)
    assert np.all(got["dsinks"][[0, 2]] == 0.0)
    for name in ("out", "dq", "dk", "dv", "dsinks"):
        assert np.isfinite(got[name]).all(), name


@pytest.mark.parametrize("n, dtype", [(1, "float32"), (4, "bfloat16")])
def test_logits_near_1e9_stay_finite(n, dtype):
    """softmax_scale 1e8: logits near 1e9, where XLA's two copies of a logit (one FMA-contracted) differed by
    more than exp can take and the output was NaN. The softmax is one-hot there: out, lse and dV against the
    reference; dQ and dK scale float32 rounding of (dP - delta) by 1e8, so only their finiteness is checked."""
    x = make_inputs(41 + n, seq=64, head_dim=64, dtype=dtype)
    got = run_ring(x, n, layout="zigzag", implementation="xla", config=_small_blocks(), softmax_scale=1e8)
    check_against_reference(got, reference_for(x, softmax_scale=1e8), dtype, names=("out", "lse", "dv"))
    for name in ("dq", "dk"):
        assert np.isfinite(got[name]).all(), name


def test_reference_check_can_fail():
    """The comparison detects a wrong result (a dropped key block changes everything)."""
    x = make_inputs(5, seq=32)
    got = run_ring(x, 4, causal=True, implementation="xla", config=_small_blocks())
    ref = reference_for(x, causal=False)
    with pytest.raises(AssertionError):
        check_against_reference(got, ref, "float32")


@pytest.mark.parametrize("n, kw, sinks, asks", [
    (1, dict(causal=True), False, True),  # one step: its output is final
    (2, dict(causal=True, gather_kv=True), False, True),  # the all-gather schedule's one call
    (2, dict(causal=True), False, False),  # two steps merge in float32
    (1, dict(causal=True), True, False),  # learnable sinks rescale the output after the call
    (4, dict(causal=True, window=(0, 0), num_sink_tokens=2), False, False),  # one step, then the sink step
])
def test_final_results_are_asked_for_in_the_input_dtype(n, kw, sinks, asks):
    """A kernel with `final_dtype` is asked for q's dtype exactly where no merge follows its call, forward and
    backward; the op's outputs and gradients are those of the same kernel writing float32."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from ringjax import _compat
    from ringjax.backends.xla import XlaConfig
    from ringjax.backends.xla.implementation import KERNEL
    from ringjax.core.ring import ring_attention_shard
    from ringjax.core.schedule import ring_plan
    from ringjax.options import AttentionOptions

    asked = {"fwd": [], "bwd": []}

    def fwd(*args, out_dtype=jnp.float32):
        asked["fwd"].append(jnp.dtype(out_dtype))
        out, lse = KERNEL.fwd(*args)
        return out.astype(out_dtype), lse

    def bwd(*args, out_dtype=jnp.float32):
        asked["bwd"].append(jnp.dtype(out_dtype))
        *grads, dslopes = KERNEL.bwd(*args)
        return (*(g.astype(out_dtype) for g in grads), dslopes)

    narrow = dataclasses.replace(KERNEL, fwd=fwd, bwd=bwd, final_dtype=True)
    opts = AttentionOptions(softmax_scale=0.3, axis_name="sp", axis_size=n, **kw)
    if "window" in kw:
        plan = ring_plan(opts, 8)
        assert (plan.num_steps, plan.sink_step) == (1, True)
    need_devices(n)
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    rng = np.random.default_rng(n)
    sharding = jax.NamedSharding(mesh, P(None, "sp"))
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((1, 8 * n, 4, 16)), jnp.bfloat16), sharding)
               for _ in range(3))
    s = jnp.asarray(rng.standard_normal(4), jnp.float32)

    def loss(kernel):
        def per_device(q, k, v, s):
            s = _compat.match_vma(s, q) if sinks else None  # varying like q, as the public op passes it
            return ring_attention_shard(opts, kernel, XlaConfig(block_q=4, block_kv=4), q, k, v, None, None, s)

        f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                          out_specs=(P(None, "sp"), P(None, None, "sp")))

        def total(q, k, v, s):
            out, lse = f(q, k, v, s)
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

        return jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2, 3)))

    got, want = loss(narrow)(q, k, v, s), loss(KERNEL)(q, k, v, s)
    # the backward's one step is final with learnable sinks too (their gradient is apart); not all-gather's,
    # whose dK/dV are summed over the devices
    bwd_asks = asks and not kw.get("gather_kv") or (sinks and n == 1)
    for phase, wanted in (("fwd", asks), ("bwd", bwd_asks)):
        dtypes = asked[phase]
        assert dtypes and all(d == (jnp.bfloat16 if wanted else jnp.float32) for d in dtypes), (phase, dtypes)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

"""all_gather, ulysses and hybrid strategies against the float64 reference: outputs, lse, gradients.

Each case runs the public op, inside `jax.shard_map` or on global arrays under a mesh, on the
default backend's devices (8 simulated CPU devices in CI): 2, 4 and 8 for the one-axis strategies,
2 x 4 and 4 x 2 meshes for hybrid; cases needing more devices than there are skip.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.xla import XlaConfig

from harness import check_against_reference, make_inputs, reference_for

BLOCKS = XlaConfig(block_q=4, block_kv=4)  # several blocks per shard: block skipping is exercised
LAYOUTS = ["contiguous", "zigzag", "striped"]


def _mesh(shape):
    n = int(np.prod(shape))
    if n > len(jax.devices()):
        pytest.skip(f"needs {n} devices, {len(jax.devices())} {jax.default_backend()} devices here")
    names = ("sp",) if len(shape) == 1 else ("hp", "sp")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape), devices=jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def _compiled(shape, strategy, layout, mode, kw_items, has):
    kw = dict(kw_items)
    mesh = _mesh(shape)
    axis = "sp" if len(shape) == 1 else ("hp", "sp")
    has_seg, has_sinks, has_alibi = has

    def loss_and_out(q, k, v, seg, sinks, alibi, rng, dout, dlse):
        def attn(q, k, v, seg, sinks, alibi, rng):
            if rng is not None:
                rng = jax.random.wrap_key_data(rng)
            return ringjax.ring_attention(q, k, v, axis_name=axis, strategy=strategy, layout=layout, segment_ids=seg,
                                          sinks=sinks, alibi_slopes=alibi, dropout_rng=rng, return_lse=True, **kw)

        if mode == "shard_map":
            spec = P(None, axis)
            maybe = lambda x, s: None if x is None else s  # noqa: E731
            attn = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec, maybe(seg, spec), maybe(sinks, P()),
                                                            maybe(alibi, P()), maybe(rng, P())),
                                 out_specs=(spec, P(None, None, axis)))
        out, lse = attn(q, k, v, seg, sinks, alibi, rng)
        val = (out.astype(jnp.float32) * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return val, (out, lse)

    grad_args = (0, 1, 2) + ((4,) if has_sinks else ()) + ((5,) if has_alibi else ())
    return jax.jit(jax.value_and_grad(loss_and_out, argnums=grad_args, has_aux=True)), mesh, axis


def run_strategy(x, shape, strategy, *, layout="contiguous", mode="shard_map", implementation="xla", config=BLOCKS,
                 **kw):
    """Outputs, lse and gradients in natural token order, as float64 numpy."""
    has = ("segment_ids" in x, "sinks" in x, "alibi_slopes" in x)
    kw = dict(kw, implementation=implementation, config=config)
    fn, mesh, axis = _compiled(shape, strategy, layout, mode, tuple(sorted(kw.items())), has)
    n = int(np.prod(shape))
    seq = NamedSharding(mesh, P(None, axis))
    to = functools.partial(ringjax.to_layout, layout=layout, axis_size=n, axis=1)
    q, k, v = (jax.device_put(to(jnp.asarray(x[name], x["dtype"])), seq) for name in ("q", "k", "v"))
    dout = jax.device_put(to(jnp.asarray(x["dout"])), seq)
    seg = jax.device_put(to(jnp.asarray(x["segment_ids"])), seq) if "segment_ids" in x else None
    rep = NamedSharding(mesh, P())
    sinks, alibi, rng = (jax.device_put(jnp.asarray(x[name]), rep) if name in x else None
                         for name in ("sinks", "alibi_slopes", "dropout_rng"))
    dlse = jax.device_put(ringjax.to_layout(jnp.asarray(x["dlse"]), layout, n, axis=2),
                          NamedSharding(mesh, P(None, None, axis)))
    with jax.set_mesh(mesh):
        (_, (out, lse)), grads = fn(q, k, v, seg, sinks, alibi, rng, dout, dlse)
    back = lambda a, axis=1: np.asarray(ringjax.from_layout(np.asarray(a), layout, n, axis=axis), np.float64)  # noqa: E731
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    res = {"out": back(f32(out)), "lse": back(lse, 2), "dq": back(f32(grads[0])), "dk": back(f32(grads[1])),
           "dv": back(f32(grads[2]))}
    extra = iter(grads[3:])
    if "sinks" in x:
        res["dsinks"] = np.asarray(next(extra), np.float64)
    if "alibi_slopes" in x:
        res["dalibi"] = np.asarray(next(extra), np.float64)
    return res


def _check(x, shape, strategy, layout="contiguous", mode="shard_map", **kw):
    impl = {k: kw.pop(k) for k in ("implementation", "config") if k in kw}
    got = run_strategy(x, shape, strategy, layout=layout, mode=mode, **impl, **kw)
    check_against_reference(got, reference_for(x, **kw), x["dtype"])
    return got


# (make_inputs keywords, ring_attention keywords); the heads divide by 8 for ulysses
FEATURES = {
    "causal_gqa": (dict(heads=8, kv_heads=2), dict(causal=True)),
    "mqa_two_sided_window": (dict(heads=8, kv_heads=1), dict(sliding_window=(5, 2))),
    "packed_sinks_softcap": (dict(heads=8, kv_heads=4, segments="random", sinks=True),
                             dict(causal=True, logits_soft_cap=2.0)),
    "packed_chunks_sink_tokens": (dict(heads=8, kv_heads=8, segments="random"),
                                  dict(causal=True, chunk_size=5, num_sink_tokens=2)),
    "sink_tokens_window": (dict(heads=8, kv_heads=2), dict(causal=True, sliding_window=5, num_sink_tokens=3)),
    "alibi_dropout_window": (dict(heads=8, kv_heads=2, alibi=True, dropout_key=3),
                             dict(sliding_window=(6, 3), dropout_rate=0.25)),
}
SHAPES = {"all_gather": [(2,), (4,), (8,)], "ulysses": [(2,), (4,), (8,)], "hybrid": [(2, 4), (4, 2)]}


def _cases():
    for strategy, shapes in SHAPES.items():
        for i, feature in enumerate(sorted(FEATURES)):
            yield strategy, feature, shapes[i % len(shapes)], LAYOUTS[i % 3], ("shard_map", "global")[i % 2]


@pytest.mark.parametrize("strategy, feature, shape, layout, mode", list(_cases()))
def test_features(strategy, feature, shape, layout, mode):
    shape_kw, kw = FEATURES[feature]
    x = make_inputs(sorted(FEATURES).index(feature) + 10 * len(shape) + 100 * shape[-1], seq=32, **shape_kw)
    _check(x, shape, strategy, layout, mode, **kw)


# ---------------------------------------------------------------------------- Ulysses' sorted tokens


@pytest.mark.parametrize("strategy, shape, layout, placed", [
    ("ulysses", (2,), "zigzag", ("contiguous", 1, None)),  # chunks 0, 3, 1, 2 sorted: one plain sequence
    ("ulysses", (4,), "striped", ("contiguous", 1, None)),
    ("hybrid", (2, 2), "striped", ("striped", 1, "sp")),  # each ring device's tokens sorted: a striped shard
    ("hybrid", (2, 2), "zigzag", ("zigzag", 2, "sp")),  # sorted they are no layout's shard: left as they come
])
def test_kernel_gets_sorted_tokens(strategy, shape, layout, placed, monkeypatch):
    """The kernel runs a problem without subshards after a Ulysses all-to-all (where a layout describes the
    sorted tokens), and the query rows it gets hold the positions that problem gives them."""
    from ringjax.core.shards import positions as _positions
    from ringjax.core.shards import shard_index
    from ringjax.dispatch import registry

    mesh = _mesh(shape)
    axis = "sp" if len(shape) == 1 else ("hp", "sp")
    n = int(np.prod(shape))
    problems, checks = [], []
    run = registry.run_per_device

    def spy(impl, problem, config, q, k, v, seg, sinks, extras):
        problems.append(problem)
        pos = _positions(problem.opts, shard_index(problem.opts), problem.seq)
        jax.debug.callback(checks.append, jnp.all(q[0, :, :, 0] == pos[:, None].astype(q.dtype)))
        return run(impl, problem, config, q, k, v, seg, sinks, extras)

    monkeypatch.setattr(registry, "run_per_device", spy)
    seq = 16 * n
    q = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.float32)[None, :, None, None], (1, seq, 4, 8))  # q = position
    q = jax.device_put(ringjax.to_layout(q, layout, n), NamedSharding(mesh, P(None, axis)))
    fn = jax.jit(lambda q: ringjax.ring_attention(q, q, q, axis_name=axis, strategy=strategy, layout=layout,
                                                  causal=True, implementation="xla"))
    with jax.set_mesh(mesh):
        jax.block_until_ready(fn(q))
    opts = problems[0].opts
    assert (opts.layout, opts.subshards, opts.axis_name) == placed and problems[0].seq == 16 * shape[0]
    assert len(checks) == n and all(bool(c) for c in checks)


@pytest.mark.parametrize("strategy, shape, layout", [("ulysses", (2,), "zigzag"), ("ulysses", (4,), "striped"),
                                                     ("hybrid", (2, 2), "striped")])
def test_sorted_tokens_keep_every_feature(strategy, shape, layout, monkeypatch):
    """Sorting the tokens changes nothing but the kernel's walk: dropout (hashed on global positions and
    heads), ALiBi, segments, sink tokens and learnable sinks against the reference, sorted and not."""
    from ringjax.strategies import spread

    x = make_inputs(61 + len(shape), seq=32, heads=8, kv_heads=2, alibi=True, dropout_key=7, segments="random",
                    sinks=True)
    kw = dict(causal=True, dropout_rate=0.25, num_sink_tokens=2)
    got = _check(x, shape, strategy, layout, "global", **kw)
    monkeypatch.setattr(spread, "_sorted", lambda *args: None)  # the all-to-all's order (subshards)
    monkeypatch.setattr(sys.modules[__name__], "_compiled", _compiled.__wrapped__)  # traced afresh
    unsorted = _check(x, shape, strategy, layout, "global", **kw)
    for name in got:
        np.testing.assert_allclose(got[name], unsorted[name], rtol=1e-5, atol=1e-5, err_msg=name)


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("strategy, shape, layout, xkw, kw", [
    ("all_gather", (2,), "zigzag", dict(heads=4, kv_heads=1), dict(causal=True)),
    ("ulysses", (2,), "striped", dict(heads=4, kv_heads=1, segments="random", sinks=True), dict(causal=True)),
    ("hybrid", (2, 2), "contiguous", dict(heads=4, kv_heads=2), dict(causal=True, logits_soft_cap=3.0)),
])
def test_pallas_triton_kernels(strategy, shape, layout, xkw, kw):
    """The Triton kernels under each strategy (compiled on a GPU, in the Pallas interpreter elsewhere)."""
    from ringjax.backends.pallas_triton import GpuConfig

    config = GpuConfig(block_q=16, block_kv=16, num_warps=4, num_stages=2, bwd_block_q=16, bwd_block_kv=16,
                       interpret=not ON_GPU)
    x = make_inputs(41 + len(shape), seq=64 * len(shape), **xkw)
    impl = "pallas_triton" if ON_GPU else "pallas_triton_interpret"
    _check(x, shape, strategy, layout, "global", implementation=impl, config=config, **kw)


# pallas_tpu_interpret is registered for CPU only; where the default backend is a GPU the call
# would be refused ("runs on cpu, not gpu"), so these are left to the CPU run
@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason=f"the Pallas TPU interpreter runs on CPU, the default backend is {jax.default_backend()}")
@pytest.mark.parametrize("strategy, shape, layout, fused", [
    ("all_gather", (2,), "zigzag", False),
    ("ulysses", (2,), "striped", True),  # no ring axis left: the fused ring falls back to the block kernels
    ("hybrid", (2, 2), "contiguous", True),  # the fused ring kernel over subshards
])
def test_pallas_tpu_kernels(strategy, shape, layout, fused):
    """The TPU kernels under each strategy, in the Pallas TPU interpreter."""
    pytest.importorskip("jax.experimental.pallas.tpu", reason="this jax has no Pallas TPU module")
    from ringjax.backends.pallas_tpu import TpuConfig
    from ringjax.backends.pallas_tpu.kernels import reset_interpreter

    reset_interpreter()
    x = make_inputs(43 + len(shape), seq=32 * len(shape), batch=1, heads=4, kv_heads=2, sinks=True,
                    segments="random")
    _check(x, shape, strategy, layout, "global", implementation="pallas_tpu_interpret",
           config=TpuConfig(block_q=8, block_kv=8, fused=fused, interpret=True), causal=True)
    reset_interpreter()


# ---------------------------------------------------------------------------- what each strategy moves


def _lowered_text(shape, strategy, backward):
    mesh = _mesh(shape)
    axis = "sp" if len(shape) == 1 else ("hp", "sp")
    q = jax.ShapeDtypeStruct((1, 64, 8, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, axis)))
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, axis)))

    def f(q, k, v):
        out = ringjax.ring_attention(q, k, v, axis_name=axis, strategy=strategy, causal=True, implementation="xla")
        return out.sum()

    fn = jax.grad(f, argnums=(0, 1, 2)) if backward else f
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(q, kv, kv).as_text()


@pytest.mark.parametrize("strategy, shape, present, absent", [
    ("ring", (4,), ["collective_permute"], ["all_to_all"]),
    ("all_gather", (4,), ["all_gather", "reduce_scatter"], ["collective_permute", "all_to_all"]),
    ("ulysses", (4,), ["all_to_all"], ["collective_permute"]),
    ("hybrid", (2, 4), ["all_to_all", "collective_permute"], []),
])
def test_collectives(strategy, shape, present, absent):
    """Each strategy moves data with its own collectives (forward and backward)."""
    text = _lowered_text(shape, strategy, backward=True)
    for op in present:
        assert f"stablehlo.{op}" in text, op
    for op in absent:
        assert f"stablehlo.{op}" not in text, op


# ---------------------------------------------------------------------------- errors


def _qkv(heads=4, kv_heads=2, seq=16):
    return jnp.ones((1, seq, heads, 8)), jnp.ones((1, seq, kv_heads, 8)), jnp.ones((1, seq, kv_heads, 8))


@pytest.mark.parametrize("strategy, axis_name, error, match", [
    ("rings", "sp", ValueError, "strategy must be one of"),
    (None, "sp", ValueError, "strategy must be one of"),
    ("hybrid", "sp", TypeError, "hybrid.*axis_name=\\(head_axis, ring_axis\\)"),
    ("hybrid", None, TypeError, "always needs the pair"),
    ("hybrid", ("sp", "sp"), ValueError, "two different axes"),
    ("hybrid", ("hp", 3), TypeError, "axis_name"),
    ("ring", ("hp", "sp"), TypeError, "pair of axes: only strategy='hybrid'"),
    ("ulysses", ("hp", "sp"), TypeError, "pair of axes"),
])
def test_bad_strategy_or_axis_name(strategy, axis_name, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        ringjax.ring_attention(q, k, v, axis_name=axis_name, strategy=strategy)


def test_ulysses_needs_heads_divisible_by_the_axis():
    mesh = _mesh((8,))
    q, k, v = _qkv(heads=4, kv_heads=2)
    for strategy in ("ulysses", "hybrid"):
        axis = "sp" if strategy == "ulysses" else ("hp", "sp")
        m = mesh if strategy == "ulysses" else _mesh((8, 1))
        with pytest.raises(ValueError, match=r"query heads \(4 per device\) divisible by the size of axis"):
            ringjax.ring_attention(q, k, v, axis_name=axis, mesh=m, strategy=strategy)


def test_single_device_strategies_agree():
    """axis_name=None: every one-axis strategy is the same single-device attention."""
    x = make_inputs(5, seq=16, heads=4, kv_heads=2)
    q, k, v = (jnp.asarray(x[n]) for n in ("q", "k", "v"))
    ref = reference_for(x, causal=True)["out"]
    for strategy in ("ring", "all_gather", "ulysses", "auto"):
        out = ringjax.ring_attention(q, k, v, axis_name=None, causal=True, strategy=strategy, implementation="xla")
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- auto


def _base(seq, heads, kv_heads, *, causal=True, layout="contiguous", dtype="bfloat16", **kw):
    from ringjax.dispatch import registry
    from ringjax.options import make_options

    opts = make_options(jnp.zeros((1, 1, 1, 128), dtype), causal=causal, sliding_window=kw.get("window"),
                        softmax_scale=None, logits_soft_cap=None, layout=layout, axis_name=None, axis_size=1,
                        has_segments=False, has_sinks=False)
    return registry.Problem(opts=opts, batch=1, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=128, dtype=dtype,
                            platform="cpu")


@pytest.mark.parametrize("layout, heads, kv_heads, n, tokens", [
    ("contiguous", 32, 32, 2, 8192),  # causal imbalance of the ring: ulysses is balanced
    ("zigzag", 32, 8, 2, 8192),
    ("zigzag", 32, 32, 4, 32768),
    ("zigzag", 32, 8, 8, 2048),
])
def test_auto_follows_the_cost_model(layout, heads, kv_heads, n, tokens):
    from ringjax.strategies import plan
    from ringjax.strategies import spread as strategies

    chip = plan.CHIPS["h200"]
    costs = plan.strategy_costs(chip, devices=n, seq_len=n * tokens, heads=heads, kv_heads=kv_heads, head_dim=128,
                                layout=layout)
    strategy, reason = strategies.decide(_base(tokens, heads, kv_heads, layout=layout), "sp", {"sp": n}, chip=chip)
    best = plan.best_strategy(costs)
    assert strategy == strategies.bind(best.strategy, "sp", {"sp": n})
    assert reason.startswith(f"cost model on {n} x H200 SXM: {best.total_s * 1e3:.3g} ms")
    for c in costs:
        assert f"{c.strategy} {c.total_s * 1e3:.3g} ms" in reason or c is best
    if layout == "contiguous":
        assert strategy.name == "ulysses"


def test_auto_rules_out_what_cannot_run():
    from ringjax.strategies import plan
    from ringjax.strategies import spread as strategies

    # 6 heads do not split over 4 devices; a chip with little HBM cannot hold the gathered K/V
    small = dataclasses.replace(plan.CHIPS["h200"], hbm_bytes=4 * 2**30)
    base = _base(65536, 6, 6, layout="contiguous")  # 65536 tokens per device
    strategy, reason = strategies.decide(base, "sp", {"sp": 4}, chip=small)
    assert strategy.name == "ring"
    assert "ulysses: strategy='ulysses' needs the query heads (6 per device) divisible" in reason
    assert "all_gather: needs" in reason and "over the memory budget" in reason
    # masks that bound a query's reach keep the ring, which skips the shards out of reach
    strategy, reason = strategies.decide(_base(8192, 32, 8, window=128), "sp", {"sp": 4}, chip=small)
    assert strategy.name == "ring" and "sliding_window" in reason
    # no figures for the device: the default
    strategy, reason = strategies.decide(_base(8192, 32, 8), "sp", {"sp": 4})
    assert strategy.name == "ring" and "no cost figures for device kind" in reason


def test_auto_end_to_end_logs_its_choice(monkeypatch, caplog):
    """On a (pretended) H200 the model picks ulysses for contiguous causal; the result is exact."""
    import logging

    from ringjax.dispatch import registry

    monkeypatch.setattr(registry, "current_device_kind", lambda platform=None: "NVIDIA H200")
    x = make_inputs(21, seq=32, heads=4, kv_heads=2, dtype="bfloat16")
    with caplog.at_level(logging.DEBUG, logger="ringjax.strategy"):
        got = run_strategy(x, (4,), "auto", mode="global", causal=True)
    check_against_reference(got, reference_for(x, causal=True), "bfloat16")
    chosen = [r.getMessage() for r in caplog.records if r.name == "ringjax.strategy"]
    assert chosen and chosen[0].startswith("strategy='auto' chose ulysses over 'sp' of 4: cost model on 4 x H200")


# ---------------------------------------------------------------------------- layers


@pytest.mark.parametrize("strategy, shape, layout", [("hybrid", (2, 2), "zigzag"), ("ulysses", (4,), "striped")])
def test_layer_strategy_matches_unsharded(strategy, shape, layout):
    """The layers' core with `strategy` (rotary positions included) equals the unsharded layer."""
    from ringjax.layers import core

    mesh = _mesh(shape)
    axis = "sp" if len(shape) == 1 else ("hp", "sp")
    kw = dict(in_features=16, num_heads=4, num_kv_heads=2, causal=True, use_sinks=True)
    cfg = core.AttentionLayerConfig(**kw, axis_name=axis, layout=layout, strategy=strategy, implementation="xla")
    params = core.init_params(cfg, jax.random.key(1))
    params["sinks"] = jnp.linspace(-1.0, 1.0, 4)
    x = jax.random.normal(jax.random.key(2), (2, 32, 16))
    n = int(np.prod(shape))
    sharded = jax.jit(jax.shard_map(lambda p, x: core.forward(cfg, p, x), mesh=mesh, in_specs=(P(), P(None, axis)),
                                    out_specs=P(None, axis)))
    xs = jax.device_put(ringjax.to_layout(x, layout, n), NamedSharding(mesh, P(None, axis)))
    params_rep = jax.device_put(params, NamedSharding(mesh, P()))
    got = ringjax.from_layout(np.asarray(sharded(params_rep, xs)), layout, n)
    ref = core.forward(core.AttentionLayerConfig(**kw, axis_name=None, implementation="xla"), params, x)
    np.testing.assert_allclose(got, np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_layers_take_strategy():
    pytest.importorskip("equinox")
    pytest.importorskip("flax")
    from flax import nnx

    from ringjax.equinox import MultiHeadAttention as EqxAttention
    from ringjax.flax import LinenMultiHeadAttention, MultiHeadAttention

    assert EqxAttention(16, 4, axis_name=("hp", "sp"), strategy="hybrid", key=jax.random.key(0)).config.strategy == \
        "hybrid"
    assert MultiHeadAttention(16, 4, strategy="all_gather", rngs=nnx.Rngs(0)).config.strategy == "all_gather"
    assert LinenMultiHeadAttention(4, strategy="ulysses").layer_config(16).strategy == "ulysses"
    with pytest.raises(TypeError, match="hybrid"):
        EqxAttention(16, 4, axis_name="sp", strategy="hybrid", key=jax.random.key(0))


def test_auto_measures_with_tuning_on(caplog, monkeypatch):
    """autotune="on": the strategies are timed on the devices, all compiled first and timed in turn over
    rounds (one interleaved measurement), the fastest runs and is remembered."""
    import logging

    from ringjax.dispatch import autotuning

    interleaved = []
    measure = autotuning.measure_interleaved

    def spy(compiled, *args, **kwargs):
        interleaved.append(len(compiled))
        return measure(compiled, *args, **kwargs)

    monkeypatch.setattr(autotuning, "measure_interleaved", spy)

    x = make_inputs(23, seq=64, heads=4, kv_heads=2)
    mesh = _mesh((4,))
    q, k, v = (jax.device_put(jnp.asarray(x[n]), NamedSharding(mesh, P(None, "sp"))) for n in ("q", "k", "v"))
    autotuning.clear_memory_cache()
    with caplog.at_level(logging.DEBUG, logger="ringjax.strategy"):
        out = ringjax.ring_attention(q, k, v, axis_name="sp", mesh=mesh, causal=True, strategy="auto",
                                     autotune="on", implementation="xla")
        again = ringjax.ring_attention(q, k, v, axis_name="sp", mesh=mesh, causal=True, strategy="auto",
                                       autotune="cached", implementation="xla")
    np.testing.assert_allclose(np.asarray(out), reference_for(x, causal=True)["out"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(again), np.asarray(out), rtol=1e-6, atol=1e-6)
    chosen = [r.getMessage() for r in caplog.records if r.name == "ringjax.strategy"]
    assert len(chosen) == 2, chosen
    first, second = chosen
    assert "measured fastest (autotuned: ring " in first and " all_gather " in first and " ulysses " in first
    assert "measured fastest (memory)" in second
    assert first.split(" chose ")[1].split(":")[0] == second.split(" chose ")[1].split(":")[0]
    # ring, all_gather and ulysses in one measurement (then the chosen strategy's kernel configs are tuned)
    assert interleaved[0] == 3, interleaved

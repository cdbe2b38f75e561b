"""all_gather, ulysses and hybrid strategies against the float64 reference: outputs, lse, gradients.

Each case runs the public op, inside `jax.shard_map` or on global arrays under a mesh, on
simulated CPU devices: 2, 4 and 8 for the one-axis strategies, a 2 x 4 mesh for hybrid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from harness import check_against_reference, make_inputs, reference_for
from ringjax.xla import XlaConfig

BLOCKS = XlaConfig(block_q=4, block_kv=4)  # several blocks per shard: block skipping is exercised
LAYOUTS = ["contiguous", "zigzag", "striped"]


def _mesh(shape):
    n = int(np.prod(shape))
    if n > len(jax.devices()):
        pytest.skip(f"needs {n} devices")
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
                                          sinks=sinks, alibi_slopes=alibi, dropout_rng=rng, return_lse=True,
                                          implementation="xla", config=BLOCKS, **kw)

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


def run_strategy(x, shape, strategy, *, layout="contiguous", mode="shard_map", **kw):
    """Outputs, lse and gradients in natural token order, as float64 numpy."""
    has = ("segment_ids" in x, "sinks" in x, "alibi_slopes" in x)
    fn, mesh, axis = _compiled(shape, strategy, layout, mode, tuple(sorted(kw.items())), has)
    n = int(np.prod(shape))
    seq = NamedSharding(mesh, P(None, axis))
    to = functools.partial(ringjax.to_layout, layout=layout, axis_size=n, axis=1)
    q, k, v, dout = (jax.device_put(to(jnp.asarray(x[name])), seq) for name in ("q", "k", "v", "dout"))
    seg = jax.device_put(to(jnp.asarray(x["segment_ids"])), seq) if "segment_ids" in x else None
    rep = NamedSharding(mesh, P())
    sinks, alibi, rng = (jax.device_put(jnp.asarray(x[name]), rep) if name in x else None
                         for name in ("sinks", "alibi_slopes", "dropout_rng"))
    dlse = jax.device_put(ringjax.to_layout(jnp.asarray(x["dlse"]), layout, n, axis=2),
                          NamedSharding(mesh, P(None, None, axis)))
    with jax.set_mesh(mesh):
        (_, (out, lse)), grads = fn(q, k, v, seg, sinks, alibi, rng, dout, dlse)
    back = lambda a, axis=1: np.asarray(ringjax.from_layout(np.asarray(a), layout, n, axis=axis), np.float64)  # noqa: E731
    res = {"out": back(out), "lse": back(lse, 2), "dq": back(grads[0]), "dk": back(grads[1]), "dv": back(grads[2])}
    extra = iter(grads[3:])
    if "sinks" in x:
        res["dsinks"] = np.asarray(next(extra), np.float64)
    if "alibi_slopes" in x:
        res["dalibi"] = np.asarray(next(extra), np.float64)
    return res


def _check(x, shape, strategy, layout="contiguous", mode="shard_map", **kw):
    got = run_strategy(x, shape, strategy, layout=layout, mode=mode, **kw)
    check_against_reference(got, reference_for(x, **kw), "float32")
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
SHAPES = {"all_gather": [(2,), (4,), (8,)], "ulysses": [(2,), (4,), (8,)], "hybrid": [(2, 4)]}


def _cases():
    for strategy, shapes in SHAPES.items():
        for i, feature in enumerate(sorted(FEATURES)):
            yield strategy, feature, shapes[i % len(shapes)], LAYOUTS[i % 3], ("shard_map", "global")[i % 2]


@pytest.mark.parametrize("strategy, feature, shape, layout, mode", list(_cases()))
def test_features(strategy, feature, shape, layout, mode):
    shape_kw, kw = FEATURES[feature]
    x = make_inputs(sorted(FEATURES).index(feature) + 10 * len(shape) + 100 * shape[-1], seq=32, **shape_kw)
    _check(x, shape, strategy, layout, mode, **kw)


@pytest.mark.parametrize("strategy", sorted(SHAPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_causal(strategy, layout):
    shape = SHAPES[strategy][LAYOUTS.index(layout) % len(SHAPES[strategy])]
    x = make_inputs(7 + LAYOUTS.index(layout), seq=48 if len(shape) == 1 and shape[0] != 8 else 32,
                    heads=4 if shape != (8,) else 8, kv_heads=2, sinks=True)
    _check(x, shape, strategy, layout, ("global", "shard_map")[LAYOUTS.index(layout) % 2], causal=True)

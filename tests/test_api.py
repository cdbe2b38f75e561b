"""Calling modes of ring_attention and the errors it raises for misuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax

from harness import make_inputs, mesh_of, reference_for, rel_err
from reference import attention_reference


def _arrays(x, dtype=jnp.float32):
    return [jnp.asarray(x[n], dtype) for n in ("q", "k", "v")]


def test_single_device_mode_matches_reference():
    x = make_inputs(11, seq=48, segments="random", sinks=True)
    q, k, v = _arrays(x)
    out, lse = ringjax.ring_attention(q, k, v, axis_name=None, causal=True, sliding_window=9,
                                      segment_ids=jnp.asarray(x["segment_ids"]), sinks=jnp.asarray(x["sinks"]),
                                      return_lse=True)
    ref = reference_for(x, causal=True, sliding_window=9)
    assert rel_err(out, ref["out"]) < 1e-5
    assert rel_err(lse, ref["lse"]) < 1e-5


@pytest.mark.parametrize("how", ["set_mesh", "mesh_arg"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_global_mode(how, layout):
    x = make_inputs(12, seq=32, sinks=True)
    mesh = mesh_of(4)
    q, k, v = (ringjax.to_layout(a, layout, 4) for a in _arrays(x))
    sinks = jnp.asarray(x["sinks"])

    def f(q, k, v, sinks):
        kw = {} if how == "set_mesh" else {"mesh": mesh}
        out = ringjax.ring_attention(q, k, v, causal=True, layout=layout, sinks=sinks, **kw)
        return (out * ringjax.to_layout(jnp.asarray(x["dout"]), layout, 4)).sum(), out

    with jax.set_mesh(mesh):
        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    ref = attention_reference(x["q"], x["k"], x["v"], causal=True, sinks=x["sinks"], dout=x["dout"])
    assert rel_err(ringjax.from_layout(np.asarray(out), layout, 4), ref["out"]) < 1e-5
    for got, name in zip(grads, ("dq", "dk", "dv", "dsinks")):
        got = np.asarray(got) if name == "dsinks" else ringjax.from_layout(np.asarray(got), layout, 4)
        assert rel_err(got, ref[name]) < 1e-5, name


def test_global_mode_keeps_batch_and_heads_sharded():
    """Data-parallel batch and tensor-parallel heads stay sharded: no gather, same result."""
    x = make_inputs(13, batch=2, seq=16, heads=4, kv_heads=2)
    mesh_of(8)  # skips where fewer devices exist
    mesh = jax.make_mesh((2, 2, 2), ("dp", "sp", "tp"), axis_types=(AxisType.Explicit,) * 3)
    spec = P("dp", None, "tp", None)
    q, k, v = (jax.device_put(a, NamedSharding(mesh, spec)) for a in _arrays(x))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: ringjax.ring_attention(q, k, v, causal=True))(q, k, v)
        text = jax.jit(lambda q, k, v: ringjax.ring_attention(q, k, v, causal=True)).lower(q, k, v).as_text()
    assert out.sharding.spec[0] == "dp" and out.sharding.spec[2] == "tp"
    assert "all-gather" not in text and "all_gather" not in text
    ref = attention_reference(x["q"], x["k"], x["v"], causal=True)
    assert rel_err(np.asarray(out), ref["out"]) < 1e-5


def test_auto_axes_mesh():
    x = make_inputs(14, seq=16)
    mesh_of(4)  # skips where fewer devices exist
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: ringjax.ring_attention(q, k, v, causal=True))(*_arrays(x))
    ref = attention_reference(x["q"], x["k"], x["v"], causal=True)
    assert rel_err(np.asarray(out), ref["out"]) < 1e-5


def test_eager_inside_shard_map_and_dtype():
    x = make_inputs(15, seq=16, dtype="bfloat16")
    mesh = mesh_of(2)
    spec = P(None, "sp")
    q, k, v = (jax.device_put(a, NamedSharding(mesh, spec)) for a in _arrays(x, jnp.bfloat16))
    f = jax.shard_map(lambda q, k, v: ringjax.ring_attention(q, k, v), mesh=mesh, in_specs=spec, out_specs=spec)
    out = f(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    ref = attention_reference(x["q"], x["k"], x["v"])
    assert rel_err(np.asarray(out.astype(jnp.float32)), ref["out"]) < 2e-2


# --- misuse ------------------------------------------------------------------------------------

def _call_local(n, q, k, v, **kw):
    mesh = mesh_of(n)
    spec = P(None, "sp")
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (q, k, v)]
    f = jax.shard_map(lambda q, k, v: ringjax.ring_attention(q, k, v, **kw), mesh=mesh, in_specs=spec,
                      out_specs=spec)
    return jax.jit(f)(*args)


def _qkv(b=1, t=16, h=4, kvh=2, d=8, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((b, t, h, d)), dtype),
            jnp.asarray(rng.standard_normal((b, t, kvh, d)), dtype),
            jnp.asarray(rng.standard_normal((b, t, kvh, d)), dtype))


BAD = [
    ("sequence length", lambda q, k, v: ringjax.ring_attention(q[:, :14], k[:, :14], v[:, :14], mesh=mesh_of(4))),
    ("2 x the axis size", lambda q, k, v: ringjax.ring_attention(q[:, :12], k[:, :12], v[:, :12], layout="zigzag",
                                                                 mesh=mesh_of(4))),
    ("multiple of kv_heads", lambda q, k, v: ringjax.ring_attention(q[:, :, :3], k, v, axis_name=None)),
    ("batch", lambda q, k, v: ringjax.ring_attention(q, jnp.concatenate([k, k]), jnp.concatenate([v, v]),
                                                     axis_name=None)),
    ("head_dim", lambda q, k, v: ringjax.ring_attention(q, k[..., :4], v[..., :4], axis_name=None)),
    ("share one dtype", lambda q, k, v: ringjax.ring_attention(q, k.astype(jnp.bfloat16), v, axis_name=None)),
    ("v must have shape \\[batch, seq, kv_heads, v_head_dim\\]",
     lambda q, k, v: ringjax.ring_attention(q, k, v[:, :, :1], axis_name=None)),
    ("floating-point", lambda q, k, v: ringjax.ring_attention(q.astype(jnp.int32), k.astype(jnp.int32),
                                                              v.astype(jnp.int32), axis_name=None)),
    ("must have shape \\[batch, seq", lambda q, k, v: ringjax.ring_attention(q[0], k[0], v[0], axis_name=None)),
    ("non-negative", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, sliding_window=-1)),
    ("non-negative", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, sliding_window=(3, -2))),
    ("sliding_window", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, sliding_window=(1, 2, 3))),
    ("segment_ids must have shape", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, segment_ids=jnp.zeros((1, 15), jnp.int32))),
    ("segment_ids must be an integer", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, segment_ids=jnp.zeros((1, 16), jnp.float32))),
    ("segment_ids must fit int32, got values in \\[0, 4294967296\\]", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, segment_ids=np.repeat(np.array([[0, 2**32]], np.int64), 8, axis=1))),
    ("sinks must have shape", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, sinks=jnp.ones(2))),
    ("layout must be one of", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, layout="spiral")),
    ("not bound", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name="sp")),
    ("not bound", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name="seq", mesh=mesh_of(2))),
    ("softmax_scale", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, softmax_scale=-1.0)),
    ("logits_soft_cap", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, logits_soft_cap=0.0)),
    ("implementation must be", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, implementation="x")),
    # kernels add these to int32 positions: 2**31 - 1 wrapped around and ran a wrong mask without a word
    ("sliding_window must be at most 2\\*\\*30", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, sliding_window=2**31 - 1)),
    ("chunk_size must be at most 2\\*\\*30", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, chunk_size=2**31)),
    ("num_sink_tokens must be at most", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, num_sink_tokens=2**40)),
    ("head_dim must be positive", lambda q, k, v: ringjax.ring_attention(q[..., :0], k[..., :0], v[..., :0],
                                                                         axis_name=None)),
    ("head_dim must be positive, got q/k 8 and v 0", lambda q, k, v: ringjax.ring_attention(
        q, k, v[..., :0], axis_name=None)),
    ("dropout_rng must be one jax.random key.*got int", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, dropout_rate=0.1, dropout_rng=5)),
    ("dropout_rng must be one jax.random key.*got float32\\[2\\]", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, dropout_rate=0.1, dropout_rng=jnp.zeros(2))),
    ("dropout_rng must be one jax.random key", lambda q, k, v: ringjax.ring_attention(
        q, k, v, axis_name=None, dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0)))),
    ("mesh must be a jax.sharding.Mesh", lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name="sp", mesh="sp")),
]


@pytest.mark.parametrize("match,call", BAD, ids=[f"{i}-{m}" for i, (m, _) in enumerate(BAD)])
def test_bad_input_raises_before_device_work(match, call):
    with pytest.raises((ValueError, TypeError), match=match):
        call(*_qkv())


def test_type_errors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="causal"):
        ringjax.ring_attention(q, k, v, axis_name=None, causal=1)
    with pytest.raises(TypeError, match="sliding_window"):
        ringjax.ring_attention(q, k, v, axis_name=None, sliding_window=2.5)
    with pytest.raises(TypeError, match="q must be an array"):
        ringjax.ring_attention([[1.0]], k, v, axis_name=None)
    with pytest.raises(TypeError, match="config"):
        ringjax.ring_attention(q, k, v, axis_name=None, config=object())


def test_dropout_takes_either_kind_of_key():
    """jax.random.key (typed) and jax.random.PRNGKey (raw uint32[2]) of one seed draw the same mask."""
    q, k, v = _qkv()
    typed, raw = (ringjax.ring_attention(q, k, v, axis_name=None, dropout_rate=0.5, dropout_rng=key)
                  for key in (jax.random.key(3), jax.random.PRNGKey(3)))
    np.testing.assert_array_equal(np.asarray(typed), np.asarray(raw))
    other = ringjax.ring_attention(q, k, v, axis_name=None, dropout_rate=0.5, dropout_rng=jax.random.key(4))
    assert not np.array_equal(np.asarray(typed), np.asarray(other))


def test_errors_inside_shard_map_are_raised_while_tracing():
    q, k, v = _qkv(t=12)
    with pytest.raises(ValueError, match="even local sequence"):
        _call_local(4, q, k, v, layout="zigzag")  # local length 3
    with pytest.raises(ValueError, match="not bound"):
        _call_local(2, q, k, v, axis_name="other")


def test_single_device_mode_accepts_sequence_sharded_arrays():
    x = make_inputs(16, seq=16)
    mesh = mesh_of(4)
    q, k, v = (jax.device_put(a, NamedSharding(mesh, P(None, "sp"))) for a in _arrays(x))
    out = ringjax.ring_attention(q, k, v, axis_name=None, causal=True)
    with jax.set_mesh(mesh):
        traced = jax.jit(lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, causal=True))(q, k, v)
    ref = attention_reference(x["q"], x["k"], x["v"], causal=True)
    assert rel_err(np.asarray(out), ref["out"]) < 1e-5
    assert rel_err(np.asarray(traced), ref["out"]) < 1e-5

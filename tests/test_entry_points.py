"""Packed-QKV, packed-KV and varlen entry points against the dense float64 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax

from harness import check_against_reference, make_inputs, mesh_of, reference_for

# per kind: the function, which arrays it takes, and the axis of the sequence in them
KINDS = {
    "qkvpacked": (ringjax.ring_attention_qkvpacked, ("qkv",), 1),
    "kvpacked": (ringjax.ring_attention_kvpacked, ("q", "kv"), 1),
    "varlen": (ringjax.ring_attention_varlen, ("q", "k", "v", "cu_seqlens"), 0),
}


@functools.lru_cache(maxsize=None)
def _compiled(kind, n, layout, mode, kw_items):
    fn, names, seq_axis = KINDS[kind]
    kw = dict(kw_items, layout=layout, return_lse=True)
    if n == 1 and mode == "single":
        kw["axis_name"] = None
    mesh = mesh_of(n)
    seq_spec = P(None, "sp") if seq_axis == 1 else P("sp")
    lse_spec = P(None, None, "sp") if seq_axis == 1 else P(None, "sp")

    def loss(arrays, seg, sinks, dout, dlse):
        def attn(*args):
            *arrays, seg, sinks = args
            extra = {} if sinks is None else {"sinks": sinks}
            if seg is not None:
                extra["segment_ids"] = seg
            return fn(*arrays, **extra, **kw)

        if mode == "shard_map":
            specs = [P() if name == "cu_seqlens" else seq_spec for name in names]
            attn = jax.shard_map(attn, mesh=mesh, in_specs=(*specs, None if seg is None else P(None, "sp"),
                                                            None if sinks is None else P()),
                                 out_specs=(seq_spec, lse_spec))
        out, lse = attn(*arrays, seg, sinks)
        val = (out * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return val, (out, lse)

    # the cu_seqlens entry of `arrays` is integer: differentiate the float arrays only
    def grad_fn(arrays, seg, sinks, dout, dlse):
        floats = [a for name, a in zip(names, arrays) if name != "cu_seqlens"]
        rest = {i: a for i, (name, a) in enumerate(zip(names, arrays)) if name == "cu_seqlens"}

        def f(floats, sinks):
            it = iter(floats)
            full = [rest[i] if i in rest else next(it) for i in range(len(names))]
            return loss(full, seg, sinks, dout, dlse)

        return jax.value_and_grad(f, argnums=(0, 1) if sinks is not None else 0, has_aux=True)(floats, sinks)

    return jax.jit(grad_fn), mesh


def _segments_from_cu(cu, total):
    seg = np.searchsorted(cu, np.arange(total), side="right") - 1
    return np.where(np.arange(total) >= cu[-1], -1, seg).astype(np.int32)


def run_entry(kind, x, n, *, layout="contiguous", mode="shard_map", cu_seqlens=None, **kw):
    """Outputs, lse and gradients (unpacked to dq, dk, dv) in natural order, as float64."""
    fn, mesh = _compiled(kind, n, layout, mode, tuple(sorted(kw.items())))
    _, names, seq_axis = KINDS[kind]
    to = functools.partial(ringjax.to_layout, layout=layout, axis_size=n)
    back = functools.partial(ringjax.from_layout, layout=layout, axis_size=n)
    seq_sharding = NamedSharding(mesh, P(None, "sp") if seq_axis == 1 else P("sp"))
    q, k, v, dout, dlse = (x[name] for name in ("q", "k", "v", "dout", "dlse"))
    if kind == "varlen":  # batch of one, dropped
        q, k, v, dout, dlse = q[0], k[0], v[0], dout[0], dlse[0]
    given = {"q": q, "k": k, "v": v, "kv": np.stack([k, v], axis=2)}
    if kind == "qkvpacked":
        given["qkv"] = np.stack([q, k, v], axis=2)
    if mode == "single":  # plain unsharded arrays, no mesh
        put = lambda a: jnp.asarray(a)
    else:
        put = lambda a: jax.device_put(to(jnp.asarray(a), axis=seq_axis), seq_sharding)
    arrays = [jnp.asarray(cu_seqlens, jnp.int32) if name == "cu_seqlens" else put(given[name]) for name in names]
    sinks = jnp.asarray(x["sinks"]) if "sinks" in x else None
    seg = None
    if kind != "varlen" and "segment_ids" in x:
        seg = jnp.asarray(x["segment_ids"]) if mode == "single" else jax.device_put(
            to(jnp.asarray(x["segment_ids"]), axis=1), NamedSharding(mesh, P(None, "sp")))
    lse_axis = seq_axis + 1
    if mode == "single":
        (_, (out, lse)), grads = fn(arrays, seg, sinks, put(dout), jnp.asarray(dlse))
    else:
        dlse = jax.device_put(to(jnp.asarray(dlse), axis=lse_axis),
                              NamedSharding(mesh, P(None, None, "sp") if seq_axis == 1 else P(None, "sp")))
        with jax.set_mesh(mesh):
            (_, (out, lse)), grads = fn(arrays, seg, sinks, put(dout), dlse)
    if sinks is not None:
        grads, dsinks = grads
    grads = [np.asarray(back(np.asarray(g), axis=seq_axis), np.float64) for g in grads]
    if kind == "qkvpacked":
        grads = [grads[0][:, :, i] for i in range(3)]
    elif kind == "kvpacked":
        grads = [grads[0], grads[1][:, :, 0], grads[1][:, :, 1]]
    res = dict(zip(("dq", "dk", "dv"), grads))
    res["out"] = np.asarray(back(np.asarray(out), axis=seq_axis), np.float64)
    res["lse"] = np.asarray(back(np.asarray(lse), axis=lse_axis), np.float64)
    if sinks is not None:
        res["dsinks"] = np.asarray(dsinks, np.float64)
    if kind == "varlen":
        res = {name: val if name == "dsinks" else val[None] for name, val in res.items()}
    return res


# (kind, devices, layout, mode, inputs, features): every device count and every layout appears
CASES = {
    "qkvpacked_1dev_single": ("qkvpacked", 1, "contiguous", "single", dict(kv_heads=4, sinks=True),
                              dict(causal=True, sliding_window=7)),
    "qkvpacked_4dev_zigzag_segments": ("qkvpacked", 4, "zigzag", "shard_map", dict(kv_heads=4, segments="random"),
                                       dict(causal=True)),
    "kvpacked_2dev_global_gqa": ("kvpacked", 2, "contiguous", "global", {}, dict(causal=True)),
    "varlen_1dev_single": ("varlen", 1, "contiguous", "single", {}, dict(causal=True)),
    "varlen_2dev_contiguous_sinks": ("varlen", 2, "contiguous", "shard_map", dict(sinks=True), dict(causal=True)),
    "varlen_8dev_striped_window": ("varlen", 8, "striped", "shard_map", {}, dict(sliding_window=(5, 2))),
    "varlen_4dev_global_zigzag": ("varlen", 4, "zigzag", "global", {}, dict(causal=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_against_reference(case):
    kind, n, layout, mode, shape_kw, kw = CASES[case]
    seed = 800 + sorted(CASES).index(case)
    x = make_inputs(seed, batch=1, seq=32, heads=4, head_dim=8,
                    **{"kv_heads": 2, **shape_kw})
    cu = None
    if kind == "varlen":
        # random lengths, one empty sequence, a padded tail that sees nothing
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, 12, size=4)
        lengths[1] = 0
        cu = np.concatenate([[0], np.cumsum(lengths)]).clip(max=29).astype(np.int32)
        x["segment_ids"] = _segments_from_cu(cu, 32)[None]
    got = run_entry(kind, x, n, layout=layout, mode=mode, cu_seqlens=cu, **kw)
    check_against_reference(got, reference_for(x, **kw), "float32")


def test_packed_results_equal_unpacked_exactly():
    x = make_inputs(820, batch=1, seq=16, heads=4, kv_heads=2, head_dim=8)
    q, k, v = (jnp.asarray(x[n]) for n in "qkv")
    want = ringjax.ring_attention(q, k, v, axis_name=None, causal=True)
    got = ringjax.ring_attention_kvpacked(q, jnp.stack([k, v], axis=2), axis_name=None, causal=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _qkv(t=16, h=4, kvh=2):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((t, n, 8)), jnp.float32) for n in (h, kvh, kvh)]


CU = jnp.asarray([0, 5, 16], jnp.int32)
BAD = [
    ("qkv must have shape \\[batch, seq, 3", lambda q, k, v: ringjax.ring_attention_qkvpacked(
        jnp.stack([q, q, q], axis=1)[None, :, :2], axis_name=None)),
    ("qkv must be an array", lambda q, k, v: ringjax.ring_attention_qkvpacked([[1.0]], axis_name=None)),
    ("qkv must be a floating-point array, got int32", lambda q, k, v: ringjax.ring_attention_qkvpacked(
        jnp.stack([q, q, q], axis=1)[None].astype(jnp.int32), axis_name=None)),
    ("kv must have shape \\[batch, seq, 2", lambda q, k, v: ringjax.ring_attention_kvpacked(
        q[None], k[None], axis_name=None)),
    ("kv must be an array", lambda q, k, v: ringjax.ring_attention_kvpacked(q[None], None, axis_name=None)),
    ("causal", lambda q, k, v: ringjax.ring_attention_kvpacked(
        q[None], jnp.stack([k, v], axis=2)[None], axis_name=None, causal=1)),
    ("q must have shape \\[total_tokens", lambda q, k, v: ringjax.ring_attention_varlen(
        q[None], k, v, CU, axis_name=None)),
    ("k must have shape \\[total_tokens", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k[None], v, CU, axis_name=None)),
    ("cu_seqlens must have shape", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, CU[None], axis_name=None)),
    ("cu_seqlens must be an integer", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, CU.astype(jnp.float32), axis_name=None)),
    ("cu_seqlens must be an int32 array", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, [0, 16], axis_name=None)),
    ("cu_seqlens must start at 0", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, CU + 1, axis_name=None)),
    ("non-decreasing", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, jnp.asarray([0, 9, 4], jnp.int32), axis_name=None)),
    ("exceeds the global number of tokens", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, jnp.asarray([0, 17], jnp.int32), axis_name=None)),
    ("derives segment_ids", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, CU, axis_name=None, segment_ids=None)),
    ("total_tokens 12 must be divisible by 8", lambda q, k, v: ringjax.ring_attention_varlen(
        q[:12], k[:12], v[:12], CU.at[2].set(12), layout="zigzag", mesh=mesh_of(4))),
    ("not bound", lambda q, k, v: ringjax.ring_attention_varlen(q, k, v, CU)),
    ("takes one axis_name, not the hybrid", lambda q, k, v: ringjax.ring_attention_varlen(
        q, k, v, CU, axis_name=("h", "r"), strategy="hybrid")),
]


@pytest.mark.parametrize("match,call", BAD, ids=[f"{i}-{m[:24]}" for i, (m, _) in enumerate(BAD)])
def test_bad_arguments(match, call):
    with pytest.raises((ValueError, TypeError), match=match):
        call(*_qkv())


def test_varlen_inside_shard_map_checks_cu_values_against_the_global_length():
    """Inside shard_map, cu_seqlens is global: 32 tokens over 2 shards of 16 are fine, 33 is not."""
    mesh = mesh_of(2)
    q, k, v = (jax.device_put(a, NamedSharding(mesh, P("sp"))) for a in _qkv(t=32))

    def call(cu):
        f = jax.shard_map(lambda q, k, v: ringjax.ring_attention_varlen(q, k, v, cu), mesh=mesh,
                          in_specs=P("sp"), out_specs=P("sp"))
        return jax.jit(f).trace(q, k, v)  # trace only: the checks run while tracing

    call(np.asarray([0, 20, 32], np.int32))
    with pytest.raises(ValueError, match="exceeds the global number of tokens \\(32\\)"):
        call(np.asarray([0, 20, 33], np.int32))

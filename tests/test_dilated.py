"""dilated_attention (LongNet) against the dense float64 reference with per-head multiplicities."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax

from harness import check_against_reference, make_inputs, mesh_of, rel_err
from reference import attention_reference


def dilated_counts(seq, heads, branches):
    """[1, H, T, T]: in how many branches head h's query i sees key j (before causal/window/segments)."""
    i = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    counts = np.zeros((1, heads, seq, seq))
    for w, r in branches:
        for h in range(heads):
            counts[0, h] += (i // w == j // w) & (i % r == h % r) & (j % r == h % r)
    return counts


def reference(x, branches, **kw):
    ref_kw = {name: kw[name] for name in ("causal", "softmax_scale", "logits_soft_cap") if name in kw}
    if kw.get("sliding_window") is not None:
        ref_kw["window"] = kw["sliding_window"]
    return attention_reference(x["q"], x["k"], x["v"], segment_ids=x.get("segment_ids"), sinks=x.get("sinks"),
                               dout=x["dout"], dlse=x["dlse"],
                               counts=dilated_counts(x["q"].shape[1], x["q"].shape[2], branches), **ref_kw)


@functools.lru_cache(maxsize=None)
def _compiled(n, layout, mode, branches, kw_items, has_seg, has_sinks):
    kw = dict(kw_items, segment_lengths=[w for w, _ in branches], dilation_rates=[r for _, r in branches])
    mesh = mesh_of(n)

    def loss(q, k, v, seg, sinks, dout, dlse):
        def attn(q, k, v, seg, sinks):
            return ringjax.dilated_attention(q, k, v, layout=layout, segment_ids=seg, sinks=sinks, return_lse=True,
                                             **kw)

        if mode == "shard_map":
            spec = P(None, "sp")
            attn = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec, None if seg is None else spec,
                                                            None if sinks is None else P()),
                                 out_specs=(spec, P(None, None, "sp")))
        out, lse = attn(q, k, v, seg, sinks)
        val = (out * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return val, (out, lse)

    argnums = (0, 1, 2) + ((4,) if has_sinks else ())
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True)), mesh


def run_dilated(x, n, branches, *, layout="contiguous", mode="shard_map", **kw):
    """Outputs, lse and gradients on n simulated devices, in natural order, as float64."""
    fn, mesh = _compiled(n, layout, mode, tuple(branches), tuple(sorted(kw.items())), "segment_ids" in x,
                         "sinks" in x)
    seq_sharding = NamedSharding(mesh, P(None, "sp"))
    to = functools.partial(ringjax.to_layout, layout=layout, axis_size=n, axis=1)
    back = functools.partial(ringjax.from_layout, layout=layout, axis_size=n, axis=1)
    put = lambda a: jax.device_put(to(jnp.asarray(a)), seq_sharding)
    seg = put(x["segment_ids"]) if "segment_ids" in x else None
    sinks = jax.device_put(jnp.asarray(x["sinks"]), NamedSharding(mesh, P())) if "sinks" in x else None
    dlse = jax.device_put(ringjax.to_layout(jnp.asarray(x["dlse"]), layout, n, axis=2),
                          NamedSharding(mesh, P(None, None, "sp")))
    with jax.set_mesh(mesh):
        (_, (out, lse)), grads = fn(put(x["q"]), put(x["k"]), put(x["v"]), seg, sinks, put(x["dout"]), dlse)
    res = {name: np.asarray(back(np.asarray(g)), np.float64) for name, g in zip(("dq", "dk", "dv"), grads)}
    res["out"] = np.asarray(back(np.asarray(out)), np.float64)
    res["lse"] = np.asarray(ringjax.from_layout(np.asarray(lse), layout, n, axis=2), np.float64)
    if "sinks" in x:
        res["dsinks"] = np.asarray(grads[3], np.float64)
    return res


# (devices, layout, mode, branches, inputs, features): every device count and every layout appears
CASES = {
    "1dev_segments_sinks": (1, "contiguous", "shard_map", ((8, 2), (6, 1)),
                            dict(segments="random", sinks=True), dict(causal=True)),
    "2dev_contiguous_window": (2, "contiguous", "shard_map", ((16, 4),), {}, dict(sliding_window=(6, 3))),
    "4dev_zigzag_segments": (4, "zigzag", "shard_map", ((16, 2), (32, 1)), dict(segments="random"),
                             dict(causal=True)),
    "8dev_contiguous_mqa_sinks_softcap": (8, "contiguous", "shard_map", ((8, 2),), dict(sinks=True, kv_heads=1),
                                          dict(causal=True, logits_soft_cap=3.0)),
    "2dev_striped_undilated": (2, "striped", "shard_map", ((8, 1),), {}, dict(causal=True)),
    # heads 0, 2, 4 of offset 0 use kv heads 0, 0, 1: not whole groups, so kv heads are repeated per head
    "4dev_global_zigzag_gqa_regroup": (4, "zigzag", "global", ((16, 2),), dict(heads=6, kv_heads=2),
                                       dict(causal=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_against_reference(case):
    n, layout, mode, branches, shape_kw, kw = CASES[case]
    x = make_inputs(sorted(CASES).index(case) + 700, batch=1, seq=32, head_dim=8, **{"heads": 4, **shape_kw})
    got = run_dilated(x, n, branches, layout=layout, mode=mode, **kw)
    check_against_reference(got, reference(x, branches, **kw), "float32")


def test_sinks_of_minus_inf_leave_rows_that_see_no_key_zero():
    """Heads without a sink (-inf) on rows that see no key: their lse and the sink's are both -inf, where
    jnp.logaddexp's derivatives were NaN and so was dsinks."""
    x = make_inputs(790, batch=1, seq=32, heads=4, kv_heads=2, head_dim=8, segments="random", sinks=True)
    x["sinks"][[0, 2]] = -np.inf
    got = run_dilated(x, 2, ((8, 2), (16, 1)), causal=True)
    check_against_reference(got, reference(x, ((8, 2), (16, 1)), causal=True), "float32")
    assert (np.asarray(x["segment_ids"]) < 0).any()
    assert np.all(got["dsinks"][[0, 2]] == 0.0)


def test_one_full_branch_is_ring_attention_exactly():
    x = make_inputs(710, batch=1, seq=16, heads=4, kv_heads=2, head_dim=8, segments="random", sinks=True)
    q, k, v = (jnp.asarray(x[n]) for n in "qkv")
    kw = dict(axis_name=None, causal=True, segment_ids=jnp.asarray(x["segment_ids"]), sinks=jnp.asarray(x["sinks"]),
              return_lse=True)
    want = ringjax.ring_attention(q, k, v, **kw)
    got = ringjax.dilated_attention(q, k, v, segment_lengths=16, dilation_rates=1, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unselected_tokens_get_nothing():
    """r = 2 on 3 heads (offsets with 2 and 1 heads, run separately): heads 0 and 2 see only even
    tokens, head 1 only odd ones; unselected tokens get out 0 and lse -inf."""
    x = make_inputs(711, batch=1, seq=8, heads=3, kv_heads=1, head_dim=8)
    q, k, v = (jnp.asarray(x[n]) for n in "qkv")
    out, lse = jax.jit(lambda q, k, v: ringjax.dilated_attention(
        q, k, v, segment_lengths=8, dilation_rates=2, axis_name=None, return_lse=True))(q, k, v)
    out, lse = np.asarray(out), np.asarray(lse)
    for h in range(3):
        assert np.isneginf(lse[0, h, 1 - h % 2::2]).all() and np.isfinite(lse[0, h, h % 2::2]).all()
        assert (out[0, 1 - h % 2::2, h] == 0).all()
    ref = attention_reference(x["q"], x["k"], x["v"], counts=dilated_counts(8, 3, [(8, 2)]))
    assert rel_err(out, ref["out"]) < 1e-5 and rel_err(lse, ref["lse"]) < 1e-5


def test_heads_sharded_globally_keep_global_offsets():
    """Global mode with heads sharded over 'tp': head offsets follow the global head index."""
    x = make_inputs(712, batch=2, seq=16, heads=4, kv_heads=2, head_dim=8)
    mesh_of(8)  # skips where fewer devices exist
    mesh = jax.make_mesh((2, 2, 2), ("dp", "sp", "tp"), axis_types=(AxisType.Explicit,) * 3)
    q, k, v = (jax.device_put(jnp.asarray(x[n]), NamedSharding(mesh, P("dp", None, "tp", None))) for n in "qkv")
    branches = [(8, 2), (16, 1)]
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: ringjax.dilated_attention(
            q, k, v, segment_lengths=[8, 16], dilation_rates=[2, 1], causal=True))(q, k, v)
    assert out.sharding.spec[0] == "dp" and out.sharding.spec[2] == "tp"
    ref = attention_reference(x["q"], x["k"], x["v"], causal=True, counts=dilated_counts(16, 4, branches))
    assert rel_err(np.asarray(out), ref["out"]) < 1e-5


def _qkv(t=16, h=4, kvh=2):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((1, t, n, 8)), jnp.float32) for n in (h, kvh, kvh)]


BAD = [
    ("multiple of its dilation", dict(segment_lengths=6, dilation_rates=4)),
    ("same length", dict(segment_lengths=[8, 16], dilation_rates=[2])),
    ("segment_lengths must be positive", dict(segment_lengths=0, dilation_rates=1)),
    ("dilation_rates must be a", dict(segment_lengths=8, dilation_rates=2.0)),
    ("must not be empty", dict(segment_lengths=[], dilation_rates=[])),
    ("does not support \\['alibi_slopes'\\]", dict(segment_lengths=8, dilation_rates=2, alibi_slopes=None)),
    ("causal must be a bool", dict(segment_lengths=8, dilation_rates=2, causal=1)),
    ("layout must be one of", dict(segment_lengths=8, dilation_rates=2, layout="spiral")),
    ("multiple of kv_heads", dict(segment_lengths=8, dilation_rates=2, _q_heads=3)),
    ("layout 'striped'", dict(segment_lengths=8, dilation_rates=2, layout="striped", mesh=4)),
    ("local sequence length \\(4\\) to be a multiple", dict(segment_lengths=24, dilation_rates=8, mesh=4)),
    ("half the local sequence", dict(segment_lengths=8, dilation_rates=4, layout="zigzag", mesh=4)),
    ("not bound", dict(segment_lengths=8, dilation_rates=2, axis_name="sp")),
    ("segment_lengths must be positive and at most 2\\*\\*30", dict(segment_lengths=2**31, dilation_rates=2)),
    # each id is combined with its segment index in int32: 2**30 * 2 segments wrapped around without a word
    ("segment_ids must stay below 1073741824 with segment length 8", dict(
        segment_lengths=8, dilation_rates=1, _ids=[0] * 8 + [2**30] * 8)),
]


@pytest.mark.parametrize("match,kw", BAD, ids=[f"{i}-{m[:20]}" for i, (m, _) in enumerate(BAD)])
def test_bad_arguments(match, kw):
    q, k, v = _qkv()
    kw = dict(kw)
    if "_q_heads" in kw:
        q = q[:, :, :kw.pop("_q_heads")]
    if "_ids" in kw:
        kw["segment_ids"] = jnp.asarray([kw.pop("_ids")], jnp.int32)
    if "mesh" in kw:
        kw["mesh"] = mesh_of(kw["mesh"])
    elif "axis_name" not in kw:
        kw["axis_name"] = None
    with pytest.raises((ValueError, TypeError), match=match):
        ringjax.dilated_attention(q, k, v, **kw)


def test_layout_errors_inside_shard_map():
    mesh = mesh_of(2)
    spec = P(None, "sp")
    q, k, v = (jax.device_put(a, NamedSharding(mesh, spec)) for a in _qkv(t=24))
    f = jax.shard_map(lambda q, k, v: ringjax.dilated_attention(q, k, v, segment_lengths=8, dilation_rates=8),
                      mesh=mesh, in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match="local sequence length \\(12\\)"):
        jax.jit(f)(q, k, v)


def test_short_segments_shorten_the_ring():
    """Segments of one shard's length reach only the neighbouring shards: 3 ring steps, not 8."""
    n, seq = 8, 64
    mesh = mesh_of(n)
    spec = P(None, "sp")
    shapes = [jax.ShapeDtypeStruct((1, seq, 4, 8), jnp.float32, sharding=NamedSharding(mesh, spec))] * 3

    def count(**kw):
        f = jax.shard_map(lambda q, k, v: ringjax.dilated_attention(q, k, v, **kw), mesh=mesh, in_specs=spec,
                          out_specs=spec)
        with jax.set_mesh(mesh):
            text = jax.jit(f).lower(*shapes).as_text()
        return sum(line.count("collective_permute") for line in text.splitlines())

    # K, V and segment ids travel: one first shift plus 2 ring transfers, against 7 for the whole ring
    assert count(segment_lengths=8, dilation_rates=2) == 3 * 3
    assert count(segment_lengths=seq, dilation_rates=2) == 2 * (n - 1)

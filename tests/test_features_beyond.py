"""Chunked causal, ALiBi, dropout and sink tokens across the ring, against the float64 reference."""

import jax
import numpy as np
import pytest

from ringjax.backends.xla import XlaConfig

from harness import check_against_reference, make_inputs, reference_for, run_ring

DEVICES = [1, 2, 4, 8]
LAYOUTS = ["contiguous", "zigzag", "striped"]
BLOCKS = XlaConfig(block_q=4, block_kv=4)

CASES = {
    "chunked_causal": ({}, dict(causal=True, chunk_size=12)),
    "chunk_bidirectional_segments": (dict(segments="random"), dict(chunk_size=8)),
    "chunked_causal_packed": (dict(segments="random"), dict(causal=True, chunk_size=5)),
    "alibi": (dict(alibi=True), dict(causal=True)),
    "alibi_softcap_window": (dict(alibi=True, sinks=True), dict(sliding_window=(6, 3), logits_soft_cap=3.0)),
    "sink_tokens_window": ({}, dict(causal=True, sliding_window=5, num_sink_tokens=3)),
    "sink_tokens_packed": (dict(segments="random"), dict(causal=True, sliding_window=4, num_sink_tokens=2)),
    "dropout": (dict(dropout_key=7), dict(causal=True, dropout_rate=0.3)),
    "dropout_alibi_segments": (dict(dropout_key=11, alibi=True, segments="random"), dict(dropout_rate=0.2)),
}


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_feature(case, n):
    shape_kw, kw = CASES[case]
    layout = LAYOUTS[(n + sorted(CASES).index(case)) % 3]
    x = make_inputs(n * 31 + sorted(CASES).index(case), seq=32, **shape_kw)
    got = run_ring(x, n, layout=layout, implementation="xla", config=BLOCKS, **kw)
    check_against_reference(got, reference_for(x, **kw), "float32")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_mask_is_independent_of_ring_size_and_layout(layout):
    x = make_inputs(3, seq=32, dropout_key=5)
    kw = dict(causal=True, dropout_rate=0.5)
    one = run_ring(x, 1, implementation="xla", config=BLOCKS, **kw)
    many = run_ring(x, 4, layout=layout, implementation="xla", config=BLOCKS, **kw)
    np.testing.assert_allclose(many["out"], one["out"], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(many["dq"], one["dq"], rtol=2e-5, atol=2e-6)


def test_dropout_keep_rate_and_key_dependence():
    import jax.numpy as jnp

    from ringjax.core.modifiers import dropout_keep

    pos = jnp.arange(512, dtype=jnp.int32)
    seed = jax.random.bits(jax.random.key(0), (2,), jnp.uint32)
    other = jax.random.bits(jax.random.key(1), (2,), jnp.uint32)
    bh = jnp.arange(4).reshape(4, 1, 1)
    keep = np.asarray(dropout_keep(seed, 0.3, bh, pos, pos))
    assert abs(keep.mean() - 0.7) < 0.005  # 1M draws: std of the mean is 0.0005
    assert abs(keep[0].mean() - keep[1].mean()) < 0.01
    assert (keep[0] != keep[1]).mean() > 0.3  # heads draw different masks
    assert (keep != np.asarray(dropout_keep(other, 0.3, bh, pos, pos))).mean() > 0.3


def test_sink_tokens_reach_far_shards_without_the_whole_ring():
    from test_structure import _compiled, _count

    # window of 20 over 16-token shards: 3 steps, 2 K/V transfers; the 2 sink tokens come by psum
    text = _compiled(8, 128, fwd_only=True, causal=True, sliding_window=20, num_sink_tokens=2).as_text()
    assert _count(text, "collective_permute") == 2 * 2
    assert _count(text, "all_reduce") + _count(text, "all-reduce") >= 1


def test_chunked_causal_shortens_the_ring():
    from test_structure import _compiled, _count

    # chunks of 16 over 16-token shards: a query only needs its own and the previous shard
    text = _compiled(8, 128, fwd_only=True, causal=True, chunk_size=16).as_text()
    assert _count(text, "collective_permute") == 2 * 1


def test_feature_errors():
    import jax.numpy as jnp

    import ringjax

    q = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ValueError, match="dropout_rng"):
        ringjax.ring_attention(q, q, q, axis_name=None, dropout_rate=0.1)
    with pytest.raises(ValueError, match="dropout_rate"):
        ringjax.ring_attention(q, q, q, axis_name=None, dropout_rate=1.0, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="dropout_rate is 0"):
        ringjax.ring_attention(q, q, q, axis_name=None, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="chunk_size"):
        ringjax.ring_attention(q, q, q, axis_name=None, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        ringjax.ring_attention(q, q, q, axis_name=None, chunk_size=2.5)
    with pytest.raises(ValueError, match="num_sink_tokens"):
        ringjax.ring_attention(q, q, q, axis_name=None, num_sink_tokens=-1)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        ringjax.ring_attention(q, q, q, axis_name=None, alibi_slopes=jnp.ones(3))


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_per_document_chunks_are_segments_of_document_chunk_pairs(chunk):
    """`chunk_size` with `segment_ids` runs as plain segments numbering (id, chunk of its run) pairs: the same
    mask as the reference's, also for an id that comes back after another (its runs' chunks restart) and
    for padding (negative ids, of any value)."""
    import jax.numpy as jnp

    from ringjax.core.ring import _chunk_ids

    from reference import mask_reference

    rng = np.random.default_rng(chunk)
    seg = rng.integers(-2, 3, size=(3, 48)).repeat(2, axis=1)[:, :64]  # runs of 2+, ids recurring, padding
    seg[1] = np.sort(seg[1])  # packed documents in order
    ids = np.asarray(_chunk_ids(jnp.asarray(seg, jnp.int32), chunk))
    assert (ids[seg < 0] == -1).all() and (ids[seg >= 0] >= 0).all()
    for causal in (False, True):
        want = mask_reference(64, causal=causal, segment_ids=seg, chunk_size=chunk)
        np.testing.assert_array_equal(mask_reference(64, causal=causal, segment_ids=ids), want)

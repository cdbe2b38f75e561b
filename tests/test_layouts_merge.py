"""Layouts (positions, reordering) and the lse merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringjax
from ringjax.layouts import local_positions

from harness import rel_err
from reference import attention_reference


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_positions_match_to_layout(layout, n):
    seq = 16 * n
    reordered = np.asarray(ringjax.to_layout(np.arange(seq)[None], layout, n))
    local = seq // n
    for shard in range(n):
        expected = np.asarray(local_positions(layout, shard, n, local))
        np.testing.assert_array_equal(reordered[0, shard * local:(shard + 1) * local], expected)
    roundtrip = ringjax.from_layout(ringjax.to_layout(np.arange(seq)[None], layout, n), layout, n)
    np.testing.assert_array_equal(np.asarray(roundtrip), np.arange(seq)[None])


def test_zigzag_positions_are_two_chunks():
    # 4 shards, 8 chunks of 2: shard 1 holds chunks 1 and 6
    np.testing.assert_array_equal(np.asarray(local_positions("zigzag", 1, 4, 4)), [2, 3, 12, 13])
    np.testing.assert_array_equal(np.asarray(local_positions("striped", 1, 4, 4)), [1, 5, 9, 13])


def test_layout_errors():
    with pytest.raises(ValueError, match="divisible"):
        ringjax.to_layout(np.zeros((1, 10)), "zigzag", 4)
    with pytest.raises(ValueError, match="layout"):
        ringjax.to_layout(np.zeros((1, 8)), "diagonal", 4)
    with pytest.raises(ValueError, match="axis_size must be a positive int, got True"):
        ringjax.to_layout(np.zeros((1, 8)), "zigzag", True)
    np.testing.assert_array_equal(ringjax.to_layout(np.arange(8)[None], "zigzag", np.int64(2)),
                                  ringjax.to_layout(np.arange(8)[None], "zigzag", 2))
    for fn in (ringjax.to_layout, ringjax.from_layout):  # a mesh axis name is not a sharding
        with pytest.raises(TypeError, match="out_sharding must be None, a jax.sharding.Sharding .* got 'sp'"):
            fn(jnp.zeros((1, 8)), "zigzag", 2, out_sharding="sp")
        with pytest.raises(ValueError, match="names mesh axes but no mesh is set"):  # before jit's own error
            fn(jnp.zeros((1, 8)), "zigzag", 2, out_sharding=jax.sharding.PartitionSpec(None, "sp"))


def test_merge_of_two_key_sets_equals_attention_over_both():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 8, 2, 4)) for _ in range(3))
    full = attention_reference(q, k, v)
    # attention over the first 5 keys and over the last 3, merged
    parts = [_partial(q, k, v, keep) for keep in (np.arange(8) < 5, np.arange(8) >= 5)]
    out, lse = ringjax.merge_attention(jnp.asarray(parts[0][0], jnp.float32), jnp.asarray(parts[0][1], jnp.float32),
                                       jnp.asarray(parts[1][0], jnp.float32), jnp.asarray(parts[1][1], jnp.float32))
    assert rel_err(out, full["out"]) < 1e-6 and rel_err(lse, full["lse"]) < 1e-6


def _partial(q, k, v, keep):
    s = np.einsum("bqhd,bkhd->bhqk", q, k[:, keep]) / 2.0  # head_dim 4: scale 1/2
    lse = np.log(np.exp(s).sum(-1))
    p = np.exp(s - lse[..., None])
    return np.einsum("bhqk,bkhd->bqhd", p, v[:, keep]), lse


def test_merge_keeps_empty_rows_exact():
    rng = np.random.default_rng(1)
    out = jnp.asarray(rng.standard_normal((1, 3, 1, 2)), jnp.float32)
    lse = jnp.asarray([[[0.5, -jnp.inf, -jnp.inf]]], jnp.float32)
    empty_out = jnp.zeros_like(out)
    empty_lse = jnp.full_like(lse, -jnp.inf)
    m_out, m_lse = ringjax.merge_attention(out * jnp.asarray([1, 0, 0.0])[None, :, None, None], lse, empty_out,
                                           empty_lse)
    assert not jnp.isnan(m_out).any()
    assert jnp.isneginf(m_lse[0, 0, 1:]).all() and m_lse[0, 0, 0] == 0.5
    many_out, many_lse = ringjax.merge_attention_many([out, out, out], [lse, lse, lse])
    np.testing.assert_allclose(many_lse[0, 0, 0], 0.5 + np.log(3), rtol=1e-6)
    with pytest.raises(ValueError, match="equally many"):
        ringjax.merge_attention_many([out], [])
    with pytest.raises(TypeError, match="outs and lses must be lists"):
        ringjax.merge_attention_many(out, lse)
    with pytest.raises(TypeError, match="part 1: lse must be a floating-point array, got int32 array"):
        ringjax.merge_attention(out, lse, out, lse.astype(jnp.int32))

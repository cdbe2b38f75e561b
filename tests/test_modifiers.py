"""The score modifiers of core/modifiers.py against plain float64 formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringjax.core import modifiers
from ringjax.options import AttentionOptions

from reference import dropout_keep_reference

SCALE = 0.125
QK = np.linspace(-400.0, 400.0, 2001)  # raw dot products: far into the cap's flat tails and through 0


def _opts(cap):
    return AttentionOptions(softmax_scale=SCALE, logits_soft_cap=cap)


def _ref(cap):
    """Natural logits and d logits / d qk in float64."""
    s = QK * SCALE
    if cap is None:
        return s, np.full_like(s, SCALE)
    t = np.tanh(s / cap)
    return cap * t, SCALE * (1.0 - t * t)


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """Run each check on float32 (the kernels' dtype) and on float64 (the formula alone)."""
    with jax.enable_x64(request.param == "float64"):
        yield jnp.dtype(request.param)


def _tol(dtype):
    return dict(rtol=1e-13, atol=1e-13) if dtype == jnp.float64 else dict(rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("cap", [None, 5.0, 30.0])
def test_logits_and_slope(cap, dtype):
    qk = jnp.asarray(QK, dtype)
    want_s, want_slope = _ref(cap)
    np.testing.assert_allclose(modifiers.logits(qk, _opts(cap)), want_s, **_tol(dtype))
    s, slope = modifiers.logits_and_slope(qk, _opts(cap))
    np.testing.assert_allclose(s, want_s, **_tol(dtype))
    np.testing.assert_allclose(np.broadcast_to(slope, qk.shape), want_slope, **_tol(dtype))
    if cap is not None:
        assert np.all(np.abs(np.asarray(s)) <= cap)


@pytest.mark.parametrize("cap", [None, 5.0, 30.0])
def test_base2_logits_are_natural_logits_times_log2e(cap, dtype):
    qk = jnp.asarray(QK, dtype)
    want_s, want_slope = _ref(cap)
    s2, t = modifiers.logits2(qk, _opts(cap))
    np.testing.assert_allclose(s2, want_s * math.log2(math.e), **_tol(dtype))
    if cap is None:
        assert t is None
    else:
        np.testing.assert_allclose(t, np.tanh(QK * SCALE / cap), **_tol(dtype))
    slope = modifiers.logit_slope(t, _opts(cap))
    np.testing.assert_allclose(np.broadcast_to(slope, qk.shape), want_slope, **_tol(dtype))


def test_base2_logits_without_cap_are_one_multiply():
    qk = jnp.asarray(QK, jnp.float32)
    s2, _ = modifiers.logits2(qk, _opts(None))
    np.testing.assert_array_equal(s2, qk * jnp.float32(SCALE * modifiers.LOG2E))


def test_slope_matches_autodiff():
    qk = jnp.asarray(QK, jnp.float32)
    opts = _opts(5.0)
    grad = jax.vmap(jax.grad(lambda x: modifiers.logits(x, opts)))(qk)
    _, t = modifiers.logits2(qk, opts)
    np.testing.assert_allclose(modifiers.logit_slope(t, opts), grad, rtol=1e-5, atol=1e-7)


def test_alibi_distance():
    q, k = np.array([0, 5, 9, 40]), np.array([3, 9, 17])
    np.testing.assert_array_equal(modifiers.alibi_distance(jnp.asarray(q), jnp.asarray(k)),
                                  -np.abs(q[:, None] - k[None, :]).astype(np.float64))


SEED = np.array([0x1234ABCD, 0x9E3779B9], np.uint32)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(rate):
    pos = jnp.arange(512, dtype=jnp.int32)
    keep = np.asarray(modifiers.dropout_keep(jnp.asarray(SEED), rate, jnp.arange(4).reshape(4, 1, 1), pos, pos))
    # 1M draws: the mean's standard deviation is at most 0.0005
    assert abs(keep.mean() - (1.0 - rate)) < 0.003


def test_dropout_keep_is_the_documented_hash():
    pos = jnp.arange(64, dtype=jnp.int32)
    bh = jnp.arange(6).reshape(2, 3, 1, 1)
    got = modifiers.dropout_keep(jnp.asarray(SEED), 0.3, bh, pos, pos)
    np.testing.assert_array_equal(got, dropout_keep_reference(SEED, 0.3, 2, 3, 64))


def test_dropout_keep_depends_only_on_seed_batch_head_and_positions():
    seed = jnp.asarray(SEED)
    pos = jnp.arange(256, dtype=jnp.int32)
    bh = jnp.arange(3).reshape(3, 1, 1)
    whole = np.asarray(modifiers.dropout_keep(seed, 0.4, bh, pos, pos))
    np.testing.assert_array_equal(modifiers.dropout_keep(seed, 0.4, bh, pos, pos), whole)
    # any tile of any layout: the same positions give the same draws
    qp, kp = jnp.asarray([200, 7, 63, 130]), jnp.arange(96, 160)
    np.testing.assert_array_equal(modifiers.dropout_keep(seed, 0.4, bh, qp, kp), whole[:, qp][:, :, kp])
    assert (whole[0] != whole[1]).mean() > 0.3  # another head, another mask
    other = np.asarray(modifiers.dropout_keep(jnp.asarray(SEED ^ np.uint32(1)), 0.4, bh, pos, pos))
    assert (whole != other).mean() > 0.3
    assert np.asarray(modifiers.dropout_keep(seed, 0.0, bh, pos, pos)).all()


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keep_has_no_visible_structure(rate):
    """Neighbouring rows, columns, diagonals and heads agree as often as independent draws would."""
    pos = jnp.arange(1024, dtype=jnp.int32)
    keep = np.asarray(modifiers.dropout_keep(jnp.asarray(SEED), rate, jnp.arange(2).reshape(2, 1, 1), pos, pos))
    p = 1.0 - rate
    independent = p * p + (1 - p) * (1 - p)
    pairs = {"rows": (keep[:, 1:], keep[:, :-1]), "columns": (keep[:, :, 1:], keep[:, :, :-1]),
             "diagonal": (keep[:, 1:, 1:], keep[:, :-1, :-1]), "anti-diagonal": (keep[:, 1:, :-1], keep[:, :-1, 1:]),
             "heads": (keep[1], keep[0]), "rows 64 apart": (keep[:, 64:], keep[:, :-64])}
    for name, (a, b) in pairs.items():  # about 1M pairs each: 4 sigma is under 0.002
        assert abs((a == b).mean() - independent) < 0.003, name


def test_dropout_mix_decides_as_murmur3_but_on_ties():
    """The per-pair mix leaves out the finaliser's last xor-shift: the same top 16 bits, so against any threshold
    it keeps what the whole finaliser keeps but where those bits tie the threshold's (about 1 in 65536)."""
    x = jnp.asarray(np.random.default_rng(3).integers(0, 2**32, 1 << 20, dtype=np.uint32))
    high, whole = np.asarray(modifiers._fmix32_high(x)), np.asarray(modifiers._fmix32(x))
    np.testing.assert_array_equal(high >> 16, whole >> 16)
    for rate in (0.1, 0.37, 0.9):
        t = np.uint32(modifiers.dropout_threshold(rate))
        differ = (high >= t) != (whole >= t)
        assert differ.sum() <= np.sum((high >> 16) == (t >> 16)) and differ.mean() < 1e-4


def test_dropout_terms_carry_the_first_xor_shift_of_their_xor():
    """The kernels' per-element mix starts after the finaliser's first xor-shift, done on the query and key
    vectors: the same decisions as the finaliser of the terms' xor, pair for pair."""
    rng = np.random.default_rng(5)
    key = jnp.uint32(rng.integers(0, 2**32, dtype=np.uint32))
    q_pos, k_pos = (jnp.asarray(rng.integers(0, 2**20, n), jnp.int32) for n in (96, 160))
    q_term = q_pos.astype(jnp.uint32)[:, None] * jnp.uint32(0x9E3779B1)
    k_term = k_pos.astype(jnp.uint32)[None, :] * jnp.uint32(0x85EBCA77) + key
    for rate in (0.1, 0.5):
        whole = modifiers._fmix32_high(q_term ^ k_term) >= modifiers.dropout_threshold(rate)
        split = modifiers.dropout_keep_pairs(key, rate, q_pos[:, None], k_pos[None, :])
        np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
        assert 0.3 < np.asarray(whole).mean() < 0.95


def test_dropout_batch_head_counts_global_heads():
    b, h = np.arange(2).reshape(2, 1), np.arange(4).reshape(1, 4)
    np.testing.assert_array_equal(modifiers.dropout_batch_head(None, b, h, 4), b * 4 + h)
    # heads 4..7 of 8 (a Ulysses slice) count as global heads
    np.testing.assert_array_equal(modifiers.dropout_batch_head(np.array([4, 8]), b, h, 4), b * 8 + 4 + h)

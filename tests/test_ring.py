"""The XLA ring against the float64 reference: outputs, lse and gradients.

Every case runs on simulated CPU devices; each feature is checked on 1, 2, 4 and 8.
"""

import numpy as np
import pytest

from harness import check_against_reference, make_inputs, reference_for, run_ring

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


def test_reference_check_can_fail():
    """The comparison detects a wrong result (a dropped key block changes everything)."""
    x = make_inputs(5, seq=32)
    got = run_ring(x, 4, causal=True, implementation="xla", config=_small_blocks())
    ref = reference_for(x, causal=False)
    with pytest.raises(AssertionError):
        check_against_reference(got, ref, "float32")

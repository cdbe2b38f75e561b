"""Property-based check: random shapes, device counts and feature combinations."""

import jax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringjax.backends.xla import XlaConfig

from harness import check_against_reference, make_inputs, reference_for, run_ring


@st.composite
def problems(draw):
    n = draw(st.sampled_from([n for n in (1, 2, 4, 8) if n <= len(jax.devices())]))  # a 1-GPU machine runs n = 1
    layout = draw(st.sampled_from(["contiguous", "zigzag", "striped"]))
    chunk = 2 if layout == "zigzag" else 1
    local = chunk * draw(st.integers(1, 6))
    kv_heads = draw(st.sampled_from([1, 2]))
    shape = dict(batch=draw(st.integers(1, 2)), seq=local * n, heads=kv_heads * draw(st.sampled_from([1, 3])),
                 kv_heads=kv_heads, head_dim=draw(st.sampled_from([4, 8, 12])),
                 v_head_dim=draw(st.sampled_from([None, 4, 20])),  # None: head_dim; else v's own (MLA)
                 segments=draw(st.sampled_from([None, "random"])), sinks=draw(st.booleans()))
    kw = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):
        kw["sliding_window"] = draw(
            st.one_of(st.integers(0, 3 * local), st.tuples(st.integers(0, 9), st.integers(0, 9))))
    if draw(st.booleans()):
        kw["logits_soft_cap"] = draw(st.floats(0.5, 30.0))
    blocks = XlaConfig(block_q=draw(st.integers(1, 8)), block_kv=draw(st.integers(1, 8)))
    return n, layout, shape, kw, blocks, draw(st.integers(0, 2**31))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_match_reference(problem):
    n, layout, shape, kw, blocks, seed = problem
    x = make_inputs(seed, **shape)
    got = run_ring(x, n, layout=layout, implementation="xla", config=blocks, **kw)
    check_against_reference(got, reference_for(x, **kw), "float32")

"""Coming from `jax.nn.dot_product_attention`: its keywords point to ours, and the mapping computes the same."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringjax
from ringjax.options import FOREIGN_KEYWORDS, KEYWORDS_BY_NAME

# each jax.nn keyword, a value a user would pass, and what the error must name
JAX_NN = [
    ("is_causal", True, "causal=True"),
    ("scale", 0.5, "softmax_scale"),
    ("local_window_size", (4, 0), "sliding_window=\\(left, right\\)"),
    ("bias", None, "alibi_slopes.*segment_ids.*sliding_window.*chunk_size.*logits_soft_cap"),
    ("mask", None, "segment_ids.*causal.*sliding_window"),
    ("query_seq_lengths", None, "segment_ids.*negative"),
    ("key_value_seq_lengths", None, "segment_ids.*negative"),
    ("return_residual", True, "return_lse=True"),
]
# every entry point that takes ring_attention's keywords; the arrays are never looked at (no device work)
ENTRY_POINTS = {
    "ring_attention": lambda **kw: ringjax.ring_attention("q", "k", "v", **kw),
    "dilated_attention": lambda **kw: ringjax.dilated_attention("q", "k", "v", segment_lengths=8, dilation_rates=1,
                                                                **kw),
    "ring_attention_qkvpacked": lambda **kw: ringjax.ring_attention_qkvpacked("qkv", **kw),
    "ring_attention_kvpacked": lambda **kw: ringjax.ring_attention_kvpacked("q", "kv", **kw),
    "ring_attention_varlen": lambda **kw: ringjax.ring_attention_varlen("q", "k", "v", "cu", **kw),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name, value, ours", JAX_NN, ids=[n for n, _, _ in JAX_NN])
def test_jax_nn_keyword_names_ours(entry, name, value, ours):
    with pytest.raises(TypeError, match=f"{entry}\\(\\) got an unexpected keyword argument '{name}'.*{ours}"):
        ENTRY_POINTS[entry](axis_name=None, **{name: value})


def test_every_jax_nn_keyword_is_ours_or_explained():
    """A keyword jax.nn adds later shows up here, so it gets an explanation rather than Python's bare error."""
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    theirs = set(params) - {"query", "key", "value"}
    assert theirs - set(KEYWORDS_BY_NAME) <= set(FOREIGN_KEYWORDS)
    assert {name for name, _, _ in JAX_NN} == theirs - set(KEYWORDS_BY_NAME)


def test_misspelled_keyword_gets_a_suggestion():
    with pytest.raises(TypeError, match="did you mean 'causal'"):
        ringjax.ring_attention("q", "k", "v", casual=True)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_ring_attention_equals_jax_nn(window):
    """causal + sliding_window=w + softmax_scale=s is jax.nn's is_causal + local_window_size=(w, 0) + scale=s."""
    rng = np.random.default_rng(0)
    batch, seq, heads, kv_heads, head_dim = 2, 32, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    scale = 0.3
    ours = ringjax.ring_attention(q, k, v, axis_name=None, causal=True, sliding_window=window, softmax_scale=scale)
    with jax.default_matmul_precision("highest"):  # GPUs would round jax.nn's float32 matmuls to TF32
        theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window, 0), scale=scale)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)

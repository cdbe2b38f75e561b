"""`cache_attention`'s prefill on Hopper (`prefill.partials`: long chunks on the ring's forward kernel) against
the float64 reference, and the cache implementation's choice between it and the decode kernel.

Queries at consecutive positions per row attend to a cache part striped over `devices` devices; rows start at
different positions (ragged batches). On CPU the kernel runs eagerly in jax's Mosaic GPU interpreter; on an
sm90+ GPU compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_mosaic_gpu_decode import _cache, _check, _reference, _striped, needs_kernels

from ringjax.backends.pallas_mosaic_gpu import prefill
from ringjax.backends.pallas_mosaic_gpu.cache import CACHE_IMPLEMENTATION
from ringjax.backends.pallas_mosaic_gpu.config import DecodeConfig, MosaicGpuConfig
from ringjax.core.masks import Extras
from ringjax.core.problem import Problem
from ringjax.options import AttentionOptions

from harness import ON_HOPPER

# 64-key blocks: several blocks per cache part even at these sizes
SMALL = MosaicGpuConfig(block_kv=64, interpret=not ON_HOPPER)

CASES = {
    # rows at different offsets; the first row's queries reach past the second's whole cache part
    "causal_gqa_ragged_striped": dict(b=2, t=100, h=4, kvh=2, devices=2, device=1, k_len=(400, 300),
                                      q_first=(300, 150), kw=dict(causal=True)),
    # slots past a row's length hidden by segment ids; no rule but k_len
    "noncausal_soft_cap": dict(b=2, t=70, h=2, kvh=2, devices=1, device=0, k_len=(100, 128), q_first=(30, 58),
                               kw=dict(logits_soft_cap=5.0)),
    "window_chunks_three_devices": dict(b=1, t=130, h=6, kvh=2, devices=3, device=2, k_len=(700,), q_first=(570,),
                                        kw=dict(causal=True, window=(90, 0), chunk_size=128)),
}


@needs_kernels
@pytest.mark.parametrize("case", CASES)
def test_partials_match_reference(case):
    c = CASES[case]
    b, t, h, kvh, d = c["b"], c["t"], c["h"], c["kvh"], 64
    rng = np.random.default_rng(len(case))
    opts = AttentionOptions(softmax_scale=d ** -0.5, axis_size=c["devices"], layout="striped", **c["kw"])
    (k, v), = _cache(rng, b, 128 * 2, kvh, d, d, "bfloat16")
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k_pos = _striped(k.shape[1], c["devices"], c["device"])
    q_pos = (np.asarray(c["q_first"])[:, None] + np.arange(t)).astype(np.int32)
    got = prefill.partials(q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(c["k_len"], jnp.int32),
                           opts, None, SMALL)
    assert got[0].shape == (b, t, h, d) and got[1].shape == (b, t, h)
    _check(got, _reference(q, q_pos, [(k, v)], [k_pos], c["k_len"], opts), "bfloat16")


@needs_kernels
def test_alibi_through_the_cache_implementation():
    """The cache implementation sends 96 tokens x 2 heads per KV head (192 rows, over one decode CTA's 128) to
    the forward kernel, ALiBi's slopes with them; the same call with a DecodeConfig is a TypeError."""
    b, t, h, kvh, d, n = 1, 96, 4, 2, 64, 2
    rng = np.random.default_rng(3)
    slopes = jnp.asarray(np.linspace(0.1, 0.5, h), jnp.float32)
    opts = AttentionOptions(softmax_scale=0.125, causal=True, has_alibi=True, axis_size=n, layout="striped")
    (k, v), = _cache(rng, b, 256, kvh, d, d, "bfloat16")
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k_pos, k_len = _striped(256, n, 0), np.array([450], np.int32)
    q_pos = (k_len[:, None] - t + np.arange(t)).astype(np.int32)
    args = (q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(k_len), opts)
    got = CACHE_IMPLEMENTATION.partials(*args, extras=Extras(alibi_slopes=slopes), config=SMALL)
    ref = _reference(q, q_pos, [(k, v)], [k_pos], k_len, AttentionOptions(softmax_scale=0.125, causal=True),
                     alibi_slopes=np.asarray(slopes))
    _check(got, ref, "bfloat16")
    with pytest.raises(TypeError, match="= 192 rows, more than a decode CTA's 128, run the forward kernel: pass a "
                                        "MosaicGpuConfig"):
        CACHE_IMPLEMENTATION.partials(*args, config=DecodeConfig())


def _problem(t, opts, heads=32, kv_heads=8, slots=4096):
    return Problem(opts=opts, batch=1, seq=slots, heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16",
                   platform="gpu", q_seq=t)


def test_decode_or_prefill_by_rows_per_kv_head():
    """Up to 128 query rows per KV head the decode kernel's refusals apply (it has no ALiBi), beyond them the
    forward kernel's (which has)."""
    alibi = AttentionOptions(causal=True, has_alibi=True, axis_size=2, layout="striped")
    assert "ALiBi" in CACHE_IMPLEMENTATION.supports(_problem(16, alibi))  # 16 x 4 = 64 rows
    why = CACHE_IMPLEMENTATION.supports(_problem(64, alibi))  # 256 rows
    assert why is None or "ALiBi" not in why, why
    assert isinstance(CACHE_IMPLEMENTATION.default_config(_problem(16, alibi)), DecodeConfig)
    assert isinstance(CACHE_IMPLEMENTATION.default_config(_problem(64, alibi)), MosaicGpuConfig)
    sinks = AttentionOptions(num_sink_tokens=4, axis_size=2, layout="striped")
    assert "sink tokens without causal" in CACHE_IMPLEMENTATION.supports(_problem(64, sinks))
    assert "float32" in CACHE_IMPLEMENTATION.supports(
        Problem(opts=alibi, batch=1, seq=4096, heads=32, kv_heads=8, head_dim=128, dtype="float32", platform="gpu",
                q_seq=64))


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_lowers_to_the_forward_kernel_for_cuda(causal):
    """The rows' loop holds one Mosaic GPU kernel (and without causal, the padding segment ids beside it)."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    b, t, h, kvh, d, slots = 2, 300, 8, 2, 128, 512
    opts = AttentionOptions(softmax_scale=0.1, causal=causal, window=(200, 0) if causal else None, axis_size=2,
                            layout="striped")
    s = jax.ShapeDtypeStruct
    args = (s((b, t, h, d), jnp.bfloat16), s((b, slots, kvh, d), jnp.bfloat16), s((b, slots, kvh, d), jnp.bfloat16),
            s((b, t), jnp.int32), s((slots,), jnp.int32), s((b,), jnp.int32))
    text = jax.jit(lambda *x: prefill.partials(*x, opts)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1

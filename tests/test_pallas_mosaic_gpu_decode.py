"""The Mosaic GPU split-K decode kernel (`decode.partials`) against the float64 reference.

Queries at their global positions attend to a cache part whose slots hold arbitrary increasing
positions (contiguous or striped over devices) and whose rows are valid up to k_len. The reference
is `reference.attention_reference` on dense positions: every cache key placed at its position,
`counts` keeping only the keys the cache holds below k_len. On CPU the kernel runs eagerly in jax's
Mosaic GPU interpreter (block matmuls as jnp.dot); on an sm90+ GPU compiled, with bigger shapes too.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringjax
from ringjax.backends.pallas_mosaic_gpu.config import SMEM_LIMIT, DecodeConfig
from ringjax.backends.pallas_mosaic_gpu.decode import default_config, merge_splits, partials, supports, visit_table
from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal, interpreter_refusal
from ringjax.options import AttentionOptions

from harness import ON_HOPPER, rel_err
from reference import attention_reference

INTERPRET = not ON_HOPPER
_WHY_NOT = None if ON_HOPPER else interpreter_refusal()
needs_kernels = pytest.mark.skipif(_WHY_NOT is not None, reason=f"the Mosaic GPU kernels cannot run here: {_WHY_NOT}")
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90+ GPU (big shapes compiled; on CPU only small "
                                 "shapes run in the interpreter)")
TOL = {"bfloat16": 1e-2, "float16": 2e-3}
SMALL = DecodeConfig(block_k=64, num_splits=2, num_stages=2)


def _cache(rng, batch, slots, kv_heads, head_dim, head_dim_v, dtype, parts=1):
    """`parts` cache parts (k [B, S, KVH, D], v [B, S, KVH, Dv]) of random keys, one per device."""
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return [(cast(rng.standard_normal((batch, slots, kv_heads, head_dim))),
             cast(rng.standard_normal((batch, slots, kv_heads, head_dim_v)))) for _ in range(parts)]


def _reference(q, q_pos, parts, k_positions, k_len, opts: AttentionOptions, alibi_slopes=None):
    """float64 (out [B, t, H, Dv], lse [B, t, H]) of q at q_pos against every cache part's keys below k_len."""
    q, q_pos, k_len = np.asarray(q, np.float64), np.asarray(q_pos), np.asarray(k_len)
    b, t, h, d = q.shape
    kvh, dv = parts[0][0].shape[2], parts[0][1].shape[3]
    total = int(max(np.max(q_pos), max(int(np.max(p)) for p in k_positions))) + 1
    dense_q = np.zeros((b, total, h, d))
    dense_k, dense_v = np.zeros((b, total, kvh, d)), np.zeros((b, total, kvh, dv))
    counts = np.zeros((b, 1, total, total))
    for (k, v), pos in zip(parts, k_positions):
        pos = np.asarray(pos)
        dense_k[:, pos], dense_v[:, pos] = np.asarray(k, np.float64), np.asarray(v, np.float64)
        for row in range(b):
            counts[row, 0, :, pos[pos < k_len[row]]] = 1.0
    for row in range(b):
        dense_q[row, q_pos[row]] = q[row]
    ref = attention_reference(dense_q, dense_k, dense_v, causal=opts.causal, window=opts.window,
                              softmax_scale=opts.softmax_scale, logits_soft_cap=opts.logits_soft_cap,
                              chunk_size=opts.chunk_size, alibi_slopes=alibi_slopes, counts=counts)
    rows = np.arange(b)[:, None]
    return ref["out"][rows, q_pos], np.swapaxes(ref["lse"], 1, 2)[rows, q_pos]


def _check(got, ref, dtype):
    out, lse = (np.asarray(x) for x in got)
    assert np.isfinite(out).all(), "out is not finite"
    assert not np.isnan(lse).any(), "lse has NaN"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref[1])), "rows that see no key differ"
    assert (out[np.isneginf(lse)] == 0).all(), "rows that see no key must give 0"
    for name, a, r in (("out", out, ref[0]), ("lse", lse, ref[1])):
        err = rel_err(a, r)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e} exceeds {TOL[dtype]:.0e}"


def _striped(slots: int, n: int, device: int):
    """Positions of a cache part striped over n devices: slot j of device d holds position j * n + d."""
    return np.arange(slots, dtype=np.int32) * n + device


def _case(b=1, t=1, h=4, kvh=2, d=64, dv=None, slots=256, dtype="bfloat16", devices=1, device=0, k_len=(256,),
          q_first=None, config=SMALL, **kw):
    """One call: a cache part of `slots` slots (device `device` of `devices`, striped), rows valid up to `k_len`,
    t queries per row from `q_first` (default: the row's last t tokens), AttentionOptions keywords `kw`."""
    return dict(b=b, t=t, h=h, kvh=kvh, d=d, dv=dv or d, slots=slots, dtype=dtype, devices=devices, device=device,
                k_len=list(k_len), q_first=q_first or [max(n - t, 0) for n in k_len], config=config, kw=kw)


CASES = {
    # row 0 sees 99..199: block 1 in part, 2 whole, 3 in part (k_len); row 1 sees 0..76: block 0 whole, 1 in part
    "t1_gqa_ragged_causal_window": _case(b=2, k_len=(200, 77), causal=True, window=(100, 0)),
    "t4_gqa4_window_striped": _case(b=2, t=4, kvh=1, devices=2, device=1, k_len=(500, 311), causal=True,
                                    window=(150, 0)),
    # no rule but k_len: the second row stops inside a block
    "soft_cap_ragged_noncausal_f16": _case(b=2, t=2, h=2, dtype="float16", k_len=(256, 99), logits_soft_cap=3.0,
                                           config=DecodeConfig(block_k=128, num_splits=2, num_stages=3)),
    # keys at 4j + 3. Row 0 has none (k_len 0; the window alone would show position 3); in row 1 query 397
    # sees none (its window is 396..398), query 398 sees 399
    "fully_masked_rows": _case(b=2, t=2, slots=128, devices=4, device=3, k_len=(0, 400), q_first=(2, 397),
                               window=(1, 1)),
    "chunked_causal_striped": _case(t=3, h=6, dtype="float16", devices=3, device=2, k_len=(700,), causal=True,
                                    chunk_size=100),
    # 16 tokens x 8 heads per KV head: 128 rows, two consumer tiles
    "two_row_tiles": _case(t=16, h=8, kvh=1, k_len=(250,), causal=True),
    "head_dims_128_to_64": _case(t=2, d=128, dv=64, causal=True,
                                 config=DecodeConfig(block_k=128, num_splits=2, num_stages=2)),
}


@needs_kernels
@pytest.mark.parametrize("case", CASES)
def test_partials_match_reference(case):
    c = CASES[case]
    b, t, d, dtype, k_len = c["b"], c["t"], c["d"], c["dtype"], c["k_len"]
    rng = np.random.default_rng(len(case))
    opts = AttentionOptions(softmax_scale=d ** -0.5, **c["kw"])
    (k, v), = _cache(rng, b, c["slots"], c["kvh"], d, c["dv"], dtype)
    q = jnp.asarray(rng.standard_normal((b, t, c["h"], d)), dtype)
    k_pos = _striped(c["slots"], c["devices"], c["device"])
    q_pos = (np.asarray(c["q_first"])[:, None] + np.arange(t)).astype(np.int32)
    got = partials(q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(k_len, jnp.int32), opts,
                   c["config"], interpret=INTERPRET)
    assert got[0].shape == (b, t, c["h"], c["dv"]) and got[1].shape == (b, t, c["h"])
    assert got[0].dtype == got[1].dtype == jnp.float32
    _check(got, _reference(q, q_pos, [(k, v)], [k_pos], k_len, opts), dtype)


@needs_kernels
def test_devices_merge_by_lse_to_the_whole_cache():
    """Two striped cache parts, each through `partials` (default config), merged by lse: attention to the whole."""
    b, t, h, kvh, d, slots, n = 2, 4, 4, 1, 64, 256, 2
    rng = np.random.default_rng(5)
    opts = AttentionOptions(causal=True, softmax_scale=0.2, window=(200, 0))
    parts = _cache(rng, b, slots, kvh, d, d, "bfloat16", parts=n)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k_len = np.array([300, 511], np.int32)
    q_pos = (k_len[:, None] - t + np.arange(t)).astype(np.int32)
    positions = [_striped(slots, n, dev) for dev in range(n)]
    outs, lses = [], []
    for (k, v), pos in zip(parts, positions):
        out, lse = partials(q, k, v, jnp.asarray(q_pos), jnp.asarray(pos), jnp.asarray(k_len), opts,
                            interpret=INTERPRET)
        outs.append(out)
        lses.append(jnp.swapaxes(lse, 1, 2))  # merge_attention_many takes lse [B, H, t]
    out, lse = ringjax.merge_attention_many(outs, lses)
    _check((out, jnp.swapaxes(lse, 1, 2)), _reference(q, q_pos, parts, positions, k_len, opts), "bfloat16")


# --------------------------------------------------------------------------- pieces without the kernel


def test_visit_table_deals_only_visible_blocks():
    opts = AttentionOptions(causal=True, window=(100, 0))
    k_pos = jnp.asarray(_striped(512, 2, 1))  # positions 1, 3, ..., 1023; 64-key blocks span 128 positions
    q_pos = jnp.array([[700, 701], [50, 51]], jnp.int32)
    table = np.asarray(visit_table(opts, q_pos, k_pos, jnp.array([702, 1024], jnp.int32), 64))
    # row 0 sees positions 600..701: blocks 4 (513..639) and 5 (641..767), neither whole
    assert table[0].tolist() == [4, 4, 4, 6]
    # row 1 sees positions 0..51: block 0 only
    assert table[1, 0] == 0 and table[1, 3] == 1
    # no rule and a full row: every block whole
    full = np.asarray(visit_table(AttentionOptions(), q_pos, k_pos, jnp.array([0, 5000], jnp.int32), 64))
    assert full[1].tolist() == [0, 0, 8, 8]
    assert full[0, 3] <= full[0, 0], "a row of length 0 visits nothing"


def test_merge_splits_of_empty_splits_is_zero_and_minus_inf():
    out = jnp.ones((1, 1, 3, 2, 4), jnp.float32)
    lse = jnp.array([[[[0.0, -jnp.inf], [-jnp.inf, -jnp.inf], [np.log(3.0), -jnp.inf]]]], jnp.float32)
    merged, m = merge_splits(out, lse)
    np.testing.assert_allclose(np.asarray(m)[0, 0], [np.log(4.0), -np.inf], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(merged)[0, 0], [[1.0] * 4, [0.0] * 4])


def _shapes(b=1, t=1, h=32, kvh=8, d=128, s=131072, dv=None):
    return (b, t, h, d), (b, s, kvh, d), (b, s, kvh, dv or d)


@pytest.mark.parametrize("kw, match", [
    (dict(opts=AttentionOptions(has_alibi=True)), "ALiBi (`alibi_slopes`) is not implemented"),
    (dict(opts=AttentionOptions(dropout_rate=0.1)), "dropout"),
    (dict(opts=AttentionOptions(num_sink_tokens=4)), "sink tokens"),
    (dict(opts=AttentionOptions(has_sinks=True)), "learnable sinks"),
    (dict(opts=AttentionOptions(has_segments=True)), "packed sequences"),
    (dict(dtype=jnp.float32), "dtype float32 is not supported"),
    (dict(shapes=_shapes(d=80, dv=128)), "head_dim 80 is not supported: needs 64, 96"),
    (dict(shapes=_shapes(dv=80)), "v head_dim 80"),
    (dict(shapes=_shapes(t=17, h=32, kvh=4)), "17 x 8 = 136 rows"),
    (dict(shapes=_shapes(s=1000)), "multiple of 64"),
    (dict(shapes=_shapes(h=30)), "multiple of kv_heads"),
])
def test_supports_names_the_reason(kw, match):
    shapes = kw.get("shapes", _shapes())
    why = supports(*shapes, kw.get("dtype", jnp.bfloat16), kw.get("opts", AttentionOptions(causal=True)))
    assert why is not None and match in why, why


@pytest.mark.skipif(ON_HOPPER, reason="checks the refusal where no Hopper GPU is present")
def test_supports_refuses_without_a_hopper_gpu():
    why = supports(*_shapes(), jnp.bfloat16, AttentionOptions(causal=True))
    assert why is not None and ("not a CUDA GPU" in why or "compute capability" in why or "jax >=" in why), why


@pytest.mark.skipif(not ON_HOPPER, reason="a Hopper GPU accepts the issue's shapes")
def test_supports_the_issue_shapes_on_hopper():
    for t in (1, 4):
        assert supports(*_shapes(t=t), jnp.bfloat16, AttentionOptions(causal=True)) is None


@pytest.mark.parametrize("bad", [dict(block_k=96), dict(num_splits=0), dict(num_stages=1), dict(num_stages=9),
                                 dict(block_k=True), dict(num_splits=2.0)])
def test_config_validation(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        DecodeConfig(**bad)


def test_config_json_round_trip():
    cfg = DecodeConfig(block_k=64, num_splits=17, num_stages=4)
    assert DecodeConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("b, t, h, kvh, d, s", [(1, 1, 32, 8, 128, 131072), (1, 4, 32, 8, 128, 1 << 20),
                                                (8, 1, 32, 8, 128, 131072), (1, 16, 64, 8, 256, 65536),
                                                (4, 2, 8, 8, 64, 4096), (64, 1, 32, 8, 128, 8192)])
def test_default_config_fits_and_fills_the_gpu(b, t, h, kvh, d, s):
    class Device:  # what default_config reads of a device
        core_count = 132

    shapes = _shapes(b, t, h, kvh, d, s)
    cfg = default_config(*shapes, jnp.bfloat16, Device())
    rows = -(-t * h // kvh // 64) * 64
    assert cfg.smem_bytes(rows, d, d) <= SMEM_LIMIT - 1024
    assert s % cfg.block_k == 0
    ctas = b * kvh * cfg.num_splits
    assert cfg.num_splits <= s // cfg.block_k
    assert ctas >= 2 * 132 or cfg.num_splits == s // cfg.block_k, cfg
    if d <= 128 and t * h // kvh <= 64:
        assert cfg.block_k == 128 and cfg.num_stages >= 3, cfg  # the deep pipeline fits
    if ctas > 132:
        assert ctas / (-(-ctas // 132) * 132) >= 0.9, f"{ctas} CTAs leave a wave mostly idle"


def _call_args(b=1, t=1, h=4, kvh=2, d=64, s=128):
    x = jnp.zeros((b, t, h, d), jnp.bfloat16)
    kv = jnp.zeros((b, s, kvh, d), jnp.bfloat16)
    return [x, kv, kv, jnp.zeros((b, t), jnp.int32), jnp.arange(s, dtype=jnp.int32), jnp.full((b,), s, jnp.int32)]


@pytest.mark.parametrize("index, value, err, match", [
    (0, jnp.zeros((1, 4, 64), jnp.bfloat16), ValueError, "q must be 4-D"),
    (1, jnp.zeros((1, 128, 2, 64), jnp.float16), TypeError, "share one dtype"),
    (3, jnp.zeros((1, 2), jnp.int32), ValueError, r"q_pos must have shape \[1, 1\]"),
    (4, jnp.arange(64, dtype=jnp.int32), ValueError, r"k_pos must have shape \[128\]"),
    (5, jnp.zeros((1,), jnp.float32), TypeError, "k_len must be an integer array"),
    (2, jnp.zeros((1, 128, 3, 64), jnp.bfloat16), ValueError, "must agree on cache length and kv_heads"),
])
def test_bad_input_names_the_argument(index, value, err, match):
    args = _call_args()
    args[index] = value
    with pytest.raises(err, match=match):
        partials(*args, AttentionOptions(), interpret=True)


def test_bad_options_and_config_are_refused():
    with pytest.raises(ValueError, match="ALiBi"):
        partials(*_call_args(), AttentionOptions(has_alibi=True), interpret=True)
    with pytest.raises(ValueError, match="block_k 256 must divide"):
        partials(*_call_args(s=192), AttentionOptions(), DecodeConfig(block_k=256), interpret=True)
    with pytest.raises(TypeError, match="opts must be an AttentionOptions"):
        partials(*_call_args(), {"causal": True}, interpret=True)


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernel really runs")
@pytest.mark.parametrize("t, h, kvh, d, dv, config, kw", [
    (1, 32, 8, 128, 128, DecodeConfig(block_k=128, num_splits=33, num_stages=3), dict(causal=True)),
    (4, 32, 8, 128, 128, DecodeConfig(block_k=64, num_splits=8, num_stages=4),
     dict(causal=True, window=(1000, 0), logits_soft_cap=30.0)),
    (16, 32, 4, 256, 256, DecodeConfig(block_k=64, num_splits=4, num_stages=2), dict(chunk_size=500)),
])
def test_kernel_lowers_to_mosaic_gpu_for_cuda(t, h, kvh, d, dv, config, kw):
    if _jax_refusal():
        pytest.skip(_jax_refusal())
    opts = AttentionOptions(softmax_scale=0.1, **kw)
    s = jax.ShapeDtypeStruct
    args = (s((2, t, h, d), jnp.bfloat16), s((2, 8192, kvh, d), jnp.bfloat16), s((2, 8192, kvh, dv), jnp.bfloat16),
            s((2, t), jnp.int32), s((8192,), jnp.int32), s((2,), jnp.int32))
    f = jax.jit(lambda *a: partials(*a, opts, config))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernel really runs")
@pytest.mark.parametrize("t, d, dv, block_k, stages, fits", [
    (8, 128, 128, 128, 3, True),  # 64 rows, 4 KiB under the count's limit
    (32, 192, 128, 128, 2, False),  # 128 rows: the compiler needs 234,576 bytes (counted 231,424 before)
    (32, 192, 128, 64, 4, False),  # the compiler: 234,640
    (32, 192, 128, 64, 3, True),  # what the heuristic now picks there
])
def test_shared_memory_count_matches_the_compiler(monkeypatch, t, d, dv, block_k, stages, fits):
    """The config check admits what compiles and refuses what would not: with the check bypassed, a config it
    refuses is refused by Mosaic GPU's own count, lowered for CUDA. 192 / 128 (multi-head latent attention) at
    128 rows was admitted by the heuristic at the count's limit and failed to compile."""
    import ringjax.backends.pallas_mosaic_gpu.decode as decode

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    config = DecodeConfig(block_k=block_k, num_splits=2, num_stages=stages)
    s = jax.ShapeDtypeStruct
    args = (s((2, t, 32, d), jnp.bfloat16), s((2, 8192, 8, d), jnp.bfloat16), s((2, 8192, 8, dv), jnp.bfloat16),
            s((2, t), jnp.int32), s((8192,), jnp.int32), s((2,), jnp.int32))
    why = decode._config_refusal(config, args[0].shape, args[1].shape, args[2].shape, 2)
    assert (why is None) == fits, why
    assert fits or "bytes of shared memory" in why
    chosen = default_config(args[0].shape, args[1].shape, args[2].shape)
    assert decode._config_refusal(chosen, args[0].shape, args[1].shape, args[2].shape, 2) is None
    if d == 192:
        assert (chosen.block_k, chosen.num_stages) == (64, 3)  # the last case: it compiles
    monkeypatch.setattr(decode, "_config_refusal", lambda *a: None)
    lower = jax.jit(lambda *a: partials(*a, AttentionOptions(softmax_scale=0.1, causal=True), config)).trace(
        *args).lower
    if fits:
        lower(lowering_platforms=("cuda",))
    else:
        with pytest.raises(Exception, match="exceeds available shared memory"):
            lower(lowering_platforms=("cuda",))


# --------------------------------------------------------------------------- compiled, bigger (sm90 only)


@hopper_only
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=(3000, 0), logits_soft_cap=30.0)])
def test_issue_shapes_against_float32(t, kw):
    """32 / 8 heads, head_dim 128, bf16, a 64K-slot striped cache part with ragged rows, default config."""
    b, h, kvh, d, s, n = 2, 32, 8, 128, 65536, 2
    rng = np.random.default_rng(t)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kvh, d)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k_pos = jnp.asarray(_striped(s, n, 1))
    k_len = jnp.array([2 * s, 70001], jnp.int32)
    q_pos = k_len[:, None] - t + jnp.arange(t, dtype=jnp.int32)
    opts = AttentionOptions(softmax_scale=d ** -0.5, **kw)
    out, lse = jax.jit(lambda *a: partials(*a, opts))(q, k, v, q_pos, k_pos, k_len)
    # float32 reference over the dense slots
    g = h // kvh
    kf, vf = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf, precision="highest") * opts.softmax_scale
    if opts.logits_soft_cap:
        logits = opts.logits_soft_cap * jnp.tanh(logits / opts.logits_soft_cap)
    qp, kp = q_pos[:, None, :, None], k_pos[None, None, None, :]
    valid = (kp < k_len[:, None, None, None]) & (kp <= qp)
    if opts.window:
        valid &= kp >= qp - opts.window[0]
    logits = jnp.where(valid, logits, -jnp.inf)
    ref_lse = jax.nn.logsumexp(logits, axis=-1)
    ref = jnp.einsum("bhts,bshd->bthd", jnp.exp(logits - ref_lse[..., None]), vf, precision="highest")
    assert rel_err(out, ref) < 1e-2
    assert rel_err(lse, jnp.swapaxes(ref_lse, 1, 2)) < 1e-3


@hopper_only
def test_every_block_size_and_depth_on_hopper():
    """Each block size and stage count the config allows, compiled, on one small problem."""
    b, t, h, kvh, d, s = 1, 4, 8, 2, 128, 1024
    rng = np.random.default_rng(0)
    (k, v), = _cache(rng, b, s, kvh, d, d, "bfloat16")
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k_pos, k_len = np.arange(s, dtype=np.int32), np.array([1000], np.int32)
    q_pos = (k_len[:, None] - t + np.arange(t)).astype(np.int32)
    opts = AttentionOptions(causal=True, softmax_scale=d ** -0.5)
    ref = _reference(q, q_pos, [(k, v)], [k_pos], k_len, opts)
    for block_k in (64, 128, 256):
        for stages in (2, 3, 4):
            cfg = DecodeConfig(block_k=block_k, num_splits=7, num_stages=stages)
            if cfg.smem_bytes(64, d, d) > SMEM_LIMIT - 1024:
                continue
            got = partials(q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(k_len), opts, cfg)
            _check(got, ref, "bfloat16")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.num_splits = 5

"""The Pallas Mosaic GPU (Hopper) ring step against the float64 reference.

On an sm90+ GPU the kernels run compiled: the ring through the harness, and single ring steps
on every layout's positions. On CPU the same step kernels run eagerly in jax's GPU interpreter
(TMA copies, barriers, the producer/consumer walk, masks and softmax; block matmuls as
jnp.dot), and a lowering test checks that they lower to Mosaic GPU for CUDA.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.pallas_mosaic_gpu.implementation import IMPLEMENTATION, MosaicGpuConfig, interpreter_refusal
from ringjax.core.masks import Extras, StepOptions, TokenInfo
from ringjax.dispatch import registry
from ringjax.layouts import local_positions
from ringjax.options import AttentionOptions

from harness import ON_HOPPER, check_against_reference, make_inputs, need_devices, reference_for, rel_err, run_ring
from reference import document_offsets, dropout_keep_reference, mask_reference

_WHY_NOT = None if ON_HOPPER else interpreter_refusal()
needs_kernels = pytest.mark.skipif(_WHY_NOT is not None, reason=f"the Mosaic GPU kernels cannot run here: {_WHY_NOT}")
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90+ GPU (the ring under jit; on CPU only "
                                 "eager single steps run in the interpreter)")
# smallest blocks, so small shards still walk several blocks per step
SMALL = MosaicGpuConfig(block_kv=64, dq_block_kv=64, dkv_block_q=64, interpret=not ON_HOPPER)
WIDE = MosaicGpuConfig(block_kv=64, dq_block_kv=64, dkv_block_q=64, dkv_num_stages=2,  # fits head_dim 256
                       interpret=not ON_HOPPER)


def small_for(head_dim: int) -> MosaicGpuConfig:
    """SMALL where it fits shared memory (three dK/dV stages), else two stages."""
    return SMALL if head_dim <= 128 else WIDE


# --------------------------------------------------------------------------- one ring step


def _step_reference(q, k, v, do, mask, scale, cap, dist=None, slopes=None, keep=None, rate=0.0):
    """out, lse and (fed that lse) dq, dk, dv, dslopes of one step in float64; mask [B or 1, T, S];
    dist [T, S] = |i - j| with slopes [H] (ALiBi); keep [B, H, T, S] with rate (dropout)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, 2), np.repeat(v, g, 2)
    s = np.einsum("bthd,bshd->bhts", q, kr) * scale
    slope = scale
    if cap is not None:
        t = np.tanh(s / cap)
        s, slope = cap * t, scale * (1 - t * t)
    if slopes is not None:
        s = s - np.asarray(slopes, np.float64)[None, :, None, None] * dist
    s = np.where(mask[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    p = p / np.where(total > 0, total, 1.0)
    drop = 1.0 if keep is None else keep / (1.0 - rate)  # what P is multiplied by on its way to out
    out = np.einsum("bhts,bshd->bthd", p * drop, vr)
    total = total[..., 0]
    lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + m[..., 0], -np.inf)
    delta = np.einsum("bthd,bthd->bht", do, out)
    dlogits = p * (np.einsum("bthd,bshd->bhts", do, vr) * drop - delta[..., None])
    ds = dlogits * slope
    b, sk, kvh, d = k.shape
    dk = np.einsum("bhts,bthd->bshd", ds, q).reshape(b, sk, kvh, g, d).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p * drop, do).reshape(b, sk, kvh, g, v.shape[3]).sum(3)
    out = dict(out=out, lse=lse, delta=delta, dq=np.einsum("bhts,bshd->bthd", ds, kr), dk=dk, dv=dv)
    if slopes is not None:
        out["dslopes"] = -(dlogits * dist).sum(axis=(0, 2, 3))
    return out


def _modifiers(rng, alibi: bool, rate: float, batch: int, heads: int, total: int, qpos, kpos):
    """(the float64 reference's ALiBi and dropout arguments, the kernels' `Extras`) for queries at `qpos` and
    keys at `kpos` of a `total`-token sequence: random slopes, a fixed dropout seed."""
    mods, extras = {}, Extras()
    if alibi:
        slopes = rng.uniform(0.01, 0.3, heads).astype(np.float32)
        mods.update(dist=np.abs(qpos[:, None] - kpos[None, :]).astype(np.float64), slopes=slopes)
        extras = extras._replace(alibi_slopes=jnp.asarray(slopes))
    if rate:
        seed = np.array([12345, 678], np.uint32)
        mods.update(keep=dropout_keep_reference(seed, rate, batch, heads, total)[:, :, qpos][:, :, :, kpos], rate=rate)
        extras = extras._replace(dropout_seed=jnp.asarray(seed))
    return mods, extras


def _check_step(layout, n, shard, src, local, dtype, head_dim, heads, kv_heads, batch=1, segments=None,
                config=SMALL, alibi=False, dropout_rate=0.0, gather=False, subshards=1, v_head_dim=None,
                sink_step=False, final=False, backward=True, **kw):
    """The step kernels on the positions `layout` gives shard `shard` (queries) and `src` (keys);
    `gather`: keys are the whole sequence in natural order (the all-gather schedule); `v_head_dim`: v's and
    dO's head_dim (None: head_dim); `sink_step`: keys are the first 64 tokens, of which only the pairs the
    sink rule alone shows count (a shortened ring's sink step); `final`: the forward also writes its output
    in the inputs' dtype (what the ring asks where no merge follows), which must be the float32 output
    rounded, bit for bit; `backward=False` checks the forward alone."""
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_bwd, block_fwd, fuses_backward

    total = local * n
    kw.setdefault("softmax_scale", head_dim ** -0.5)
    rng = np.random.default_rng(shard * 7 + src)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    k_len = total if gather else 64 if sink_step else local
    q = cast(rng.standard_normal((batch, local, heads, head_dim)))
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    k, v = (cast(rng.standard_normal((batch, k_len, kv_heads, d))) for d in (head_dim, v_head_dim))
    do = cast(rng.standard_normal((batch, local, heads, v_head_dim)))
    qpos = local_positions(layout, shard, n, local, xp=np, subshards=subshards)
    kpos = np.arange(total) if gather else np.arange(k_len) if sink_step else local_positions(
        layout, src, n, local, xp=np, subshards=subshards)
    seg = None
    if segments is not None:
        seg = np.asarray(segments, np.int32)
    rule = functools.partial(mask_reference, total, causal=kw.get("causal", False), window=kw.get("window"),
                             segment_ids=seg, chunk_size=kw.get("chunk_size"))
    mask = rule(num_sink_tokens=kw.get("num_sink_tokens", 0))
    if sink_step:
        mask = mask & ~rule()
    mask = mask[:, qpos][:, :, kpos]
    opts = AttentionOptions(layout=layout, axis_size=n, has_segments=seg is not None, has_alibi=alibi,
                            dropout_rate=dropout_rate, gather_kv=gather, subshards=subshards, **kw)
    if sink_step:
        opts = StepOptions.sink_step(opts)
    mods, extras = _modifiers(rng, alibi, dropout_rate, batch, heads, total, qpos, kpos)
    ref = _step_reference(q, k, v, do, mask, opts.softmax_scale, opts.logits_soft_cap, **mods)
    # a token's offset in its document (what sink tokens read): without segments its position
    offsets = np.arange(total)[None] if seg is None else document_offsets(seg)
    segpos = (lambda pos: jnp.asarray(offsets[:, pos])) if opts.num_sink_tokens else (lambda pos: None)  # noqa: E731
    qi = TokenInfo(jnp.asarray(qpos), None if seg is None else jnp.asarray(seg[:, qpos]), segpos(qpos))
    ki = TokenInfo(jnp.asarray(kpos), None if seg is None else jnp.asarray(seg[:, kpos]), segpos(kpos))
    out, lse = block_fwd(q, k, v, qi, ki, extras, opts, config)
    assert out.dtype == jnp.float32
    if final:
        narrow, lse_narrow = block_fwd(q, k, v, qi, ki, extras, opts, config, out_dtype=q.dtype)
        assert narrow.dtype == q.dtype
        np.testing.assert_array_equal(np.asarray(lse_narrow), np.asarray(lse))
        np.testing.assert_array_equal(np.asarray(narrow.astype(jnp.float32)),
                                      np.asarray(out.astype(q.dtype).astype(jnp.float32)))
    got = dict(out=out, lse=lse)
    if backward:
        dq, dk, dv, dslopes = block_bwd(q, k, v, do, jnp.asarray(ref["lse"], jnp.float32),
                                        jnp.asarray(ref["delta"], jnp.float32), qi, ki, extras, opts, config)
        got.update(dq=dq, dk=dk, dv=dv, dslopes=dslopes)
        assert (dslopes is None) == (not alibi)
    if final and backward:
        narrow = block_bwd(q, k, v, do, jnp.asarray(ref["lse"], jnp.float32), jnp.asarray(ref["delta"], jnp.float32),
                           qi, ki, extras, opts, config, out_dtype=q.dtype)
        for name, wide, thin in zip(("dq", "dk", "dv", "dslopes"), (dq, dk, dv, dslopes), narrow):
            if wide is None:
                assert thin is None
                continue
            if name != "dslopes":  # the fused backward's are float32 (dQ summed by reduce-adds, dK/dV cast after)
                fused = fuses_backward(opts, config, head_dim, v_head_dim, q.dtype.itemsize)
                assert thin.dtype == (jnp.float32 if fused else q.dtype), (name, thin.dtype)
            np.testing.assert_array_equal(np.asarray(thin.astype(q.dtype).astype(jnp.float32)),
                                          np.asarray(wide.astype(q.dtype).astype(jnp.float32)), err_msg=name)
    assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref["lse"])), "fully masked rows differ"
    for name in ("out", "dq", "dk", "dv"):
        if name in got:
            assert np.isfinite(np.asarray(got[name])).all(), f"{name} is not finite"
    tol = {"bfloat16": 1e-2, "float16": 2e-3}[dtype]
    for name, limit in (("out", tol), ("lse", tol), ("dq", 2 * tol), ("dk", 2 * tol), ("dv", 2 * tol),
                        ("dslopes", 2 * tol)):
        if name in ref and name in got:
            err = rel_err(got[name], ref[name])
            assert err < limit, f"{name}: relative error {err:.2e} exceeds {limit:.0e}"


def _docs(batch, total):
    """Packed documents crossing block boundaries, with padding (-1) at the end of row 0."""
    seg = np.zeros((batch, total), np.int32)
    for b in range(batch):
        cuts = np.sort(np.random.default_rng(b).choice(np.arange(1, total), 4, replace=False))
        seg[b] = np.searchsorted(cuts, np.arange(total), side="right")
    seg[0, -37:] = -1
    return seg


def _with_docs(kw, total):
    """(step kwargs without "segments", batch, packed documents or None): segments=True asks for documents."""
    kw = dict(kw)
    batch = 2 if kw.get("segments") else 1
    return kw, batch, (_docs(batch, total) if kw.pop("segments", False) else None)


# (layout, ring size, query shard, key shard, local length, dtype, step kwargs); CPU runs these through
# the interpreter at head_dim 64, a GPU at 64 and 128
STEP_CASES = [
    ("contiguous", 2, 1, 0, 256, "bfloat16", dict(causal=True)),  # keys all in the past: fully visible
    ("contiguous", 2, 1, 1, 256, "float16", dict(causal=True, softmax_scale=0.2)),  # the diagonal step
    ("zigzag", 2, 0, 1, 256, "bfloat16", dict(causal=True)),  # half of the tiles see nothing
    ("striped", 4, 1, 3, 128, "float16", dict(causal=True, logits_soft_cap=2.0)),  # position stride 4
    ("contiguous", 2, 1, 0, 256, "float16", dict(window=(100, 0), causal=True)),  # window cuts the step
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, chunk_size=96)),
    ("contiguous", 1, 0, 0, 256, "bfloat16", dict(causal=True, segments=True)),
    ("contiguous", 2, 0, 1, 256, "float16", dict(window=(20, 30))),  # few keys visible, non-causal
    # score modifiers: ALiBi (with its slope gradient), dropout's hash, sink tokens beyond a window
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, alibi=True)),
    ("striped", 2, 0, 1, 128, "float16", dict(causal=True, alibi=True, logits_soft_cap=5.0)),
    ("contiguous", 1, 0, 0, 256, "float16", dict(causal=True, dropout_rate=0.25)),
    ("zigzag", 2, 0, 1, 256, "bfloat16", dict(causal=True, dropout_rate=0.1, alibi=True)),
    ("contiguous", 1, 0, 0, 256, "float16", dict(causal=True, window=(70, 0), num_sink_tokens=5)),
    ("striped", 2, 1, 0, 256, "bfloat16", dict(causal=True, window=(130, 0), num_sink_tokens=3)),
    # sink tokens the window hides leave the dK/dV kernel for a dense product: keys holding them (or not),
    # with every modifier, beside chunks, and the shortened ring's step of sink tokens alone
    ("contiguous", 2, 1, 0, 256, "float16", dict(causal=True, window=(60, 0), num_sink_tokens=4, alibi=True,
                                                 dropout_rate=0.2, logits_soft_cap=8.0)),
    ("contiguous", 2, 1, 1, 256, "bfloat16", dict(causal=True, window=(60, 0), num_sink_tokens=4)),
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, chunk_size=96, num_sink_tokens=2)),
    ("contiguous", 4, 2, 0, 256, "float16", dict(causal=True, window=(100, 0), num_sink_tokens=3, sink_step=True)),
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, gather=True, window=(90, 0), num_sink_tokens=3)),
    # sink tokens of packed documents: each document's first tokens, wherever it starts (the ids carry the flag)
    ("contiguous", 2, 1, 0, 256, "bfloat16", dict(causal=True, window=(60, 0), num_sink_tokens=3, segments=True)),
    ("contiguous", 1, 0, 0, 256, "float16", dict(causal=True, window=(40, 0), num_sink_tokens=4, segments=True)),
    ("zigzag", 2, 0, 1, 256, "bfloat16", dict(causal=True, window=(90, 0), num_sink_tokens=2, segments=True,
                                              dropout_rate=0.1)),
    # the all-gather schedule's natural key order, and Ulysses' interleaved subshards
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, gather=True)),
    ("striped", 2, 0, 0, 256, "float16", dict(causal=True, gather=True, window=(90, 0))),
    ("contiguous", 2, 1, 1, 256, "bfloat16", dict(causal=True, subshards=2)),
    ("zigzag", 2, 0, 0, 256, "float16", dict(causal=True, subshards=2, window=(150, 0))),
]


@pytest.mark.parametrize("block_diagonal", [None, False])
@pytest.mark.parametrize("kw", [dict(window=(60, 0), num_sink_tokens=4),
                                dict(window=(60, 0), num_sink_tokens=3, alibi=True, dropout_rate=0.2,
                                     logits_soft_cap=8.0)])
@pytest.mark.parametrize("head_dim, dtype", [(64, "bfloat16"), (256, "float16")])
def test_few_keys_grads_match_the_reference(kw, block_diagonal, head_dim, dtype):
    """The sink keys' dK/dV that the dK/dV kernel leaves out (`dense.few_keys_grads`), and the queries' dQ from
    them that the fused backward leaves out, against every query and only where the sink rule alone shows the
    pair: Q and dO read in their own layout through block-diagonal products (the default at 6 heads x 4 keys),
    and grouped by KV head (`block_diagonal=False`); in the two dtypes the Mosaic kernels take, at the smallest
    and largest head_dims. Needs no kernel: it is XLA's."""
    from ringjax.core.dense import few_keys_grads

    kw = dict(kw)
    total, sinks, heads, kv_heads = 256, kw["num_sink_tokens"], 6, 2
    alibi, rate = kw.pop("alibi", False), kw.get("dropout_rate", 0.0)
    rng = np.random.default_rng(5)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    q, do = (cast(rng.standard_normal((2, total, heads, head_dim))) for _ in range(2))
    k, v = (cast(rng.standard_normal((2, sinks, kv_heads, head_dim))) for _ in range(2))
    qpos, kpos = np.arange(total), np.arange(sinks)
    rule = functools.partial(mask_reference, total, causal=True, window=kw["window"])
    mask = (rule(num_sink_tokens=sinks) & ~rule())[:, qpos][:, :, kpos]
    opts = StepOptions.sink_step(AttentionOptions(causal=True, has_alibi=alibi, softmax_scale=0.2, **kw))
    mods, extras = _modifiers(rng, alibi, rate, 2, heads, total, qpos, kpos)
    ref = _step_reference(q, k, v, do, mask, opts.softmax_scale, opts.logits_soft_cap, **mods)
    qi, ki = TokenInfo(jnp.asarray(qpos), None, jnp.asarray(qpos)[None]), TokenInfo.first(sinks)
    dq, dk, dv = jax.jit(functools.partial(few_keys_grads, opts=opts, block_diagonal=block_diagonal, with_dq=True))(
        q, k, v, do, jnp.asarray(ref["lse"], jnp.float32), jnp.asarray(ref["delta"], jnp.float32), qi, ki, extras)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    assert dq.dtype == dk.dtype == dv.dtype == jnp.float32
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        err = rel_err(got, ref[name])
        assert err < 2e-2, f"{name}: relative error {err:.2e}"


@needs_kernels
@pytest.mark.parametrize("head_dim", [64] + ([128] if ON_HOPPER else []))
@pytest.mark.parametrize("layout, n, shard, src, local, dtype, kw", STEP_CASES)
def test_step_matches_reference(layout, n, shard, src, local, dtype, kw, head_dim):
    kw, batch, segments = _with_docs(kw, local * n)
    heads, kv_heads = (4, 2) if head_dim == 64 or src % 2 else (6, 3)  # 6/3: odd groups pair row tiles
    _check_step(layout, n, shard, src, local, dtype, head_dim, heads, kv_heads, batch=batch, segments=segments, **kw)


@needs_kernels
@pytest.mark.parametrize("head_dim, v_head_dim, persistent, dtype, kw", [
    (64, None, True, "bfloat16", dict(causal=True)),
    (64, None, False, "float16", dict(causal=True, window=(60, 0), num_sink_tokens=3)),  # dK/dV summed after
    (64, None, True, "bfloat16", dict(causal=True, alibi=True)),
    (128, 96, True, "bfloat16", dict(causal=True, segments=True)),  # 96 columns: 32-column bf16 chunks
    (256, None, True, "bfloat16", dict(causal=True, dropout_rate=0.1)),
    # the fused backward: its gradients float32 whatever is asked, its forward's output narrow
    (64, None, True, "bfloat16", dict(causal=True, fused=True)),
    (128, None, True, "float16", dict(window=(60, 20), segments=True, fused=True)),
    (64, None, True, "bfloat16", dict(causal=True, window=(60, 0), num_sink_tokens=3, fused=True)),
])
def test_final_results_are_written_in_the_input_dtype(head_dim, v_head_dim, persistent, dtype, kw):
    """Where no merge follows, the forward stores its output in the inputs' dtype (64 bf16 columns per
    128-byte chunk, 32 where the head_dim is no multiple of 64), and the backward its gradients: the float32
    results rounded, bit for bit (the fused backward's gradients stay float32)."""
    kw = dict(kw)
    config = FUSED if kw.pop("fused", False) else small_for(max(head_dim, v_head_dim or 0))
    kw, batch, segments = _with_docs(kw, 128)  # two row tiles and two key blocks: the writes are what is new
    config = dataclasses.replace(config, persistent=persistent)
    _check_step("contiguous", 1, 0, 0, 128, dtype, head_dim, 4, 2, batch=batch, segments=segments,
                v_head_dim=v_head_dim, config=config, final=True, **kw)


@needs_kernels
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kw", [dict(causal=True, segments=True), dict(causal=True, chunk_size=96),
                                dict(causal=True, window=(60, 0), num_sink_tokens=3)])
def test_forward_launches(kw, persistent):
    """The forward's two launches: a CTA per row tile, or (persistent) a CTA per SM walking rows sorted by
    their visits, here 3 CTAs over 8 or 16 uneven items (the interpreter's count). The forward alone: the
    backward's launches are the step cases'."""
    kw, batch, segments = _with_docs(kw, 512)
    _check_step("contiguous", 1, 0, 0, 512, "bfloat16", 64, 4, 2, batch=batch, segments=segments,
                config=dataclasses.replace(SMALL, persistent=persistent), backward=False, **kw)


def test_persistent_order_puts_the_heaviest_rows_first():
    from ringjax.backends.pallas_mosaic_gpu.kernels import _persistent_order, _walk_for
    from ringjax.core.visits import range_table

    opts = AttentionOptions(causal=True, chunk_size=128)
    pos = jnp.arange(512, dtype=jnp.int32)
    info = TokenInfo(pos, None, pos[None])
    walk = _walk_for(opts, 512, 512, 64, 2, 2, transpose=False)
    table = range_table(opts, info, info, 64, 64)
    order = np.asarray(_persistent_order([table], walk))
    steps = np.asarray(table[0, :, 3] - table[0, :, 0])  # blocks each 64-row tile visits
    tiles = walk.n_ctas - 1 - order  # causal launches reverse the rows (heaviest_last)
    assert sorted(order.tolist()) == list(range(walk.n_ctas))
    assert np.all(np.diff(steps[tiles]) <= 0) and steps[tiles[0]] > steps[tiles[-1]]
    # a fused ring pass: a row tile's work is its visits summed over the sources
    one, other = (jnp.zeros((1, walk.n_ctas, 4), jnp.int32).at[0, :, 3].set(jnp.asarray(x, jnp.int32))
                  for x in ([4, 0, 0, 0, 0, 0, 0, 3], [0, 0, 0, 0, 0, 0, 0, 3]))
    first = [walk.n_ctas - 1 - int(_persistent_order(t, walk)[0]) for t in ([one], [one, other])]
    assert first == [0, 7]


@pytest.mark.parametrize("ctas, skip", [(8, 0), (8, 3), (12, 4), (40, 16)])
def test_persistent_items_are_dealt_once(ctas, skip):
    """`_Persist` deals every (batch, head, row) of the grid to exactly one CTA; with `skip` (a fused ring
    pass's copy CTAs) the first `skip` CTAs give up their item of round 0, the heaviest."""
    from ringjax.backends.pallas_mosaic_gpu.kernels import _Persist

    grid = (3, 5, 2)  # heads, rows, batch
    persist = _Persist(ctas, grid, skip)
    order = jnp.asarray([4, 2, 0, 1, 3], jnp.int32)  # rows in visiting order
    most = -(-(30 + skip) // ctas)

    def cta(_):
        items = [jnp.stack(persist.at(jnp.int32(i), order)) for i in range(most)]
        return persist.count(), jnp.stack(items)

    counts, items = (np.asarray(x) for x in jax.vmap(cta, axis_name="h")(jnp.arange(ctas)))
    dealt = sorted(tuple(items[c, i]) for c in range(ctas) for i in range(counts[c]))
    assert dealt == sorted((b, h, r) for b in range(2) for h in range(3) for r in range(5))
    heaviest = {(b, h, 4) for b in range(2) for h in range(3)}  # row 4 is visited first
    firsts = [tuple(items[c, 0]) for c in range(ctas) if counts[c]]
    assert sum(x in heaviest for x in firsts) == min(6, ctas - skip)  # round 0 minus the copies' places
    assert not any(counts[c] and tuple(items[c, 0]) in heaviest for c in range(skip))


# the forward's half blocks (`MosaicGpuConfig.half_blocks`): 128-key blocks, whose causal diagonals and window,
# chunk and document edges leave half a block hidden from a 64-row tile
HALF = MosaicGpuConfig(block_kv=128, dq_block_kv=64, dkv_block_q=64, interpret=not ON_HOPPER)
HALF_CASES = [
    ("contiguous", 1, 0, 0, 256, "bfloat16", dict(causal=True)),
    ("contiguous", 1, 0, 0, 512, "float16", dict(causal=True, window=(100, 0), logits_soft_cap=4.0)),
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, chunk_size=96)),
    ("striped", 2, 1, 1, 256, "float16", dict(causal=True, alibi=True)),  # position stride 2
    ("contiguous", 1, 0, 0, 512, "bfloat16", dict(causal=True, window=(70, 0), num_sink_tokens=5,
                                                  dropout_rate=0.2)),
    ("contiguous", 1, 0, 0, 256, "float16", dict(causal=True, segments=True)),
    ("contiguous", 2, 0, 1, 256, "bfloat16", dict(window=(20, 100))),  # keys ahead, not causal
    # each document's sink tokens beside a window: the flags after a prefix table read with the ids
    ("contiguous", 1, 0, 0, 512, "float16", dict(causal=True, window=(60, 0), num_sink_tokens=3, segments=True)),
]


@needs_kernels
@pytest.mark.parametrize("layout, n, shard, src, local, dtype, kw", HALF_CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 3)])  # paired heads, and two row tiles per CTA
def test_step_half_blocks(layout, n, shard, src, local, dtype, kw, heads, kv_heads, monkeypatch):
    """The forward with half-wide scores on the blocks `visits.half_flags` marks, against the float64 reference;
    the case does mark some (else it would test nothing new)."""
    from ringjax.backends.pallas_mosaic_gpu import kernels

    flags_of, marked = kernels.half_flags, []

    def spy(*args):
        flags = flags_of(*args)
        marked.append(int(np.asarray(flags).sum()))
        return flags

    monkeypatch.setattr(kernels, "half_flags", spy)
    kw, batch, segments = _with_docs(kw, local * n)
    _check_step(layout, n, shard, src, local, dtype, 128 if ON_HOPPER else 64, heads, kv_heads, batch=batch,
                segments=segments, config=HALF, backward=False, **kw)
    assert sum(marked) > 0, "no half block in this case"


HEAD_DIM_CASES = [
    ("contiguous", 2, 1, 1, 256, "bfloat16", dict(causal=True)),
    ("zigzag", 2, 1, 0, 256, "float16", dict(causal=True, alibi=True, dropout_rate=0.2)),
    ("contiguous", 1, 0, 0, 128, "bfloat16", dict(causal=True, window=(90, 0), segments=True)),
]


@needs_kernels
@pytest.mark.parametrize("head_dim", [96, 192, 256])  # above 128 the backward splits the head_dim
@pytest.mark.parametrize("layout, n, shard, src, local, dtype, kw", HEAD_DIM_CASES)
def test_step_head_dims(layout, n, shard, src, local, dtype, kw, head_dim):
    kw, batch, segments = _with_docs(kw, local * n)
    _check_step(layout, n, shard, src, local, dtype, head_dim, 4, 2, batch=batch, segments=segments,
                config=small_for(head_dim), **kw)


# q/k and v head_dims apart (multi-head latent attention): split backward (192/128, 64/256), not split (128/64)
V_HEAD_DIM_CASES = [
    (192, 128, "contiguous", 2, 1, 1, 256, "bfloat16", dict(causal=True, alibi=True)),
    (128, 64, "zigzag", 2, 1, 0, 256, "float16", dict(causal=True, window=(90, 0), segments=True)),
    (64, 256, "striped", 2, 0, 1, 128, "bfloat16", dict(causal=True, dropout_rate=0.2, logits_soft_cap=5.0)),
]


@needs_kernels
@pytest.mark.parametrize("head_dim, v_head_dim, layout, n, shard, src, local, dtype, kw", V_HEAD_DIM_CASES)
def test_step_v_head_dims(head_dim, v_head_dim, layout, n, shard, src, local, dtype, kw):
    kw, batch, segments = _with_docs(kw, local * n)
    _check_step(layout, n, shard, src, local, dtype, head_dim, 4, 2, batch=batch, segments=segments,
                config=small_for(max(head_dim, v_head_dim)), v_head_dim=v_head_dim, **kw)


FUSED = dataclasses.replace(SMALL, bwd_fused=True, dkv_num_stages=2)  # its dS^T tiles take a stage's room
# the fused backward (dQ added into global memory from the dK/dV kernel): every mask walk and modifier it takes,
# ALiBi's slope gradient summed per key causal (separable offsets, with a soft cap) and not (distance tiles)
FUSED_CASES = [case for case in STEP_CASES if not case[-1].get("alibi")][::2] + [
    ("striped", 2, 0, 1, 128, "float16", dict(causal=True, alibi=True, logits_soft_cap=5.0)),
    ("zigzag", 2, 1, 0, 256, "bfloat16", dict(causal=True, alibi=True, dropout_rate=0.1)),  # two chunks a shard
    ("contiguous", 2, 0, 1, 256, "float16", dict(window=(20, 30), alibi=True)),
    ("zigzag", 2, 0, 1, 256, "bfloat16", dict(causal=True, dropout_rate=0.1, logits_soft_cap=3.0)),
    # the ring's sink step: the kernel walks the sink keys itself (the dense product takes them on other steps)
    ("contiguous", 4, 2, 0, 256, "float16", dict(causal=True, window=(100, 0), num_sink_tokens=3, sink_step=True)),
    ("contiguous", 1, 0, 0, 256, "bfloat16", dict(causal=True, segments=True, window=(90, 0))),
]


# head_dim 128's dQ is a visit late (both consumers' dS^T of the visit before; the first reads a visit of zeros, the
# last is computed after the walk): the interpreter checks that handshake on a skipping walk and a masked one
FUSED_128 = FUSED_CASES if ON_HOPPER else [FUSED_CASES[i] for i in (1, -1)]


@needs_kernels
@pytest.mark.parametrize("head_dim, layout, n, shard, src, local, dtype, kw, dq_first",
                         [(64, *c, False) for c in FUSED_CASES] + [(128, *c, False) for c in FUSED_128]
                         + [(d, *c, True) for d, c in [(64, FUSED_CASES[-1])] + [(128, c) for c in FUSED_128]])
def test_step_fused_backward(head_dim, layout, n, shard, src, local, dtype, kw, dq_first):
    """Also with dQ's product issued before dV's (`bwd_dq_first`): the same handshake in another order."""
    kw, batch, segments = _with_docs(kw, local * n)
    heads, kv_heads = (4, 2) if src % 2 else (6, 1)  # GQA groups of 2 and 6
    _check_step(layout, n, shard, src, local, dtype, head_dim, heads, kv_heads, batch=batch, segments=segments,
                config=dataclasses.replace(FUSED, bwd_dq_first=dq_first), **kw)


@needs_kernels
@pytest.mark.parametrize("config", [SMALL, FUSED], ids=["split", "fused"])
@pytest.mark.parametrize("local, kw", [(192, dict(causal=True)), (64, dict(window=(20, 30), alibi=True))])
def test_step_backward_with_an_odd_number_of_key_tiles(config, local, kw):
    """The dK/dV kernel's CTAs take two 64-key tiles: with 192 (or 64) keys the last CTA's second consumer has
    none. It walks the first's tile, adds nothing to dQ and stores nothing (nor, fused, the tile's ALiBi slope
    gradient); before, that tile had no CTA and its dK/dV were never written (found by
    `deterministic="invariant"`'s 64-token granules in the interpreter)."""
    for head_dim in (64, 128) if config.bwd_fused else (64,):
        _check_step("contiguous", 1, 0, 0, local, "bfloat16", head_dim, 4, 2, config=config, **kw)


@needs_kernels
@pytest.mark.parametrize("config", [SMALL, FUSED], ids=["split", "fused"])
def test_step_backward_tile_major(config):
    """The backward's CTAs started tile by tile across heads (`bwd_tile_major`): the same gradients."""
    layout, n, shard, src, local, dtype, kw = FUSED_CASES[-1]
    kw, batch, segments = _with_docs(kw, local * n)
    _check_step(layout, n, shard, src, local, dtype, 64, 4, 2, batch=batch, segments=segments,
                config=dataclasses.replace(config, bwd_tile_major=True), **kw)


@needs_kernels
@pytest.mark.parametrize("config", [SMALL, FUSED], ids=["split", "fused"])
@pytest.mark.parametrize("case", [FUSED_CASES[-1], FUSED_CASES[1], STEP_CASES[1]],
                         ids=["window_segments", "skipping", "diagonal"])
def test_step_backward_reverse(config, case):
    """The dK/dV kernel's query blocks walked last first (`bwd_reverse`): the same gradients, masked and skipped
    blocks included, at head_dim 128 (the fused kernel's dQ a visit late) and 64."""
    layout, n, shard, src, local, dtype, kw = case
    kw, batch, segments = _with_docs(kw, local * n)
    for head_dim in (64, 128) if config.bwd_fused else (64,):
        _check_step(layout, n, shard, src, local, dtype, head_dim, 4, 2, batch=batch, segments=segments,
                    config=dataclasses.replace(config, bwd_reverse=True), **kw)


@pytest.mark.parametrize("head_dim, seq, kw, fused, dq_first, tile_major, reverse", [
    (128, 8192, dict(causal=True), True, True, True, False),
    (128, 4096, dict(causal=True), False, False, True, False),
    (128, 16384, dict(causal=True), True, True, False, True),
    (128, 32768, dict(causal=True, has_segments=True), False, False, False, False),
    (128, 8192, dict(), True, False, False, False),
    (128, 2048, dict(), True, False, False, False),
    (128, 1024, dict(), False, False, False, False),
    (128, 1024, dict(logits_soft_cap=30.0), True, False, False, False),
    (128, 8192, dict(causal=True, dropout_rate=0.1), True, True, True, False),
    (128, 8192, dict(causal=True, window=(1024, 0)), False, False, False, False),
    (64, 8192, dict(causal=True), True, False, True, False),
    (64, 32768, dict(causal=True), True, False, False, False),
    (64, 32768, dict(causal=True, has_alibi=True), False, False, False, False),  # fused ALiBi: slower (0.7-0.8x)
    (128, 32768, dict(causal=True, has_alibi=True), False, False, False, True),
    (256, 8192, dict(causal=True), False, False, False, False),
    (256, 32768, dict(causal=True), False, False, False, True),
    (256, 32768, dict(), False, False, False, False),
])
def test_heuristic_backward_follows_length_and_head_dim(head_dim, seq, kw, fused, dq_first, tile_major, reverse):
    """The heuristic's backward (what `auto` runs without a tuned entry): causal shards up to 8K in tile-major
    order at head_dims up to 128, longer ones with the dK/dV kernel's query blocks last first above head_dim 64;
    at head_dim 128 the fused backward where the mask skips only causal blocks (dQ's product first if causal), but
    on causal shards below 8K, where the split kernels were as fast, and below 2K tokens."""
    config = IMPLEMENTATION.default_config(_problem(head_dim=head_dim, seq=seq, opts=AttentionOptions(**kw)))
    assert ((config.bwd_fused, config.bwd_dq_first, config.bwd_tile_major, config.bwd_reverse)
            == (fused, dq_first, tile_major, reverse))


def test_candidates_order_the_causal_backward_longest_first():
    causal = IMPLEMENTATION.candidate_configs(_problem(opts=AttentionOptions(causal=True)))
    major = [c for c in causal if c.bwd_tile_major]
    assert causal[0].bwd_tile_major and dataclasses.replace(causal[0], bwd_tile_major=False) in causal
    assert len(set(causal)) == len(causal) and any(c.bwd_fused for c in major)
    assert not any(c.bwd_tile_major for c in IMPLEMENTATION.candidate_configs(_problem(opts=AttentionOptions())))


@needs_kernels
@pytest.mark.parametrize("kw", [{}, dict(dropout_rate=0.1, logits_soft_cap=3.0)])
def test_step_with_the_heuristic_256_key_blocks(kw):
    """The heuristic's head_dim-64 config where every block is visible: 256-key forward blocks in two stages
    (two blocks per step, so the pipeline wraps) and the fused backward."""
    config = IMPLEMENTATION.default_config(_problem(head_dim=64, opts=AttentionOptions()))
    assert (config.block_kv, config.num_stages, config.bwd_fused) == (256, 2, True)
    _check_step("contiguous", 1, 0, 0, 512, "bfloat16", 64, 4, 2,
                config=dataclasses.replace(config, interpret=not ON_HOPPER), **kw)


@pytest.mark.parametrize("kw, head_dim, v_head_dim, config, fused", [
    (dict(causal=True), 128, 128, FUSED, True),
    (dict(dropout_rate=0.1, logits_soft_cap=3.0, window=(9, 0)), 64, 64, FUSED, True),
    (dict(causal=True), 128, 64, FUSED, True),
    (dict(causal=True), 128, 128, SMALL, False),  # not asked for
    (dict(causal=True, has_alibi=True), 128, 128, FUSED, True),  # each consumer sums its keys' slope gradient
    (dict(causal=True), 96, 96, FUSED, False),  # dQ leaves in an odd number of 32-column chunks
    (dict(causal=True), 256, 256, FUSED, False),  # split head_dim
    (dict(causal=True), 128, 128, dataclasses.replace(FUSED, dkv_block_q=128), False),
    (dict(causal=True), 128, 128, dataclasses.replace(FUSED, dkv_num_stages=3), False),  # no room for dS^T
    (dict(causal=True), 64, 64, dataclasses.replace(FUSED, dkv_num_stages=3), True),
])
def test_fused_backward_where_it_fits(kw, head_dim, v_head_dim, config, fused):
    from ringjax.backends.pallas_mosaic_gpu.kernels import fuses_backward

    assert fuses_backward(AttentionOptions(**kw), config, head_dim, v_head_dim) is fused


@pytest.mark.parametrize("kw, problem_kw, config, says", [
    (dict(causal=True), {}, SMALL, None),  # not asked for: nothing to say
    (dict(causal=True), {}, FUSED, "backward: one fused kernel (dQ added by TMA reduce-add)"),
    (dict(causal=True), {}, dataclasses.replace(FUSED, dkv_num_stages=3),
     "not the fused one asked for: its dS^T tiles do not fit beside dkv_num_stages=3 stages (232,448 bytes"),
    (dict(causal=True, deterministic=True), {}, FUSED, "not the fused one asked for: deterministic=True"),
    (dict(causal=True), dict(head_dim=256), FUSED, "not the fused one asked for: head_dim 256 / v_head_dim 256"),
    (dict(causal=True), {}, dataclasses.replace(FUSED, dkv_block_q=128), "dkv_block_q=128 (it takes 64)"),
    (dict(causal=True, axis_name="sp", axis_size=2), {}, dataclasses.replace(FUSED, fused=True),
     "bwd_fused: the fused ring's backward runs its own dQ and dK/dV kernels"),
])
def test_config_note_says_which_backward_runs(kw, problem_kw, config, says):
    """An asked-for fused backward that cannot run falls back to the two kernels; the report says so and why."""
    note = IMPLEMENTATION.config_note(_problem(opts=AttentionOptions(**kw), **problem_kw), config)
    assert (note == "") if says is None else (says in note), note
    if says is not None and "not the fused one" in says:
        from ringjax.backends.pallas_mosaic_gpu.kernels import fuses_backward

        p = _problem(opts=AttentionOptions(**kw), **problem_kw)
        assert not fuses_backward(p.opts, config, p.head_dim, p.v_head_dim)


@needs_kernels
def test_step_with_row_tile_pairing_under_gqa():
    """pair_heads=False: the two consumers take two row tiles of one head even when heads could pair."""
    config = dataclasses.replace(SMALL, pair_heads=False)
    _check_step("zigzag", 2, 1, 0, 256, "bfloat16", 64, 4, 2, config=config, causal=True)


# --------------------------------------------------------------------------- the ring (compiled only)

# a window that shortens the ring: the sink tokens take a step of their own (the fused ring refuses it)
SINK_STEP_CASE = (4, "contiguous", "bfloat16", dict(seq=1024, heads=4, kv_heads=2, head_dim=128, alibi=True),
                  dict(causal=True, sliding_window=100, num_sink_tokens=3))
RING_CASES = [
    (1, "contiguous", "bfloat16", dict(seq=512, heads=4, kv_heads=2, head_dim=128), dict()),
    (1, "contiguous", "float16", dict(seq=512, heads=6, kv_heads=2, head_dim=128), dict(causal=True)),
    (1, "contiguous", "bfloat16", dict(seq=256, heads=2, kv_heads=1, head_dim=64),
     dict(causal=True, sliding_window=70, logits_soft_cap=3.0)),
    (1, "contiguous", "float16", dict(seq=512, batch=2, heads=4, kv_heads=2, head_dim=128, segments="random",
                                      sinks=True), dict(causal=True)),
    (1, "zigzag", "bfloat16", dict(seq=1024, heads=8, kv_heads=2, head_dim=128), dict(causal=True, chunk_size=200)),
    (2, "zigzag", "bfloat16", dict(seq=512, heads=4, kv_heads=2, head_dim=128), dict(causal=True)),
    (2, "striped", "float16", dict(seq=512, heads=4, kv_heads=1, head_dim=64), dict(causal=True)),
    (4, "contiguous", "bfloat16", dict(seq=1024, heads=4, kv_heads=2, head_dim=128), dict(sliding_window=(90, 40))),
    # score modifiers through the whole op: ALiBi's slope gradient, dropout's mask, sinks beyond a window
    (1, "contiguous", "bfloat16", dict(seq=512, heads=4, kv_heads=2, head_dim=128, alibi=True), dict(causal=True)),
    (1, "zigzag", "float16", dict(seq=512, heads=4, kv_heads=1, head_dim=64, dropout_key=3),
     dict(causal=True, dropout_rate=0.2)),
    (1, "contiguous", "bfloat16", dict(seq=1024, heads=4, kv_heads=2, head_dim=128),
     dict(causal=True, sliding_window=200, num_sink_tokens=4)),
    (2, "zigzag", "bfloat16", dict(seq=1024, heads=4, kv_heads=2, head_dim=128, alibi=True, dropout_key=5),
     dict(causal=True, dropout_rate=0.1, logits_soft_cap=20.0)),
    (2, "contiguous", "float16", dict(seq=1024, heads=4, kv_heads=2, head_dim=64),
     dict(causal=True, sliding_window=100, num_sink_tokens=3)),
    SINK_STEP_CASE,
    # head_dims beyond 64 and 128 (above 128 the backward splits the head_dim between its consumers)
    (1, "contiguous", "bfloat16", dict(seq=512, heads=4, kv_heads=2, head_dim=256), dict(causal=True)),
    (2, "zigzag", "float16", dict(seq=512, heads=4, kv_heads=2, head_dim=192, alibi=True), dict(causal=True)),
    (2, "zigzag", "bfloat16", dict(seq=512, heads=4, kv_heads=1, head_dim=96, dropout_key=2),
     dict(causal=True, dropout_rate=0.1)),
    (1, "contiguous", "bfloat16", dict(seq=512, batch=2, heads=4, kv_heads=2, head_dim=256, segments="random"),
     dict(causal=True, sliding_window=150)),
    # per-document chunks (run as segments numbering (document, chunk) pairs)
    (2, "zigzag", "bfloat16", dict(seq=1024, batch=2, heads=4, kv_heads=2, head_dim=128, segments="random"),
     dict(causal=True, chunk_size=100)),
    (1, "contiguous", "float16", dict(seq=512, batch=2, heads=4, kv_heads=2, head_dim=64, segments="random"),
     dict(chunk_size=64)),
    # sink tokens of packed documents: every document's first tokens, from any shard
    (2, "zigzag", "bfloat16", dict(seq=1024, batch=2, heads=4, kv_heads=2, head_dim=128, segments="random"),
     dict(causal=True, sliding_window=100, num_sink_tokens=4)),
    (1, "contiguous", "float16", dict(seq=512, batch=2, heads=4, kv_heads=2, head_dim=256, segments="random"),
     dict(causal=True, sliding_window=60, num_sink_tokens=2)),
    # v with a head_dim of its own (multi-head latent attention): split backward, and not
    (2, "zigzag", "bfloat16", dict(seq=512, heads=4, kv_heads=2, head_dim=192, v_head_dim=128), dict(causal=True)),
    (1, "contiguous", "float16", dict(seq=512, batch=2, heads=4, kv_heads=1, head_dim=128, v_head_dim=64,
                                      segments="random", sinks=True), dict(causal=True, sliding_window=100)),
]


@hopper_only
@pytest.mark.parametrize("n, layout, dtype, xkw, kw", RING_CASES)
def test_ring_matches_reference(n, layout, dtype, xkw, kw):
    x = make_inputs(n * 5 + len(kw), dtype=dtype, **xkw)
    widest = max(xkw["head_dim"], xkw.get("v_head_dim") or 0)
    got = run_ring(x, n, layout=layout, implementation="pallas_mosaic_gpu", config=small_for(widest), **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


@hopper_only
@pytest.mark.parametrize("n, layout, dtype, xkw, kw", [c for c in RING_CASES if max(
    c[3]["head_dim"], c[3].get("v_head_dim") or 0) <= 128 and (c[4] or c[3].get("segments"))])
def test_ring_half_blocks_match_reference(n, layout, dtype, xkw, kw):
    """The whole op with 128-key forward blocks, whose masked edges run half-wide (`half_blocks`), as the
    heuristic config runs them."""
    x = make_inputs(n * 5 + len(kw), dtype=dtype, **xkw)
    got = run_ring(x, n, layout=layout, implementation="pallas_mosaic_gpu", config=HALF, **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


@hopper_only
@pytest.mark.parametrize("n, layout, dtype, xkw, kw", [c for c in RING_CASES if max(
    c[3]["head_dim"], c[3].get("v_head_dim") or 0) <= 128 and not c[3].get("alibi")])
def test_ring_fused_backward_matches_reference(n, layout, dtype, xkw, kw):
    x = make_inputs(n * 5 + len(kw), dtype=dtype, **xkw)
    got = run_ring(x, n, layout=layout, implementation="pallas_mosaic_gpu", config=FUSED, **kw)
    check_against_reference(got, reference_for(x, **kw), dtype)


def test_invariant_rows_at_once_where_nothing_sums_across_rows():
    """Rows at once wherever no gradient sums over a call's rows: not ALiBi's slopes, nor the dK/dV of sink tokens
    a window hides (`config.sinks_apart`: one dense product over every query of the call); sink tokens of
    documents, or without a window, stay in the kernels."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import KERNEL
    from ringjax.core import invariant
    from ringjax.options import INVARIANT

    def at_once(**kw):
        return invariant.rows_at_once(AttentionOptions(causal=True, deterministic=INVARIANT, **kw), KERNEL, SMALL)

    assert at_once(window=(90, 0)) and at_once(num_sink_tokens=4)
    assert at_once(window=(90, 0), num_sink_tokens=4, has_segments=True)
    assert not at_once(window=(90, 0), num_sink_tokens=4) and not at_once(chunk_size=128, num_sink_tokens=2)
    assert not at_once(window=(90, 0), has_alibi=True)


@needs_kernels
@pytest.mark.parametrize("sinks", [0, 3])
def test_invariant_rows_at_once_give_the_bits_of_granule_pairs(monkeypatch, sinks):
    """deterministic="invariant" with these kernels takes every local granule of one side per call against one
    granule of the other (`invariant.rows_at_once`: 2m calls per ring step, not m^2). Their rows do not depend on
    each other, so the partials, and after the fixed-point sums every output, have the bits of the pair calls;
    and they match the float64 reference. 128-token granules of 256 tokens, documents, a window, and the sink
    tokens of each document."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import KERNEL
    from ringjax.core import invariant
    from ringjax.core.ring import ring_attention_shard
    from ringjax.options import INVARIANT

    from reference import attention_reference

    monkeypatch.setattr(invariant, "FEWEST_GRANULES", 2)
    x = make_inputs(91, dtype="bfloat16", seq=256, batch=1, heads=4, kv_heads=2, head_dim=64)
    q, k, v, dout = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "dout"))
    ids = np.repeat([0, 1, 2], [100, 120, 36])[None]
    seg = jnp.asarray(ids, jnp.int32)
    opts = AttentionOptions(softmax_scale=0.125, causal=True, window=(90, 0), has_segments=True,
                            num_sink_tokens=sinks, deterministic=INVARIANT)

    def loss(q, k, v):
        out, lse = ring_attention_shard(opts, KERNEL, SMALL, q, k, v, seg, seg, None)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum() + (lse * x["dlse"]).sum(), (out, lse)

    def run():
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return [np.asarray(a.astype(jnp.float32), np.float64) for a in (out, lse, *grads)]

    assert invariant.rows_at_once(opts, KERNEL, SMALL)
    rows = run()
    monkeypatch.setattr(invariant, "rows_at_once", lambda *args: False)
    pairs = run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), rows, pairs):
        assert np.array_equal(a, b), name
    want = attention_reference(*(np.asarray(a.astype(jnp.float32)) for a in (q, k, v)), causal=True,
                               window=(90, 0), segment_ids=ids, softmax_scale=0.125, num_sink_tokens=sinks,
                               dout=np.asarray(dout.astype(jnp.float32)), dlse=x["dlse"])
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), rows):
        assert rel_err(got, want[name]) < 2e-2, name


@hopper_only
@pytest.mark.parametrize("dtype, xkw, kw", [
    ("bfloat16", dict(seq=8192, batch=1, heads=4, kv_heads=2, head_dim=128, segments="random"),
     dict(causal=True, sliding_window=700)),
    ("float16", dict(seq=8192, batch=1, heads=4, kv_heads=1, head_dim=64, sinks=True, dropout_key=3),
     dict(causal=True, dropout_rate=0.1)),
    # ALiBi's slope gradient sums over both sides in the kernel: one call per granule pair
    ("bfloat16", dict(seq=8192, batch=1, heads=4, kv_heads=2, head_dim=64, alibi=True), dict(causal=True)),
])
def test_invariant_matches_reference_and_is_the_same_on_every_ring(dtype, xkw, kw):
    """deterministic="invariant" runs the kernels on 128-token granules (8192 tokens): exact against the float64
    reference, and bitwise the same run to run and on every ring this machine has."""
    x = make_inputs(71, dtype=dtype, **xkw)
    kw = dict(kw, implementation="pallas_mosaic_gpu", deterministic="invariant")
    first = run_ring(x, 1, **kw)
    check_against_reference(first, reference_for(x, **{k: v for k, v in kw.items() if k not in (
        "implementation", "deterministic")}), dtype)
    again = [run_ring(x, 1, **kw)] + [run_ring(x, n, layout="zigzag", **kw) for n in (2, 4, 8)
                                      if n <= len(jax.devices())]
    for run in again:
        for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
            if name in first:
                assert np.array_equal(run[name], first[name]), name


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_gradients_are_bitwise_the_same_over_five_runs(head_dim):
    """deterministic=True on the GPU: five runs of one compiled fwd+bwd give the same bits (at head_dim 64 the
    heuristic's fused backward, dQ by TMA reduce-add, then runs split), on one GPU and on a ring of two."""
    x = make_inputs(81, dtype="bfloat16", seq=2048, batch=1, heads=8, kv_heads=2, head_dim=head_dim)
    for n in [n for n in (1, 2) if n <= len(jax.devices())]:
        runs = [run_ring(x, n, layout="zigzag" if n > 1 else "contiguous", implementation="pallas_mosaic_gpu",
                         deterministic=True, causal=True) for _ in range(5)]
        check_against_reference(runs[0], reference_for(x, causal=True), "bfloat16")
        for run in runs[1:]:
            for name in ("out", "lse", "dq", "dk", "dv"):
                assert np.array_equal(run[name], runs[0][name]), (n, name)


# the fused ring (`fused=True`, forward and backward): the ring axis spans every GPU; cases at several rings,
# whichever the machine has, plus masks that empty or shorten steps and packed documents across shards
FUSED_RING_CASES = [c for c in RING_CASES if c[0] > 1 and c is not SINK_STEP_CASE] + [
    (2, "contiguous", "bfloat16", dict(seq=1024, batch=2, heads=4, kv_heads=2, head_dim=128, segments="random"),
     dict(causal=True)),
    (2, "contiguous", "bfloat16", dict(seq=1024, heads=8, kv_heads=2, head_dim=64), dict(sliding_window=(100, 0))),
    (4, "zigzag", "bfloat16", dict(seq=1024, heads=4, kv_heads=2, head_dim=128), dict(causal=True)),
    (8, "zigzag", "bfloat16", dict(seq=2048, heads=4, kv_heads=2, head_dim=128, segments="random"), dict(causal=True)),
]


@hopper_only
@pytest.mark.parametrize("n, layout, dtype, xkw, kw", FUSED_RING_CASES)
def test_fused_ring_matches_reference(n, layout, dtype, xkw, kw):
    if n != jax.device_count():
        pytest.skip(f"the fused ring spans every device: case of {n}, {jax.device_count()} here")
    x = make_inputs(n * 7 + len(kw), dtype=dtype, **xkw)
    cfg = dataclasses.replace(small_for(max(xkw["head_dim"], xkw.get("v_head_dim") or 0)), fused=True)
    for mode in ("shard_map", "global"):
        got = run_ring(x, n, layout=layout, mode=mode, implementation="pallas_mosaic_gpu", config=cfg, **kw)
        check_against_reference(got, reference_for(x, **kw), dtype)


@hopper_only
@pytest.mark.parametrize("n, layout, dtype, xkw, kw", [FUSED_RING_CASES[i] for i in (0, -4, -3)])
def test_all_gather_by_the_fused_kernel_matches_reference(n, layout, dtype, xkw, kw, caplog):
    """strategy="all_gather" with no config named: the heuristic config gathers K/V inside the fused ring's
    kernel (`Problem.as_ring`), and the log says so; out, lse and gradients against the float64
    reference, packed documents across shards and a window among the cases."""
    if n != jax.device_count():
        pytest.skip(f"the fused ring spans every device: case of {n}, {jax.device_count()} here")
    x = make_inputs(n * 13 + len(kw), dtype=dtype, **xkw)
    with caplog.at_level(logging.INFO, logger="ringjax.implementation"):
        got = run_ring(x, n, layout=layout, implementation="pallas_mosaic_gpu", strategy="all_gather", **kw)
    assert any("all_gather" in m and '"fused": true' in m for m in caplog.messages), caplog.messages
    check_against_reference(got, reference_for(x, **kw), dtype)


@hopper_only
@pytest.mark.parametrize("how", ["mesh_arg", "set_mesh", "heuristic"])
def test_fused_ring_on_a_user_mesh(how, caplog):
    """The fused ring on global arrays over `jax.sharding.Mesh(devices, names)` (Auto axes, as MaxText-style
    code builds it), passed as `mesh=` or set with `jax.set_mesh`: out and lse against the float64 reference.
    "heuristic": no config named, the heuristic config (what `auto` runs untuned) is the fused ring and the log
    says so. (At these sizes the cost model picks the Triton kernels for implementation="auto".)"""
    n = jax.device_count()
    if n < 2:
        pytest.skip("the fused ring needs 2 GPUs or more")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
    # a shape of its own: the explicit cases' compiled call (the same config) would be reused, unlogged
    x = make_inputs(n * 11, seq=(1024 if how == "heuristic" else 512) * n, heads=8, kv_heads=2, head_dim=128,
                    dtype="bfloat16")
    put = lambda a: jax.device_put(ringjax.to_layout(jnp.asarray(a, jnp.bfloat16), "zigzag", n),  # noqa: E731
                                   jax.NamedSharding(mesh, P(None, "sp")))
    q, k, v = (put(x[name]) for name in ("q", "k", "v"))
    kw = dict(causal=True, layout="zigzag", return_lse=True, implementation="pallas_mosaic_gpu",
              config=MosaicGpuConfig(fused=True))
    if how == "heuristic":
        with caplog.at_level(logging.INFO, logger="ringjax.implementation"):
            out, lse = ringjax.ring_attention(q, k, v, mesh=mesh, causal=True, layout="zigzag", return_lse=True,
                                              strategy="ring", implementation="pallas_mosaic_gpu")
        assert any(m.startswith("ring_attention/pallas_mosaic_gpu: heuristic") and '"fused": true' in m
                   for m in caplog.messages), caplog.messages
    elif how == "mesh_arg":
        out, lse = ringjax.ring_attention(q, k, v, mesh=mesh, **kw)
    else:
        with jax.set_mesh(mesh):
            out, lse = ringjax.ring_attention(q, k, v, **kw)
    got = {"out": np.asarray(ringjax.from_layout(out, "zigzag", n).astype(jnp.float32)),
           "lse": np.asarray(ringjax.from_layout(lse, "zigzag", n, axis=2))}
    check_against_reference(got, reference_for(x, causal=True), "bfloat16", names=("out", "lse"))


_BROKEN_HANDSHAKE = """
import functools, sys
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from ringjax.backends.pallas_mosaic_gpu import implementation as impl
from ringjax.backends.pallas_mosaic_gpu.config import MosaicGpuConfig
from ringjax.core.ring import ring_attention_shard
from ringjax.options import AttentionOptions
n, broken = jax.device_count(), sys.argv[1]
mesh = jax.make_mesh((n,), ("sp",))
opts = AttentionOptions(softmax_scale=0.1, causal=True, axis_name="sp", axis_size=n, layout="zigzag")
kernel = impl.dataclasses.replace(impl.FUSED_KERNEL, **{
    f"ring_{broken}": functools.partial(getattr(impl, f"_ring_{broken}"), signal=False)})
out = lambda q, k, v: ring_attention_shard(opts, kernel, MosaicGpuConfig(fused=True), q, k, v, None, None, None)[0]
run = out if broken == "fwd" else jax.grad(lambda q, k, v: out(q, k, v).astype(jnp.float32).sum())
f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))
x = jax.device_put(jax.random.normal(jax.random.key(0), (1, n * 1024, 4, 128), jnp.bfloat16),
                   jax.NamedSharding(mesh, P(None, "sp")))
jax.block_until_ready(f(x, x[:, :, :2], x[:, :, 2:]))
print("FINISHED")
"""


@hopper_only
@pytest.mark.parametrize("broken", ["fwd", "bwd"])
def test_fused_ring_broken_handshake_hangs_and_is_stopped(broken):
    """Copies never announced (no semaphore signal), of K/V in the forward, of K/V and the dK/dV partials in the
    backward: the kernel must wait for them, not read early; the hang is stopped by a timeout (the GPU context
    goes with the process)."""
    import os
    import subprocess
    import sys

    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    # this process may hold most of the GPUs' memory (jax preallocates 75%): the child takes only what it uses
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        done = subprocess.run([sys.executable, "-c", _BROKEN_HANDSHAKE, broken], env=env, capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return  # it waited, as it must
    pytest.fail(f"the fused ring ran without its copies being announced (rc {done.returncode}):\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
@pytest.mark.parametrize("n, segments, persistent", [(2, False, True), (4, True, True), (2, False, False)])
def test_fused_ring_lowers_to_one_kernel_for_cuda(n, segments, persistent):
    """The fused forward ring is one Mosaic GPU kernel (persistent, or a CTA per row tile) and no collective
    (segment ids: one all-gather); its gradient adds one dK/dV kernel and one dQ kernel over every source,
    and no collective either; dQ comes in bf16."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import FUSED_KERNEL, _jax_refusal
    from ringjax.core.ring import ring_attention_shard

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    if n > jax.device_count():
        pytest.skip(f"needs {n} devices")
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    opts = AttentionOptions(softmax_scale=0.1, causal=True, axis_name="sp", axis_size=n, layout="zigzag",
                            has_segments=segments)
    cfg = MosaicGpuConfig(fused=True, persistent=persistent)

    def attn(q, k, v, seg):
        seg = seg if segments else None
        return ring_attention_shard(opts, FUSED_KERNEL, cfg, q, k, v, seg, seg, None)

    def grads(q, k, v, seg):
        return jax.grad(lambda *x: attn(*x, seg)[0].astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    spec = P(None, "sp")
    sharding = jax.NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct((1, n * 512, h, 128), jnp.bfloat16, sharding=sharding) for h in (4, 2, 2)]
    args.append(jax.ShapeDtypeStruct((1, n * 512), jnp.int32, sharding=sharding))

    def lowered(f, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=out_specs)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()

    fwd = lowered(attn, (spec, P(None, None, "sp")))
    assert fwd.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert fwd.count("collective_permute") == 0
    assert fwd.count("all_gather") == (2 if segments else 0)  # segment ids and their offsets, once
    bwd = lowered(grads, spec)
    assert bwd.count("stablehlo.custom_call @mosaic_gpu") == 3  # forward, dK/dV, dQ
    # dQ sums every source in the kernel: final, it comes in the inputs' dtype (no float32 store and cast)
    kernels = [line for line in bwd.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    assert [line.endswith("-> tensor<1x512x4x128xbf16>") for line in kernels] == [False, False, True]
    assert bwd.count("collective_permute") == 0
    assert bwd.count("all_gather") == (4 if segments else 0)  # the forward's and the backward's
    for name in ("ringjax_fwd_ring", "ringjax_dkv_ring", "ringjax_dq_ring"):  # what profiles show
        assert f"{name}_mosaic_gpu" in bwd


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
def test_fused_ring_backward_above_head_dim_128_is_the_step_ring():
    """Head_dims the fused backward cannot take (its copies stage through unsplit query slots) keep the fused
    forward and run the ring of step kernels backward."""
    from ringjax.backends.pallas_mosaic_gpu.config import supports_fused_bwd
    from ringjax.backends.pallas_mosaic_gpu.implementation import FUSED_FWD_KERNEL, FUSED_KERNEL

    assert supports_fused_bwd(128, 128) and supports_fused_bwd(64, 64)
    assert not supports_fused_bwd(256, 256) and not supports_fused_bwd(192, 128)
    assert FUSED_KERNEL.ring_bwd is not None and FUSED_FWD_KERNEL.ring_bwd is None
    assert FUSED_FWD_KERNEL.ring_fwd is FUSED_KERNEL.ring_fwd


@pytest.mark.parametrize("n, offset, steps", [(2, 0, 2), (4, 0, 4), (8, 0, 8), (8, 2, 4)])
def test_fused_ring_bookkeeping_matches_the_ring_plan(n, offset, steps):
    """Where the fused kernels send what (`kernels._Ring`): sub-step j visits the K/V of the ring plan's source
    for step j, so its dK/dV partials go to that device; every device receives one partial per receive slot,
    and its own K/V go to exactly the devices whose sub-steps visit them."""
    from ringjax.backends.pallas_mosaic_gpu.kernels import _Ring
    from ringjax.core.schedule import RingPlan

    need_devices(n)
    plan, ring = RingPlan(offset=offset, num_steps=steps), _Ring("sp", n, steps, offset, 1, 1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("sp",))
    sources = jax.jit(jax.shard_map(lambda x: jnp.stack([ring.source(j) for j in range(steps)])[None] + x,
                                    mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))(jnp.zeros((n, 1), jnp.int32))
    sources = np.asarray(sources)  # [device, sub-step]
    assert (sources == [[plan.source(m, j, n) for j in range(steps)] for m in range(n)]).all()
    received = {}  # (owner, slot) -> senders of dK/dV partials
    for m in range(n):
        for j, slot in ring.sends():
            received.setdefault((int(sources[m, j]), slot), []).append(m)
    assert sorted(received) == [(o, s) for o in range(n) for s in range(steps - 1)]
    assert all(len(senders) == 1 for senders in received.values())
    # K/V: device m sends its own to m - local + j at sub-step j, the device whose sub-step j visits m
    for m in range(n):
        for j, _ in ring.sends():
            assert sources[(m - offset + j) % n, j] == m


def test_fused_config_picks_the_kernels(monkeypatch):
    """fused=True runs the fused forward and backward on a ring, the fused forward with the step-ring backward
    above head_dim 128, and the plain step kernels without a ring (one device); the all-gather strategy's call
    (gather_kv) runs the fused ring, the gather inside its kernel, and the gather's step kernel without fused."""
    from ringjax.backends.pallas_mosaic_gpu import implementation as impl

    ran = []
    monkeypatch.setattr(impl, "_refusal", lambda problem, config=None: None)
    monkeypatch.setattr(impl, "ring_attention_shard", lambda opts, kernel, *args: ran.append((kernel.name,
                                                                                               opts.gather_kv)))
    for n, head_dim, gather, fused in ((2, 128, False, True), (2, 256, False, True), (1, 128, False, True),
                                       (4, 128, True, True), (4, 128, True, False)):
        opts = AttentionOptions(axis_name="sp" if n > 1 else None, axis_size=n, causal=True, gather_kv=gather)
        problem = registry.Problem(opts=opts, batch=1, seq=1024, heads=4, kv_heads=2, head_dim=head_dim,
                                   dtype="bfloat16", platform="gpu")
        impl.IMPLEMENTATION.run(problem, MosaicGpuConfig(fused=fused), *[None] * 7)
    assert ran == [("pallas_mosaic_gpu_fused", False), ("pallas_mosaic_gpu_fused_fwd", False),
                   ("pallas_mosaic_gpu", False), ("pallas_mosaic_gpu_fused", False), ("pallas_mosaic_gpu", True)]


def test_fused_ring_refusals():
    """fused=True refuses what its kernel cannot do, naming why; without a ring it is the plain step."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import _fused_refusal

    def problem(n, **kw):
        return registry.Problem(opts=AttentionOptions(axis_name="sp", axis_size=n, **kw), batch=1, seq=1024, heads=4,
                                kv_heads=2, head_dim=128, dtype="bfloat16", platform="gpu")

    assert _fused_refusal(problem(1)) is None
    why = _fused_refusal(problem(4, layout="contiguous", window=(100, 0), num_sink_tokens=4))
    assert why and "sink tokens" in why
    if jax.device_count() != 3:
        why = _fused_refusal(problem(3, causal=True))
        assert why and ("every device" in why or "remote_ref" in why)


def test_heuristic_fuses_the_ring_where_it_fits(monkeypatch):
    """The heuristic config (what `auto` runs without a tuned entry) is the fused ring on a ring the fused kernels
    take whose receive slots fit an eighth of the GPU's memory; the step ring elsewhere. Tuning keeps its pick."""
    from ringjax.backends.pallas_mosaic_gpu import implementation as impl

    def problem(n=2, seq=8192, platform="gpu", **kw):
        return registry.Problem(opts=AttentionOptions(axis_name="sp" if n > 1 else None, axis_size=n, causal=True,
                                                      **kw), batch=1, seq=seq, heads=32, kv_heads=8, head_dim=128,
                                dtype="bfloat16", platform=platform)

    for name in ("_fused_refusal", "_device_refusal"):
        monkeypatch.setattr(impl, name, lambda *args: None)
    monkeypatch.setattr(impl, "_jax_refusal", lambda: None)
    monkeypatch.setattr(impl, "_gpu_memory_bytes", lambda: 60e9)  # XLA's share of an 80 GB H100
    # per other source: 8192 tokens x 8 KV heads x (128 + 128) x (2 bytes + 4 for the float32 partials)
    assert impl.fused_ring_bytes(problem(4)) == 3 * 8192 * 8 * 256 * 6
    assert impl.default_config(problem()).fused
    assert all(c.fused for c in impl.IMPLEMENTATION.candidate_configs(problem()))
    assert impl.default_config(problem(4, layout="contiguous", window=(1000, 0))).fused  # a shortened ring
    # 512K tokens per GPU on 8 GPUs: 7 x 6 GiB of slots, over 7.5 GB
    assert not impl.default_config(problem(8, seq=2**19)).fused
    assert impl.default_config(problem(2, seq=2**19)).fused  # 6 GiB: 1M tokens on 2 GPUs
    assert not impl.default_config(problem(1)).fused  # no ring
    assert not impl.default_config(problem(platform="cpu")).fused
    # the all-gather strategy: the fused ring's kernel does the gather, whatever its slots take (the gather's)
    assert impl.default_config(problem(gather_kv=True)).fused and impl.default_config(problem(8, seq=2**19,
                                                                                          gather_kv=True)).fused
    assert not impl.default_config(problem(gather_kv=True, platform="cpu")).fused
    assert not any(c.fused for c in impl.IMPLEMENTATION.candidate_configs(problem(1)))
    monkeypatch.setattr(impl, "_gpu_memory_bytes", lambda: None)  # the allocator does not say
    assert not impl.default_config(problem()).fused
    monkeypatch.setattr(impl, "_gpu_memory_bytes", lambda: 60e9)
    monkeypatch.setattr(impl, "_fused_refusal", lambda *args: "one process per GPU")
    assert not impl.default_config(problem()).fused


def test_a_described_gpu_is_judged_as_one_process_holding_its_gpus():
    """For a GPU this host lacks (`explain --device-kind`), the heuristic judges the fused ring for one process
    holding all of the ring's GPUs, with the device kind's memory (the calibration's HBM, XLA's 75%), whatever
    this host's jax and devices: what that host's `auto` would run (2 H200, 2026-11-28: the fused ring, as
    explain now says; it priced the step ring and named Ulysses before)."""
    from ringjax.backends.pallas_mosaic_gpu import implementation as impl

    def problem(n=2, seq=8192, kind="NVIDIA H200", **kw):
        return registry.Problem(opts=AttentionOptions(axis_name="sp" if n > 1 else None, axis_size=n, causal=True,
                                                      **kw), batch=1, seq=seq, heads=32, kv_heads=8, head_dim=128,
                                dtype="bfloat16", platform="gpu", device_kind=kind)

    assert registry.described(problem())
    assert impl.default_config(problem()).fused and impl.default_config(problem(8)).fused
    # 512K tokens per GPU on 8 H200: 7 x 6 GiB of slots, over an eighth of 75% of 141 GB
    assert not impl.default_config(problem(8, seq=2**19)).fused
    assert impl.default_config(problem(8, seq=2**19, gather_kv=True)).fused  # the gather holds as much
    assert not impl.default_config(problem(4, layout="contiguous", window=(100, 0), num_sink_tokens=4)).fused
    assert not impl.default_config(problem(1)).fused


@hopper_only
def test_default_config_matches_reference():
    x = make_inputs(3, batch=1, seq=2048, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16")
    got = run_ring(x, 1, implementation="pallas_mosaic_gpu", causal=True)
    check_against_reference(got, reference_for(x, causal=True), "bfloat16")


@hopper_only
def test_auto_picks_it_on_hopper():
    # a training-sized call, where the calibrations measure it well ahead (H100 and H200: 1.5-2x Triton at 8K);
    # at a few hundred tokens every implementation is launch-bound (0.05-0.15 ms on one H100, 2026-12-05)
    problem = registry.Problem(opts=AttentionOptions(causal=True), batch=1, seq=8192, heads=32, kv_heads=8,
                               head_dim=128, dtype="bfloat16", platform="gpu")
    assert registry.choose("ring_attention", "auto", problem)[0].name == "pallas_mosaic_gpu"
    x = make_inputs(4, batch=1, seq=256, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16")
    q = jnp.asarray(x["q"], jnp.bfloat16)
    assert ringjax.ring_attention(q, q[:, :, :2], q[:, :, :2], axis_name=None, causal=True).shape == q.shape


def _problem(**kw):
    base = dict(opts=AttentionOptions(causal=True), batch=1, seq=1024, heads=8, kv_heads=2, head_dim=128,
                dtype="bfloat16", platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    base.update(kw)
    return registry.Problem(**base)


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="float32"), "dtype float32 is not supported"),
    (dict(head_dim=512), "head_dim 512 is not supported: needs 64, 96, 128, 192 or 256"),
    (dict(head_dim=80), "head_dim 80 is not supported"),
    (dict(v_head_dim=80), "v head_dim 80 is not supported"),
    (dict(head_dim=192, v_head_dim=96), "above 128 the backward splits both in halves"),
    (dict(opts=AttentionOptions(num_sink_tokens=2, has_segments=True, chunk_size=128)),
     "sink tokens of packed documents with per-document chunks"),
    (dict(seq=192, opts=AttentionOptions(layout="contiguous", subshards=2)),
     "each of the 2 runs of a device's tokens is 96"),
    (dict(seq=96), "per-device sequence is 96: must be a multiple of 64"),
    (dict(seq=192, opts=AttentionOptions(layout="zigzag", axis_size=2)), "half the per-device sequence"),
    (dict(seq=192, heads=3, kv_heads=1), "must be a multiple of 128 when the two consumers"),
])
def test_refusals_name_the_reason(kw, match):
    why = IMPLEMENTATION.supports(_problem(**kw))
    assert why is not None and match in why, why


def test_refuses_a_config_over_the_shared_memory_budget():
    from ringjax.backends.pallas_mosaic_gpu.implementation import _refusal

    big = MosaicGpuConfig(block_kv=256, num_stages=4)
    assert "bytes of shared memory in its forward kernel" in _refusal(_problem(), big)


@pytest.mark.skipif(ON_HOPPER, reason="checks the refusal where no Hopper GPU is present")
def test_refuses_without_a_hopper_gpu():
    why = IMPLEMENTATION.supports(_problem())
    assert why is not None and ("no gpu device" in why or "compute capability" in why or "jax >=" in why), why


def test_registered_lazily_above_pallas_triton():
    import subprocess
    import sys

    regs = {r.name: r for r in registry.registrations("ring_attention")}
    assert regs["pallas_mosaic_gpu"].platforms == ("gpu",)
    assert regs["pallas_mosaic_gpu"].priority > regs["pallas_triton"].priority
    code = "import sys, ringjax; sys.exit('ringjax.backends.pallas_mosaic_gpu.implementation' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "importing ringjax imported the backend"
    # on CPU "auto" never picks it: the platform check comes first
    assert registry.choose("ring_attention", "auto", _problem(platform="cpu"))[0].name == "xla"


def test_auto_falls_back_to_triton_where_it_refuses():
    if not ON_HOPPER:
        pytest.skip("without a Hopper GPU pallas_mosaic_gpu refuses every gpu problem for want of a device")
    assert registry.choose("ring_attention", "auto", _problem())[0].name == "pallas_mosaic_gpu"
    # float32: auto takes the faster predicted of the two that run it (XLA on Hopper; 18 vs 1 TFLOP/s measured)
    assert registry.choose("ring_attention", "auto", _problem(dtype="float32"))[0].name in ("pallas_triton", "xla")


def test_explicit_request_explains_refusal():
    q = jnp.ones((1, 64, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu"):
        ringjax.ring_attention(q, q, q, axis_name=None, implementation="pallas_mosaic_gpu")


@pytest.mark.parametrize("bad", [dict(block_kv=96), dict(dq_block_kv=32), dict(dkv_block_q=True),
                                 dict(num_stages=1), dict(dkv_num_stages=7), dict(interpret=1)])
def test_config_validation(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        MosaicGpuConfig(**bad)


def test_config_json_round_trip():
    cfg = MosaicGpuConfig(block_kv=64, num_stages=3)
    assert MosaicGpuConfig.from_json(cfg.to_json()) == cfg
    assert registry.config_from_json(MosaicGpuConfig, registry.config_to_json(cfg)) == cfg


def test_candidates_fit_shared_memory():
    from ringjax.backends.pallas_mosaic_gpu.config import SMEM_LIMIT

    cands = IMPLEMENTATION.candidate_configs(_problem())
    assert cands and IMPLEMENTATION.default_config(_problem()) in cands
    for cfg in cands:
        assert max(cfg.smem_bytes(128).values()) <= SMEM_LIMIT
    for d in (96, 192, 256):  # the big head_dims keep candidates within the budget, the default among them
        problem = _problem(head_dim=d)
        cands = IMPLEMENTATION.candidate_configs(problem)
        assert IMPLEMENTATION.default_config(problem) in cands
        assert all(max(cfg.smem_bytes(d).values()) <= SMEM_LIMIT for cfg in cands)


@pytest.mark.parametrize("causal", [True, False])
def test_candidates_are_the_heuristics_neighbours(causal):
    """The tuner times the heuristic's config and its one-choice neighbours (a shape on the GPU tunes in minutes):
    each other candidate changes one choice of it (the forward's blocks, row pairing, the backward and its
    stages, or, causal, an order of the backward's CTAs, for either backward)."""
    problem = _problem(seq=32768, heads=32, kv_heads=8, opts=AttentionOptions(causal=causal))
    base, *rest = IMPLEMENTATION.candidate_configs(problem)
    assert base == IMPLEMENTATION.default_config(problem) and len(rest) == len(set(rest)) and base not in rest
    assert len(rest) <= 10
    groups = [{"block_kv", "num_stages"}, {"pair_heads"},
              {"bwd_fused", "bwd_dq_first", "dq_block_kv", "dkv_num_stages"}, {"bwd_tile_major"}, {"bwd_reverse"}]
    for cfg in rest:
        changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)}
        orders = changed & {"bwd_tile_major", "bwd_reverse"}
        assert any(changed - orders <= g for g in groups) and len(orders) <= 1, changed
        assert causal or not orders
    assert {c.bwd_fused for c in rest} == {True, False}  # both backwards, the split one in its stages


@pytest.mark.parametrize("head_dim, kw, block_kv, persistent", [
    (64, dict(causal=True), 128, True),
    (64, {}, 256, True),  # every block visited: 256 keys, 1.00-1.01x cuDNN forward (1 H200, 2026-11-29)
    (64, dict(has_segments=True), 128, True),  # blocks between documents are skipped: narrower ones skip more
    (64, dict(window=(512, 512)), 128, True),
    (128, {}, 128, True),
    (256, dict(causal=True), 64, True),
    (256, {}, 64, False),  # a CTA per row tile: 8K 4% faster forward
    ((192, 128), dict(chunk_size=1024), 64, True),
])
def test_heuristic_config_follows_the_mask(head_dim, kw, block_kv, persistent):
    d, dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    problem = _problem(head_dim=d, v_head_dim=dv, opts=AttentionOptions(**kw))
    config = IMPLEMENTATION.default_config(problem)
    assert (config.block_kv, config.persistent) == (block_kv, persistent)
    assert config == IMPLEMENTATION.candidate_configs(problem)[0]  # tuning starts from it


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
@pytest.mark.parametrize("d, dv, kw, kernel, segments, fits", [
    # the compiler counts 232,536 bytes (229,888 were counted before the reduction scratch and the alignment)
    (192, 128, dict(block_kv=128, num_stages=2), "forward", False, False),
    (192, 128, dict(block_kv=64, num_stages=4), "forward", False, False),
    (192, 192, dict(block_kv=64, num_stages=3), "forward", True, True),
    (128, 128, dict(dq_block_kv=128, dq_num_stages=2), "dq", False, True),  # counted at the limit, less the margin
    (128, 128, dict(dq_block_kv=128, dq_num_stages=2), "dq", True, False),  # the compiler: 233,616
])
def test_shared_memory_count_matches_the_compiler(d, dv, kw, kernel, segments, fits):
    """A config `supports()` admits compiles, one it refuses would not: lowered for CUDA, where Mosaic GPU
    checks its shared memory against the 232,448 bytes a Hopper block may use. Before the count had the
    reduction scratch and the 1 KiB alignment, the first case was admitted and the compiler's error reached
    the user."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import KERNEL, _jax_refusal, _refusal
    from ringjax.core.ring import ring_attention_shard

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    cfg = MosaicGpuConfig(**{"block_kv": 64, "num_stages": 2, "dkv_num_stages": 2, **kw})
    opts = AttentionOptions(softmax_scale=0.1, causal=True, has_segments=segments)
    why = _refusal(_problem(head_dim=d, v_head_dim=dv, opts=opts), cfg) or ""  # on CPU: at last, no GPU
    assert ("shared memory" not in why) == fits, why
    assert fits or f"in its {kernel} kernel" in why

    def attn(q, k, v, seg):
        seg = seg if segments else None
        return ring_attention_shard(opts, KERNEL, cfg, q, k, v, seg, seg, None)[0]

    def grads(q, k, v, seg):
        return jax.grad(lambda *x: attn(*x, seg).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    s = jax.ShapeDtypeStruct
    args = (s((1, 512, 4, d), jnp.bfloat16), s((1, 512, 2, d), jnp.bfloat16), s((1, 512, 2, dv), jnp.bfloat16),
            s((1, 512), jnp.int32))
    lower = jax.jit(attn if kernel == "forward" else grads).trace(*args).lower
    if fits:
        lower(lowering_platforms=("cuda",))
    else:
        with pytest.raises(Exception, match="exceeds available shared memory"):
            lower(lowering_platforms=("cuda",))


def _lowered_for_cuda(f, t: int, d: int, dv: int) -> str:
    """f(q, k, v, do, lse, delta, seg) lowered for CUDA (8 q / 2 kv heads, batch 1), as text."""
    s = jax.ShapeDtypeStruct
    args = (s((1, t, 8, d), jnp.bfloat16), s((1, t, 2, d), jnp.bfloat16), s((1, t, 2, dv), jnp.bfloat16),
            s((1, t, 8, dv), jnp.bfloat16), s((1, 8, t), jnp.float32), s((1, 8, t), jnp.float32),
            s((1, t), jnp.int32))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mosaic_calls_lowered_for_cuda(f, t: int, d: int, dv: int) -> int:
    """Mosaic GPU kernel calls in f (`_lowered_for_cuda`)."""
    return _lowered_for_cuda(f, t, d, dv).count("stablehlo.custom_call @mosaic_gpu")


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
@pytest.mark.parametrize("kw", [
    dict(causal=True, window=(100, 0), logits_soft_cap=30.0, has_segments=True),
    dict(causal=True, window=(100, 0), has_alibi=True, dropout_rate=0.1, num_sink_tokens=4),
    dict(has_segments=True),  # a mask of segment ids only: tiles build no positions (layout inference)
    dict(causal=True, window=(100, 0), num_sink_tokens=4, has_segments=True),  # ids carrying the sink flag
])
@pytest.mark.parametrize("d", [96, 128, 256, (192, 128), (64, 256)])  # (q/k head_dim, v head_dim)
def test_kernels_lower_to_mosaic_gpu_for_cuda(kw, d):
    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_bwd, block_fwd

    t = 256
    d, dv = d if isinstance(d, tuple) else (d, d)
    opts = AttentionOptions(softmax_scale=0.1, **kw)
    extras = Extras(alibi_slopes=jnp.linspace(0.1, 0.8, 8), dropout_seed=jnp.array([1, 2], jnp.uint32))

    def f(q, k, v, do, lse, delta, seg):
        seg = seg if opts.has_segments else None
        pos = jnp.arange(t, dtype=jnp.int32)
        qi = TokenInfo(pos, seg, pos[None])
        ki = TokenInfo(pos - t, seg, pos[None] - t)
        cfg = IMPLEMENTATION.default_config(_problem(head_dim=d, v_head_dim=dv))
        return (block_fwd(q, k, v, qi, ki, extras, opts, cfg),
                block_bwd(q, k, v, do, lse, delta, qi, ki, extras, opts, cfg),
                # final results: bf16
                block_fwd(q, k, v, qi, ki, extras, opts, cfg, out_dtype=q.dtype),
                block_bwd(q, k, v, do, lse, delta, qi, ki, extras, opts, cfg, out_dtype=q.dtype))

    assert _mosaic_calls_lowered_for_cuda(f, t, d, dv) == 6


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
def test_sink_step_lowers_for_cuda():
    """A shortened ring's step of sink tokens alone: its mask (sink pairs the base rule hides) lowers for CUDA
    (an invert of a bool vector did not), and its dK/dV is the dense product, not a kernel."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_bwd, block_fwd

    t, d = 256, 64
    opts = StepOptions.sink_step(AttentionOptions(softmax_scale=0.1, causal=True, window=(100, 0), num_sink_tokens=3,
                                                  axis_size=4))
    cfg = MosaicGpuConfig(block_kv=64, dq_block_kv=64, dkv_block_q=64)

    def infos():
        qpos, kpos = jnp.arange(t, dtype=jnp.int32) + 2 * t, jnp.arange(64, dtype=jnp.int32)
        return TokenInfo(qpos, None, qpos[None]), TokenInfo(kpos, None, kpos[None])

    def f(q, k, v, do, lse, delta):
        return (block_fwd(q, k, v, *infos(), Extras(), opts, cfg),
                block_bwd(q, k, v, do, lse, delta, *infos(), Extras(), opts, cfg))

    s = jax.ShapeDtypeStruct
    qs, ks, ls = s((1, t, 4, d), jnp.float16), s((1, 64, 2, d), jnp.float16), s((1, 4, t), jnp.float32)
    text = jax.jit(f).trace(qs, ks, ks, qs, ls, ls).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2  # forward and dQ


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
@pytest.mark.parametrize("d, dv, tile_major", [(64, 64, False), (128, 128, False), (128, 64, False),
                                               (128, 128, True)])
def test_fused_backward_lowers_to_one_kernel_for_cuda(d, dv, tile_major):
    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_bwd

    t = 256
    opts = AttentionOptions(softmax_scale=0.1, causal=True, window=(100, 0), logits_soft_cap=30.0,
                            dropout_rate=0.1, has_segments=True)
    extras = Extras(dropout_seed=jnp.array([1, 2], jnp.uint32))

    def f(q, k, v, do, lse, delta, seg):
        pos = jnp.arange(t, dtype=jnp.int32)
        cfg = dataclasses.replace(IMPLEMENTATION.default_config(_problem(head_dim=d, v_head_dim=dv)), bwd_fused=True,
                                  dkv_num_stages=2, bwd_tile_major=tile_major)
        return block_bwd(q, k, v, do, lse, delta, TokenInfo(pos, seg), TokenInfo(pos - t, seg), extras, opts, cfg)

    assert _mosaic_calls_lowered_for_cuda(f, t, d, dv) == 1


@pytest.mark.skipif(ON_HOPPER, reason="lowering check is for CPU-only CI; on a GPU the kernels really run")
def test_kernels_are_named_for_profiles():
    """Profiles (jax.profiler, nsys, ncu) show each kernel by what it computes, not as "anonymous"."""
    import re

    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_bwd, block_fwd

    t, d = 256, 128
    opts = AttentionOptions(softmax_scale=0.1, causal=True)
    fused = MosaicGpuConfig(bwd_fused=True, dkv_num_stages=2)

    def f(q, k, v, do, lse, delta, seg):
        pos = jnp.arange(t, dtype=jnp.int32)
        qi, ki = TokenInfo(pos, None, pos[None]), TokenInfo(pos - t, None, pos[None] - t)
        return (block_fwd(q, k, v, qi, ki, Extras(), opts, fused),
                block_bwd(q, k, v, do, lse, delta, qi, ki, Extras(), opts, fused),
                block_bwd(q, k, v, do, lse, delta, qi, ki, Extras(), opts, MosaicGpuConfig()))

    names = set(re.findall(r"(ringjax_[a-z_]+?)_mosaic_gpu", _lowered_for_cuda(f, t, d, d)))
    assert names == {"ringjax_fwd", "ringjax_dkv_dq", "ringjax_dq", "ringjax_dkv"}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("config", [SMALL, FUSED], ids=["split", "fused"])
def test_alibi_lowers_for_cuda(causal, config):
    """ALiBi's forward and backward lower for CUDA: causal, the forward adds a bias per key column and puts the
    per-row part back in the lse (`_Mods.column_bias`); not causal, a distance per score. Fused, the dK/dV
    kernel sums each key's slope gradient (transposed offsets, or distance tiles) and writes it once a head."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import KERNEL, _jax_refusal
    from ringjax.core.masks import Extras
    from ringjax.core.ring import ring_attention_shard

    if _jax_refusal():
        pytest.skip(_jax_refusal())
    opts = AttentionOptions(softmax_scale=0.1, causal=causal, has_alibi=True)
    extras = Extras(alibi_slopes=jnp.linspace(0.01, 0.5, 4, dtype=jnp.float32))
    compiled = dataclasses.replace(config, interpret=False)

    def loss(q, k, v):
        return ring_attention_shard(opts, KERNEL, compiled, q, k, v, None, None, None, extras)[0].astype(
            jnp.float32).sum()

    s = jax.ShapeDtypeStruct
    args = (s((1, 256, 4, 64), jnp.bfloat16), s((1, 256, 2, 64), jnp.bfloat16), s((1, 256, 2, 64), jnp.bfloat16))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("ringjax_dkv_dq" in text) == config.bwd_fused
    assert text.count("mosaic_gpu") >= (2 if config.bwd_fused else 3)  # forward, (dQ,) dK/dV


@pytest.mark.parametrize("head_dim, kw, fused", [
    (128, {}, True), (128, dict(has_alibi=True, causal=False), True),
    (128, dict(has_alibi=True), False),  # causal ALiBi's: measured slower than the split kernels twice
    (128, dict(deterministic=True), False), (256, {}, False)])
def test_candidates_try_the_fused_backward_where_it_runs(head_dim, kw, fused):
    """The tuner measures the fused backward beside the split kernels wherever `split_bwd_reason` lets it run
    and it has not been measured slower."""
    problem = _problem(head_dim=head_dim, opts=AttentionOptions(**{"causal": True, **kw}))
    cands = IMPLEMENTATION.candidate_configs(problem)
    runs = [c for c in cands if c.split_bwd_reason(problem.opts, head_dim, head_dim, problem.itemsize) is None]
    assert bool(runs) == fused and len(cands) == len(set(cands))


@pytest.mark.parametrize("kw, fused", [
    (dict(dropout_rate=0.1), True), (dict(logits_soft_cap=30.0), True), (dict(causal=False, dropout_rate=0.1), True),
    ({}, False),  # plain: the split kernels (the shipped H200 configs say otherwise where measured)
    (dict(dropout_rate=0.1, window=(1024, 0)), False), (dict(logits_soft_cap=30.0, has_segments=True), False),
    (dict(dropout_rate=0.1, has_alibi=True), False), (dict(logits_soft_cap=30.0, deterministic=True), False),
])
def test_heuristic_fuses_the_backward_where_p_costs_most(kw, fused):
    """At head_dim 128 the heuristic runs the fused backward (P computed once, not once per kernel) for dropout and
    soft caps on masks that skip nothing but causal blocks (1 H200, 2026-12-01: 1.01-1.12x the split kernels)."""
    opts = AttentionOptions(**{"causal": True, **kw})
    config = IMPLEMENTATION.default_config(_problem(opts=opts))
    assert config.bwd_fused == fused
    if fused:
        assert config.split_bwd_reason(opts, 128, 128) is None

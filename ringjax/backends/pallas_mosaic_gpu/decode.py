"""Split-K decode attention for Hopper (sm90): a few query tokens against one device's part of a KV cache.

`partials(q, k, v, q_pos, k_pos, k_len, opts)` -> (out, lse) float32 of the keys this device holds,
for the caller to merge across devices by lse. One CTA per (batch row, KV head, split) holds every
query row of its KV head, t tokens x the group's heads (row r: token r // group, head r % group),
padded to 64-row wgmma tiles, one consumer warpgroup per tile. A producer warpgroup streams the
split's key blocks (K, V and the blocks' key positions) by TMA through `num_stages` shared-memory
slots; a consumer computes S = QK^T, masks, runs an online base-2 softmax and O += PV. Each CTA
writes its normalised partial output and lse; the splits merge in XLA.

Keys: slot s of row b is a key iff k_pos[s] < k_len[b], then `masks.visible_pairs` decides (causal,
window, chunks on global positions). Work follows the mask: per batch row the key blocks that any of
its queries may see ([lo, hi), from `masks.maybe_visible` on each block's position range and k_len)
are dealt evenly to the splits, so ragged rows and windows read only those blocks and keep every
CTA equally busy; blocks every query sees whole ([flo, fhi)) skip the element mask.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ringjax import _compat
from ringjax.backends.pallas_mosaic_gpu.config import (
    DECODE_EPILOGUE_SLOTS,
    HEAD_DIMS,
    ROWS,
    SMEM_LIMIT,
    DecodeConfig,
)
from ringjax.core.features import Support
from ringjax.core.masks import BlockRange, fully_visible, may_skip, maybe_visible, visible_pairs
from ringjax.core.modifiers import folded_scores, logit_factor
from ringjax.core.problem import Problem
from ringjax.core.visits import bounds
from ringjax.merge import finite_or_zero, log_sum
from ringjax.options import AttentionOptions

_LN2 = math.log(2.0)
_PRODUCER_REGS = 40
MAX_ROWS = 2 * ROWS  # query rows of one KV head (t x heads per KV head) a CTA holds: two consumer tiles
# what the kernel computes; everything else (segments, sinks, ALiBi, dropout, sink tokens, all-gather and
# Ulysses placements) is refused by name through the feature table
SUPPORT = Support(
    features=frozenset({"causal", "sliding_window", "logits_soft_cap", "chunk_size"}),
    dtypes=("bfloat16", "float16"),
    head_dims=lambda d: d in HEAD_DIMS,
    head_dims_text=", ".join(map(str, HEAD_DIMS[:-1])) + f" or {HEAD_DIMS[-1]}",
)
_DEFAULT_SMS = 132  # H100 / H200 SXM


# --------------------------------------------------------------------------- checks and configs


def _shape_refusal(q_shape, k_shape, v_shape) -> str | None:
    """Why these shapes cannot run (or None): ranks, matching dims, group and row limits."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            return f"{name} must be 4-D [batch, tokens, heads, head_dim], got shape {tuple(shape)}"
    b, t, h, d = q_shape
    if k_shape[0] != b or v_shape[0] != b:
        return f"k and v batch ({k_shape[0]}, {v_shape[0]}) must equal q's {b}"
    if tuple(k_shape[1:3]) != tuple(v_shape[1:3]):
        return f"k {tuple(k_shape)} and v {tuple(v_shape)} must agree on cache length and kv_heads"
    if k_shape[3] != d:
        return f"k head_dim {k_shape[3]} must equal q head_dim {d}"
    kvh = k_shape[2]
    if kvh < 1 or h % kvh:
        return f"q heads ({h}) must be a multiple of kv_heads ({kvh})"
    if t < 1 or t * (h // kvh) > MAX_ROWS:
        return (f"query tokens x heads per KV head = {t} x {h // kvh} = {t * (h // kvh)} rows: must be 1 to "
                f"{MAX_ROWS} (one CTA holds them all)")
    if v_shape[3] not in HEAD_DIMS:
        return f"v head_dim {v_shape[3]} is not supported: needs one of {HEAD_DIMS}"
    if k_shape[1] < ROWS or k_shape[1] % ROWS:
        return f"the cache length per device {k_shape[1]} must be a positive multiple of {ROWS}"
    return None


def _feature_refusal(q_shape, k_shape, dtype, opts: AttentionOptions) -> str | None:
    """The feature table's refusal (options, dtype, head_dim) of this call, or None."""
    problem = Problem(opts=opts, batch=q_shape[0], seq=k_shape[1], heads=q_shape[2], kv_heads=k_shape[2],
                      head_dim=q_shape[3], dtype=jnp.dtype(dtype).name, platform="gpu")
    return SUPPORT.refusal("pallas_mosaic_gpu decode", problem)


def _rows(t: int, groups: int) -> int:
    """Query rows of a CTA, padded to whole 64-row tiles."""
    return -(-t * groups // ROWS) * ROWS


def _config_refusal(config: DecodeConfig, q_shape, k_shape, v_shape, itemsize: int) -> str | None:
    """Why `config` cannot run these shapes (shared memory, registers, block size), or None."""
    _, t, h, d = q_shape
    s, kvh, dv = k_shape[1], k_shape[2], v_shape[3]
    if s % config.block_k:
        return f"block_k {config.block_k} must divide the cache length per device {s}"
    if config.block_k > 128 and dv > 128:
        return (f"block_k {config.block_k} with v head_dim {dv}: the scores and the output accumulator do not fit a "
                "thread's registers (block_k <= 128 above head_dim 128)")
    size = config.smem_bytes(_rows(t, h // kvh), d, dv, itemsize)
    if size > SMEM_LIMIT - 1024:
        return f"config {config} needs {size} bytes of shared memory, over the {SMEM_LIMIT} a Hopper block may use"
    return None


def _sm_count(device) -> int:
    return int(getattr(device, "core_count", 0) or _DEFAULT_SMS)


def default_config(q_shape, k_shape, v_shape, dtype=jnp.bfloat16, device=None) -> DecodeConfig:
    """The heuristic config: the largest key blocks and deepest pipeline that fit shared memory, and enough
    splits that the CTAs fill the GPU in whole waves (at least two CTAs per SM)."""
    b, s, kvh = q_shape[0], k_shape[1], k_shape[2]
    itemsize = jnp.dtype(dtype).itemsize
    chosen = None
    for block_k in (128, 64):  # 64-key blocks only where 128 leave fewer than three stages
        for stages in (4, 3, 2):
            cfg = DecodeConfig(block_k=block_k, num_stages=stages)
            if _config_refusal(cfg, q_shape, k_shape, v_shape, itemsize) is None:
                break
        else:
            continue
        if chosen is None or (chosen.num_stages < 3 and stages > chosen.num_stages):
            chosen = cfg
    chosen = chosen or DecodeConfig(block_k=64, num_stages=2)
    blocks = max(s // chosen.block_k, 1)
    return DecodeConfig(block_k=chosen.block_k, num_stages=chosen.num_stages,
                        num_splits=_splits(b * kvh, blocks, _sm_count(device)))


def _splits(ctas_per_split: int, blocks: int, sms: int) -> int:
    """Splits per (row, KV head): at least two CTAs per SM, then the fewest whose CTAs fill whole waves
    (one CTA per SM at a time) to within 3%, never more splits than key blocks."""
    low = max(1, -(-2 * sms // ctas_per_split))
    if low >= blocks:
        return blocks
    best, best_fill = low, 0.0
    for p in range(low, min(4 * low, blocks) + 1):
        ctas = ctas_per_split * p
        fill = ctas / (-(-ctas // sms) * sms)
        if fill >= 0.97:
            return p
        if fill > best_fill:
            best, best_fill = p, fill
    return best


def supports(q_shape, k_shape, v_shape, dtype, opts: AttentionOptions, device=None) -> str | None:
    """None if `partials` can run these shapes and options on `device` (a jax Device; None: jax's first
    device), else the reason."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal, device_refusal

    why = _shape_refusal(q_shape, k_shape, v_shape)
    if why:
        return why
    dtype = jnp.dtype(dtype)
    why = _feature_refusal(q_shape, k_shape, dtype, opts)
    if why:
        return why
    why = _jax_refusal()
    if why:
        return why
    device = jax.devices()[0] if device is None else device
    why = device_refusal(device)
    if why:
        return why
    config = default_config(q_shape, k_shape, v_shape, dtype, device)
    return _config_refusal(config, q_shape, k_shape, v_shape, dtype.itemsize)


def _check_call(q, k, v, q_pos, k_pos, k_len, opts, config, interpret: bool) -> None:
    """ValueError/TypeError naming the argument, before any device work."""
    from ringjax.backends.pallas_mosaic_gpu.implementation import _jax_refusal, interpreter_refusal

    for name, x in (("q", q), ("k", k), ("v", v), ("q_pos", q_pos), ("k_pos", k_pos), ("k_len", k_len)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not isinstance(opts, AttentionOptions):
        raise TypeError(f"opts must be an AttentionOptions, got {type(opts).__name__}")
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    why = _shape_refusal(q.shape, k.shape, v.shape)
    if why:
        raise ValueError(why)
    b, t = q.shape[:2]
    for name, x, shape in (("q_pos", q_pos, (b, t)), ("k_pos", k_pos, (k.shape[1],)), ("k_len", k_len, (b,))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (int32), got {x.dtype}")
    why = _feature_refusal(q.shape, k.shape, q.dtype, opts)
    if why:
        raise ValueError(why)
    if config is not None:
        why = _config_refusal(config, q.shape, k.shape, v.shape, jnp.dtype(q.dtype).itemsize)
        if why:
            raise ValueError(f"config: {why}")
    why = interpreter_refusal() if interpret else _jax_refusal()
    if why:
        raise ValueError(f"pallas_mosaic_gpu decode cannot run here: {why}")


# --------------------------------------------------------------------------- the visit table (XLA)


def visit_table(opts: AttentionOptions, q_pos, k_pos, k_len, block_k: int):
    """int32 [B, 4] (lo, flo, fhi, hi) per batch row over key blocks: [lo, hi) holds every block a query of
    the row may see, [flo, fhi) blocks all of its queries see whole (`visits.bounds`)."""
    kb = k_pos.astype(jnp.int32).reshape(-1, block_k)
    keys = BlockRange(kb.min(axis=1)[None], kb.max(axis=1)[None], None, None)  # [1, nk]
    q_pos = q_pos.astype(jnp.int32)
    queries = BlockRange(q_pos.min(axis=1)[:, None], q_pos.max(axis=1)[:, None], None, None)  # [B, 1]
    k_len = k_len.astype(jnp.int32)[:, None]
    maybe = maybe_visible(opts, queries, keys) & (keys.pos_lo < k_len)
    full = fully_visible(opts, queries, keys) & (keys.pos_hi < k_len)
    shape = (q_pos.shape[0], kb.shape[0])
    return bounds(jnp.broadcast_to(maybe, shape), jnp.broadcast_to(full, shape))


def split_range(table, b, split, splits: int):
    """(start, flo, fhi, end): the blocks [start, end) of `split` out of row b's visible blocks [lo, hi) (dealt
    evenly: sizes differ by at most one), and the row's fully visible blocks [flo, fhi)."""
    lo, flo, fhi, hi = (table[b, i] for i in range(4))
    n = hi - lo
    return lo + lax.div(split * n, splits), flo, fhi, lo + lax.div((split + 1) * n, splits)


# --------------------------------------------------------------------------- the kernel


def _decode_kernel(q_ref, k_ref, v_ref, kpos_ref, rowpos_ref, table_ref, klen_ref, out_ref, lse_ref,
                   q_smem, k_smem, v_smem, kpos_smem, rowpos_smem, lse_smem, o_smem,
                   q_bar, k_bar, v_bar, k_free, v_free, *, opts: AttentionOptions, block_k: int, stages: int,
                   splits: int, tiles: int, emulate: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from ringjax.backends.pallas_mosaic_gpu.kernels import _drain, _mma, _mma_fresh, _Pos, _write_rows, _zeros

    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    start, flo, fhi, end = split_range(table_ref, b, split, splits)
    # the logits' factor (the scale, or the soft cap's) stays out of the max and joins exp2 as one FMA
    scale = logit_factor(opts)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    @pl.when(wg < tiles)
    def _consumer():
        regs = min(256, (512 - _PRODUCER_REGS) // tiles // 8 * 8)
        plgpu.set_max_registers(regs, action="increase")
        rows = pl.ds(wg * ROWS, ROWS)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(rowpos_ref.at[b, rows], rowpos_smem.at[wg], q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        qpos = plgpu.load(rowpos_smem.at[wg], layout=row_layout)
        k_len = klen_ref[b]

        def step(blk, carry, masked: bool):
            acc, m, row_sum = carry
            slot = lax.rem(blk - start, jnp.int32(stages))
            plgpu.barrier_wait(k_bar.at[slot])
            s = _mma_fresh((ROWS, block_k), q_smem.at[wg], k_smem.at[slot], transpose_b=True, emulate=emulate)
            kpos = plgpu.load(kpos_smem.at[slot], layout=col_layout) if masked else None
            plgpu.barrier_arrive(k_free.at[slot])
            s = folded_scores(s, opts)
            if masked:
                qp, kp = _Pos(qpos, kpos).full()
                valid = kp < k_len
                if may_skip(opts):
                    valid = valid & visible_pairs(opts, qp, kp)
                s = jnp.where(valid, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * scale)
            # rows that have seen no key keep m = -inf; shift them by 0 so exp2 gives exact zeros
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            row_sum = row_sum * alpha + p.sum(axis=1)
            p16 = p.astype(q_ref.dtype)
            plgpu.barrier_wait(v_bar.at[slot])
            (acc,) = _mma([acc], [(p16, v_smem.at[slot], False)], emulate)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, row_sum

        carry = (_zeros((ROWS, v_ref.shape[-1])),
                 plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
                 _zeros((ROWS,), row_layout))
        # masked blocks, the fully visible run, masked blocks (any of the three may be empty)
        a = jnp.clip(flo, start, end)
        z = jnp.clip(fhi, a, end)
        for lo, hi, masked in ((start, a, True), (a, z, False), (z, end, True)):
            carry = lax.fori_loop(lo, hi, functools.partial(step, masked=masked), carry)
        acc, m, row_sum = carry

        seen = row_sum > 0.0
        l_safe = jnp.where(seen, row_sum, 1.0)
        acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
        lse_smem.at[wg][...] = jnp.where(seen, m * _LN2 + jnp.log(l_safe), -jnp.inf)
        out_rows = pl.ds(wg * ROWS, min(out_ref.shape[3], ROWS))  # one tile: only its rows up to the last real one
        _write_rows(acc, o_smem, wg, out_ref.at[b, h, split, out_rows])  # commits lse_smem's store too
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, split, rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == tiles)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
        steps = end - start

        @pl.loop(0, steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            keys = pl.ds((start + i) * block_k, block_k)

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            # the block's key positions ride on K's barrier: a consumer that masks reads them with K
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(kpos_ref.at[keys], kpos_smem.at[slot], k_bar.at[slot])

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])

        _drain(steps, stages, k_free, v_free)


def launch(q_rows, k, v, k_pos, row_pos, table, k_len, opts, config: DecodeConfig, splits: int, real_rows: int,
           interpret: bool):
    """The kernel alone on a (batch, KV head, split) grid, from `query_rows` and `visit_table`: out
    [B, KVH, splits, >= real_rows, Dv], lse [B, KVH, splits, rows] (`partials` merges their first real_rows)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from ringjax.backends.pallas_mosaic_gpu.kernels import _compiler_params, _epilogue_smem, _transforms, _unify

    b, kvh, rows, d = q_rows.shape
    dv, dt, bk, stages = v.shape[-1], q_rows.dtype, config.block_k, config.num_stages
    tiles = rows // ROWS
    args = _unify([q_rows, k, v, k_pos, row_pos, table, k_len])
    scratch = [
        plgpu.SMEM((tiles, ROWS, d), dt, transforms=_transforms(d, dt)),
        plgpu.SMEM((stages, bk, d), dt, transforms=_transforms(d, dt)),
        plgpu.SMEM((stages, bk, dv), dt, transforms=_transforms(dv, dt)),
        plgpu.SMEM((stages, bk), jnp.int32),
        plgpu.SMEM((tiles, ROWS), jnp.int32),
        plgpu.SMEM((tiles, ROWS), jnp.float32),
        _epilogue_smem(dv, consumers=tiles, slots=DECODE_EPILOGUE_SLOTS),
        plgpu.Barrier(num_arrivals=2, num_barriers=tiles),  # q tile and its row positions loaded
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # K block and its key positions loaded
        plgpu.Barrier(num_barriers=stages),  # V block loaded
        plgpu.Barrier(num_arrivals=tiles, num_barriers=stages),  # K consumed
        plgpu.Barrier(num_arrivals=tiles, num_barriers=stages),  # V consumed
    ]
    # one tile writes its rows up to the last real one (whole 8-row tiles of the epilogue), two write all
    out_rows = -(-real_rows // 8) * 8 if tiles == 1 else rows
    out_type = [_compat.struct_like((b, kvh, splits, out_rows, dv), jnp.float32, *args),
                _compat.struct_like((b, kvh, splits, rows), jnp.float32, *args)]
    body = functools.partial(_decode_kernel, opts=opts, block_k=bk, stages=stages, splits=splits, tiles=tiles,
                             emulate=interpret)
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    out, lse = plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(b, kvh, splits),
                            grid_names=("b", "h", "split"), num_threads=tiles + 1, thread_name="wg",
                            compiler_params=_compiler_params(), kernel_name="ringjax_decode", **extra)(*args)
    return out, lse


# --------------------------------------------------------------------------- the public entry


def query_rows(q, q_pos, kv_heads: int):
    """The kernel's query rows q [B, KVH, rows, D] and their positions [B, rows]: row r of KV head j is token
    r // groups of query head j * groups + r % groups, zero rows pad to whole 64-row tiles."""
    b, t, h, d = q.shape
    groups = h // kv_heads
    rows, real = _rows(t, groups), t * groups
    q_rows = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, real, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - real), (0, 0)))
    row_pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), groups, axis=1), ((0, 0), (0, rows - real)), mode="edge")
    return q_rows, row_pos


def merge_splits(out, lse):
    """Merge partial results over axis 2 (splits) by their lse: out [..., splits, rows, Dv] and lse
    [..., splits, rows] float32 -> [..., rows, Dv] and [..., rows]; rows no split saw get 0 and -inf."""
    m = finite_or_zero(lse.max(axis=2))
    w = jnp.exp(lse - jnp.expand_dims(m, 2))  # 0 for splits that saw no key of the row
    total = w.sum(axis=2)
    merged = (w[..., None] * out).sum(axis=2) / jnp.where(total > 0.0, total, 1.0)[..., None]
    return merged, log_sum(m, total)


def partials(q, k, v, q_pos, k_pos, k_len, opts: AttentionOptions, config: DecodeConfig | None = None, *,
             interpret: bool = False):
    """Attention of q [B, t, H, D] to this device's cache part k [B, S, KVH, D], v [B, S, KVH, Dv].

    q_pos [B, t] int32: the queries' global positions; k_pos [S] int32, increasing: the global position of
    each cache slot; k_len [B] int32: slot s of row b is a key iff k_pos[s] < k_len[b], then `opts`' masks
    apply. Returns out [B, t, H, Dv] and lse [B, t, H] (natural log), float32; a row that sees no key
    gets 0 and -inf. `interpret`: jax's Mosaic GPU interpreter (any platform, slow; for tests).
    """
    _check_call(q, k, v, q_pos, k_pos, k_len, opts, config, interpret)
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    groups = h // kvh
    if config is None:
        device = None if interpret else jax.devices()[0]
        config = default_config(q.shape, k.shape, v.shape, q.dtype, device)
    splits = min(config.num_splits, s // config.block_k)
    q_rows, row_pos = query_rows(q, q_pos, kvh)
    table = visit_table(opts, q_pos, k_pos, k_len, config.block_k)
    real = t * groups
    out, lse = launch(q_rows, k, v, k_pos.astype(jnp.int32), row_pos, table, k_len.astype(jnp.int32), opts, config,
                      splits, real, interpret)
    out, lse = merge_splits(out[:, :, :, :real], lse[:, :, :, :real])  # [B, KVH, real, Dv], [B, KVH, real]
    out = out.reshape(b, kvh, t, groups, -1).transpose(0, 2, 1, 3, 4).reshape(b, t, h, -1)
    lse = lse.reshape(b, kvh, t, groups).transpose(0, 2, 1, 3).reshape(b, t, h)
    return out, lse


__all__ = ["DecodeConfig", "MAX_ROWS", "SUPPORT", "default_config", "launch", "merge_splits", "partials",
           "query_rows", "supports", "visit_table"]

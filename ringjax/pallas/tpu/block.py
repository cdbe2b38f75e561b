"""One ring step as Pallas TPU flash-attention kernels: forward (out, lse) and backward.

Tiles, per (batch, KV head):
- a query tile holds all G = heads // kv_heads query heads of one KV head for bq
  tokens, [G, bq, D] in HBM and [G * bq, D] in the kernel, so K/V are read once
  per G query heads and never repeated (GQA);
- K/V tiles are [bk, D];
- positions and segment ids come as a [bq, 1] column and a [1, bk] row, and block
  ranges (min/max of positions and segment ids) as scalars in SMEM, so the mask
  rules are `masks.visible_pairs` on tiles and `masks.maybe_visible` on ranges.

Forward grid (B, KVH, nq, nk) keeps the online-softmax statistics in VMEM scratch
over the kv axis. Backward runs two kernels, as the XLA step does in one loop:
dK/dV with grid (B, KVH, nk, nq) and dQ with grid (B, KVH, nq, nk), each
recomputing the probabilities from the whole-ring lse.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringjax import _compat, masks
from ringjax.masks import BlockRange, TokenInfo
from ringjax.options import AttentionOptions
from ringjax.pallas.tpu.config import TpuConfig, pick_block, sublanes

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _pallas():
    # imported lazily: importing ringjax must not import Pallas
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    return pl, pltpu


# the chip whose memory tiling is assumed when Pallas TPU code is traced off-TPU (interpreter, lowering checks)
SIMULATED_CHIP = "TPU_V5P"


def assume_tpu_tiling() -> None:
    """Let Pallas TPU pipelines be traced when the default device is not a TPU.

    `emit_pipeline` asks the device for its memory tiling while tracing. Off-TPU (the
    interpreter on CPU, lowering checks), this registers the host's device kind with
    Pallas's TPU info table as a TPU v5p; nothing changes when running on a TPU.
    """
    if jax.default_backend() == "tpu":
        return
    try:  # not public API: the table jax consults for device kinds it does not know
        from jax._src.pallas.mosaic import tpu_info
    except ImportError as e:
        raise RuntimeError(f"this jax ({jax.__version__}) has no Pallas TPU info table to extend") from e
    kind = jax.devices()[0].device_kind
    if kind not in tpu_info.registry:
        chip = getattr(tpu_info.ChipVersion, SIMULATED_CHIP)
        tpu_info.registry[kind] = functools.partial(tpu_info.get_tpu_info_for_chip, chip, 1)


def interpret_params(config: TpuConfig):
    """The `interpret=` argument of pallas_call for `config`."""
    if not config.interpret:
        return False
    _, pltpu = _pallas()
    return pltpu.InterpretParams(detect_races=config.detect_races)


def reset_interpreter() -> None:
    """Clear the Pallas TPU interpreter's global state (needed after a kernel raised in it)."""
    _, pltpu = _pallas()
    pltpu.reset_tpu_interpret_mode_state()


def races_found() -> bool:
    """Whether the interpreter's race detector (TpuConfig(detect_races=True)) reported a race
    since the last `reset_interpreter`; each race is also printed when found."""
    try:  # not public API: jax keeps the detector's state in this module
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
    except ImportError as e:
        raise RuntimeError(f"this jax ({jax.__version__}) does not expose the interpreter's race state") from e
    state = getattr(interpreter, "races", None)
    return bool(state is not None and state.races_found)


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _dot(a, b, dims, prec):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=prec)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block structure of one step."""

    groups: int  # query heads per KV head
    block_q: int
    block_kv: int
    num_q: int
    num_kv: int
    head_dim: int
    has_segments: bool

    @property
    def rows(self) -> int:
        return self.groups * self.block_q


def tiling(q, k, opts: AttentionOptions, config: TpuConfig) -> Tiling:
    _, t, h, d = q.shape
    s_len, kvh = k.shape[1], k.shape[2]
    align = sublanes(jnp.dtype(q.dtype).name)
    bq = pick_block(t, config.block_q, opts, align)
    bk = pick_block(s_len, config.block_kv, opts, align)
    return Tiling(h // kvh, bq, bk, t // bq, s_len // bk, d, opts.has_segments)


# ---------------------------------------------------------------- layout changes (XLA side)


def heads_major(x, kv_heads):
    """[B, T, H, D] -> [B, KVH, G, T, D]."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def tokens_major(x):
    """[B, KVH, G, T, D] -> [B, T, H, D]."""
    b, kvh, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * g, d)


def rows_major(x, kv_heads):
    """[B, H, T] -> [B, KVH, G, T, 1]."""
    b, h, t = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, t, 1)


def kv_major(x):
    """[B, S, KVH, D] -> [B, KVH, S, D] (and back: the same transpose)."""
    return x.transpose(0, 2, 1, 3)


@dataclasses.dataclass(frozen=True)
class Meta:
    """Per-step token metadata in the shapes the kernels read.

    scalars: SMEM arrays [q pos lo/hi (2*nq), k pos lo/hi (2*nk), and with segments
    q seg lo/hi (2*B*nq), k seg lo/hi (2*B*nk)]; tiles: q positions [nq, bq, 1],
    k positions [nk, 1, bk] and with segments [B, nq, bq, 1], [B, nk, 1, bk].
    """

    scalars: tuple
    tiles: tuple


def _ranges(x, axis):
    return jnp.concatenate([x.min(axis=axis).reshape(-1), x.max(axis=axis).reshape(-1)]).astype(jnp.int32)


def token_meta(q_info: TokenInfo, k_info: TokenInfo, tl: Tiling) -> Meta:
    nq, bq, nk, bk = tl.num_q, tl.block_q, tl.num_kv, tl.block_kv
    qpos = q_info.pos.astype(jnp.int32).reshape(nq, bq)
    kpos = k_info.pos.astype(jnp.int32).reshape(nk, bk)
    scalars = [_ranges(qpos, 1), _ranges(kpos, 1)]
    tiles = [qpos[:, :, None], kpos[:, None, :]]
    if tl.has_segments:
        b = q_info.seg.shape[0]
        qseg = q_info.seg.astype(jnp.int32).reshape(b, nq, bq)
        kseg = k_info.seg.astype(jnp.int32).reshape(b, nk, bk)
        scalars += [_ranges(qseg, 2), _ranges(kseg, 2)]
        tiles += [qseg[..., None], kseg[:, :, None, :]]
    return Meta(tuple(scalars), tuple(tiles))


def meta_specs(tl: Tiling, q_index, k_index):
    """BlockSpecs of Meta.tiles; q_index/k_index map grid indices to (b, i) / (b, j)."""
    pl, _ = _pallas()
    bq, bk = tl.block_q, tl.block_kv

    def qpos(*idx):
        return (q_index(*idx)[1], 0, 0)

    def kpos(*idx):
        return (k_index(*idx)[1], 0, 0)

    specs = [pl.BlockSpec((None, bq, 1), qpos), pl.BlockSpec((None, 1, bk), kpos)]
    if tl.has_segments:
        specs += [
            pl.BlockSpec((None, None, bq, 1), lambda *idx: (*q_index(*idx), 0, 0)),
            pl.BlockSpec((None, None, 1, bk), lambda *idx: (*k_index(*idx), 0, 0)),
        ]
    return specs


class MetaRefs:
    """The kernel's view of Meta: block ranges and mask tiles.

    The K range arrays may be tables over several source shards (the fused ring);
    `src` picks the shard whose K/V the current tiles hold.
    """

    def __init__(self, tl: Tiling, scalar_refs, tile_refs, src=0):
        self.tl = tl
        self.scalar_refs = scalar_refs
        self.tile_refs = tile_refs
        self.src = src

    def ranges(self, b, i, j) -> tuple[BlockRange, BlockRange]:
        nq, nk = self.tl.num_q, self.tl.num_kv
        qr, kr = self.scalar_refs[0], self.scalar_refs[1]
        kb = self.src * 2 * nk
        if not self.tl.has_segments:
            return BlockRange(qr[i], qr[nq + i], None, None), BlockRange(kr[kb + j], kr[kb + nk + j], None, None)
        qs, ks = self.scalar_refs[2], self.scalar_refs[3]
        nb = qs.shape[0] // (2 * nq)
        sb = self.src * 2 * nb * nk
        q_rng = BlockRange(qr[i], qr[nq + i], qs[b * nq + i], qs[nb * nq + b * nq + i])
        k_rng = BlockRange(kr[kb + j], kr[kb + nk + j], ks[sb + b * nk + j], ks[sb + nb * nk + b * nk + j])
        return q_rng, k_rng

    def visible(self, opts: AttentionOptions):
        """Exact mask of the current tile pair, bool [bq, bk]."""
        qpos, kpos = self.tile_refs[0][...], self.tile_refs[1][...]
        qseg = kseg = None
        if self.tl.has_segments:
            qseg, kseg = self.tile_refs[2][...], self.tile_refs[3][...]
        return masks.visible_pairs(opts, qpos, kpos, qseg, kseg)


def when_visible(opts: AttentionOptions, meta: MetaRefs, b, i, j, body):
    """Run `body` unless the mask hides every key of tile j from every query of tile i."""
    pl, _ = _pallas()
    if not masks.may_skip(opts):
        body()
        return
    q_rng, k_rng = meta.ranges(b, i, j)
    pl.when(masks.maybe_visible(opts, q_rng, k_rng))(body)


def mask_rows(x, vis, groups, fill):
    """Apply a [bq, bk] mask to [G * bq, bk] rows of all G query heads."""
    rows, bk = x.shape
    x3 = x.reshape(groups, rows // groups, bk)
    return jnp.where(vis[None], x3, fill).reshape(rows, bk)


def out_struct(shape, dtype, like):
    """Output shape of a pallas_call inside shard_map: varying over what its inputs vary over."""
    varying = frozenset().union(*(_compat.varying_axes(x) for x in like))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def align_vma(*xs):
    """Make every operand vary over the same mesh axes (pallas_call operands must agree)."""
    return tuple(_compat.match_vma(x, *xs) for x in xs)


# ---------------------------------------------------------------- forward


def online_softmax_step(q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, meta: MetaRefs, opts: AttentionOptions,
                        tl: Tiling):
    """Fold one K/V tile into the running max m, denominator l and unnormalised output acc."""
    prec = _precision(q_ref.dtype)
    q = q_ref[...].reshape(tl.rows, tl.head_dim)
    v = v_ref[...]
    s = masks.logits(_dot(q, k_ref[...], _NT, prec), opts)
    if masks.may_skip(opts):
        s = mask_rows(s, meta.visible(opts), tl.groups, -jnp.inf)
    m_prev = m_ref[...].reshape(tl.rows, 1)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
    p = jnp.exp(s - m_safe)  # exactly 0 where masked
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = (alpha * l_ref[...].reshape(tl.rows, 1) + p.sum(axis=1, keepdims=True)).reshape(l_ref.shape)
    m_ref[...] = m_new.reshape(m_ref.shape)
    acc = alpha * acc_ref[...].reshape(tl.rows, tl.head_dim) + _dot(p.astype(v.dtype), v, _NN, prec)
    acc_ref[...] = acc.reshape(acc_ref.shape)


def _fwd_kernel(*refs, opts: AttentionOptions, tl: Tiling):
    pl, _ = _pallas()
    n_scalar = 4 if tl.has_segments else 2
    scalar_refs, refs = refs[:n_scalar], refs[n_scalar:]
    q_ref, k_ref, v_ref = refs[:3]
    tile_refs = refs[3 : 3 + n_scalar]
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[3 + n_scalar :]
    meta = MetaRefs(tl, scalar_refs, tile_refs)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def body():
        online_softmax_step(q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, meta, opts, tl)

    when_visible(opts, meta, b, i, j, body)

    @pl.when(j == tl.num_kv - 1)
    def _finish():
        denom = l_sc[...]
        seen = denom > 0.0
        safe = jnp.where(seen, denom, 1.0)
        o_ref[...] = (acc_sc[...] / safe).reshape(o_ref.shape)
        lse = jnp.where(seen, m_sc[...] + jnp.log(safe), -jnp.inf)
        lse_ref[...] = lse.reshape(lse_ref.shape)


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, opts: AttentionOptions, config: TpuConfig):
    """One ring step forward: (out f32 [B,T,H,D], lse f32 [B,H,T])."""
    pl, pltpu = _pallas()
    b, t, h, d = q.shape
    kvh = k.shape[2]
    tl = tiling(q, k, opts, config)
    meta = token_meta(q_info, k_info, tl)
    qh, kh, vh = heads_major(q, kvh), kv_major(k), kv_major(v)
    operands = align_vma(*meta.scalars, qh, kh, vh, *meta.tiles)
    g, bq, bk = tl.groups, tl.block_q, tl.block_kv

    def q_index(bi, hi, i, j, *_):
        return bi, i

    def k_index(bi, hi, i, j, *_):
        return bi, j

    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), lambda bi, hi, i, j, *_: (bi, hi, 0, i, 0)),
        pl.BlockSpec((None, None, bk, d), lambda bi, hi, i, j, *_: (bi, hi, j, 0)),
        pl.BlockSpec((None, None, bk, d), lambda bi, hi, i, j, *_: (bi, hi, j, 0)),
        *meta_specs(tl, q_index, k_index),
    ]
    out_specs = [
        pl.BlockSpec((None, None, g, bq, d), lambda bi, hi, i, j, *_: (bi, hi, 0, i, 0)),
        pl.BlockSpec((None, None, g, bq, 1), lambda bi, hi, i, j, *_: (bi, hi, 0, i, 0)),
    ]
    out_shape = [
        out_struct((b, kvh, g, t, d), jnp.float32, operands),
        out_struct((b, kvh, g, t, 1), jnp.float32, operands),
    ]
    rows = tl.rows
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, opts=opts, tl=tl),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta.scalars),
            grid=(b, kvh, tl.num_q, tl.num_kv),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, d), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(q, k, 2, config),
        interpret=interpret_params(config),
        name="ringjax_tpu_fwd",
    )(*operands)
    return tokens_major(out), lse.reshape(b, h, t)


def _cost(q, k, matmuls, config):
    pl, _ = _pallas()
    b, t, h, d = q.shape
    s_len = k.shape[1]
    nbytes = q.size * q.dtype.itemsize * 2 + k.size * k.dtype.itemsize * 2 * 2
    return pl.CostEstimate(
        flops=int(2 * matmuls * b * h * t * s_len * d),
        transcendentals=int(b * h * t * s_len),
        bytes_accessed=int(nbytes),
    )


# ---------------------------------------------------------------- backward


def _probs_and_dscores(q, k, v, do, lse, delta, meta, opts, tl, prec):
    """P and dS = P * (dP - delta) * dlogits/dqk for one tile pair, both [G*bq, bk] f32."""
    s, slope = masks.logits_and_slope(_dot(q, k, _NT, prec), opts)
    p = jnp.exp(s - lse)
    if masks.may_skip(opts):
        p = mask_rows(p, meta.visible(opts), tl.groups, 0.0)
    dp = _dot(do, v, _NT, prec)
    return p, p * (dp - delta) * slope


def _bwd_unpack(refs, tl):
    n_scalar = 4 if tl.has_segments else 2
    scalar_refs, refs = refs[:n_scalar], refs[n_scalar:]
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    tile_refs = refs[6 : 6 + n_scalar]
    return MetaRefs(tl, scalar_refs, tile_refs), (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), refs[6 + n_scalar :]


def _load_rows(refs, tl):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs
    rows, d = tl.rows, tl.head_dim
    return (
        q_ref[...].reshape(rows, d),
        k_ref[...],
        v_ref[...],
        do_ref[...].reshape(rows, d),
        lse_ref[...].reshape(rows, 1),
        delta_ref[...].reshape(rows, 1),
    )


def dkv_step(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, meta: MetaRefs,
             opts: AttentionOptions, tl: Tiling):
    """Add one tile pair's contribution to the dK and dV tiles."""
    prec = _precision(q_ref.dtype)
    q, k, v, do, lse, delta = _load_rows((q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), tl)
    p, ds = _probs_and_dscores(q, k, v, do, lse, delta, meta, opts, tl, prec)
    dv_ref[...] += _dot(p.T.astype(do.dtype), do, _NN, prec)
    dk_ref[...] += _dot(ds.T.astype(q.dtype), q, _NN, prec)


def dq_step(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, meta: MetaRefs, opts: AttentionOptions,
            tl: Tiling):
    """Add one tile pair's contribution to the dQ tile."""
    prec = _precision(q_ref.dtype)
    q, k, v, do, lse, delta = _load_rows((q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), tl)
    _, ds = _probs_and_dscores(q, k, v, do, lse, delta, meta, opts, tl, prec)
    dq_ref[...] += _dot(ds.astype(k.dtype), k, _NN, prec).reshape(dq_ref.shape)


def _dkv_kernel(*refs, opts: AttentionOptions, tl: Tiling):
    pl, _ = _pallas()
    meta, ins, (dk_ref, dv_ref) = _bwd_unpack(refs, tl)
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk_ref[...] = jnp.zeros(dk_ref.shape, jnp.float32)
        dv_ref[...] = jnp.zeros(dv_ref.shape, jnp.float32)

    when_visible(opts, meta, b, i, j, lambda: dkv_step(*ins, dk_ref, dv_ref, meta, opts, tl))


def _dq_kernel(*refs, opts: AttentionOptions, tl: Tiling):
    pl, _ = _pallas()
    meta, ins, (dq_ref,) = _bwd_unpack(refs, tl)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    when_visible(opts, meta, b, i, j, lambda: dq_step(*ins, dq_ref, meta, opts, tl))


def block_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, opts: AttentionOptions,
              config: TpuConfig):
    """One ring step backward: (dq, dk, dv) float32, from the whole-ring lse and delta."""
    pl, pltpu = _pallas()
    b, t, h, d = q.shape
    kvh, s_len = k.shape[2], k.shape[1]
    tl = tiling(q, k, opts, config)
    meta = token_meta(q_info, k_info, tl)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see no key: every P is masked to 0
    operands = align_vma(
        *meta.scalars,
        heads_major(q, kvh),
        kv_major(k),
        kv_major(v),
        heads_major(dout, kvh),
        rows_major(lse.astype(jnp.float32), kvh),
        rows_major(delta.astype(jnp.float32), kvh),
        *meta.tiles,
    )
    g, bq, bk = tl.groups, tl.block_q, tl.block_kv
    scratch_free = pltpu.PrefetchScalarGridSpec
    n_scalar = len(meta.scalars)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    def specs(q_index, k_index):
        q_block = lambda *idx: (q_index(*idx)[0], idx[1], 0, q_index(*idx)[1], 0)  # noqa: E731
        k_block = lambda *idx: (k_index(*idx)[0], idx[1], k_index(*idx)[1], 0)  # noqa: E731
        return [
            pl.BlockSpec((None, None, g, bq, d), q_block),
            pl.BlockSpec((None, None, bk, d), k_block),
            pl.BlockSpec((None, None, bk, d), k_block),
            pl.BlockSpec((None, None, g, bq, d), q_block),
            pl.BlockSpec((None, None, g, bq, 1), q_block),
            pl.BlockSpec((None, None, g, bq, 1), q_block),
            *meta_specs(tl, q_index, k_index),
        ], q_block, k_block

    # dK, dV: kv tiles outer, q tiles inner
    in_specs, _, k_block = specs(lambda bi, hi, j, i, *_: (bi, i), lambda bi, hi, j, i, *_: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, opts=opts, tl=tl),
        out_shape=[out_struct((b, kvh, s_len, d), jnp.float32, operands)] * 2,
        grid_spec=scratch_free(
            num_scalar_prefetch=n_scalar,
            grid=(b, kvh, tl.num_kv, tl.num_q),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, None, bk, d), k_block)] * 2,
        ),
        compiler_params=params,
        cost_estimate=_cost(q, k, 3, config),
        interpret=interpret_params(config),
        name="ringjax_tpu_bwd_dkv",
    )(*operands)

    # dQ: q tiles outer, kv tiles inner
    in_specs, q_block, _ = specs(lambda bi, hi, i, j, *_: (bi, i), lambda bi, hi, i, j, *_: (bi, j))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, opts=opts, tl=tl),
        out_shape=out_struct((b, kvh, g, t, d), jnp.float32, operands),
        grid_spec=scratch_free(
            num_scalar_prefetch=n_scalar,
            grid=(b, kvh, tl.num_q, tl.num_kv),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, g, bq, d), q_block),
        ),
        compiler_params=params,
        cost_estimate=_cost(q, k, 2, config),
        interpret=interpret_params(config),
        name="ringjax_tpu_bwd_dq",
    )(*operands)
    return tokens_major(dq), kv_major(dk), kv_major(dv)

"""One ring step as Pallas TPU flash-attention kernels: forward (out, lse) and backward.

Tiles, per (batch, KV head):
- a query tile holds all G = heads // kv_heads query heads of one KV head for bq
  tokens, [G, bq, D] in HBM and [G * bq, D] in the kernel, so K/V are read once
  per G query heads and never repeated (GQA);
- K/V tiles are [bk, D] and [bk, Dv] (v's head_dim may differ from q's and k's; out and dO have Dv);
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

from ringjax import _compat
from ringjax.backends.pallas_tpu.config import TpuConfig, block_size, sublanes
from ringjax.core import masks, modifiers
from ringjax.core.masks import BlockRange, Extras, TokenInfo
from ringjax.core.operands import Operands, Refs
from ringjax.core.tiles import Tiling, block_ranges, matmul_precision
from ringjax.merge import finish, finite_or_zero
from ringjax.options import AttentionOptions

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
    return _compat.tpu_interpret_params(config.detect_races) if config.interpret else False


def reset_interpreter() -> None:
    """Clear the Pallas TPU interpreter's global state (needed after a kernel raised in it)."""
    _, pltpu = _pallas()
    pltpu.reset_tpu_interpret_mode_state()


def races_found() -> bool:
    """Whether the interpreter's race detector (TpuConfig(detect_races=True)) reported a race
    since the last `reset_interpreter`; each race is also printed when found."""
    return _compat.tpu_races_found()


def _dot(a, b, dims, prec):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=prec)


def tiling(q, k, v, opts: AttentionOptions, config: TpuConfig) -> Tiling:
    align = sublanes(jnp.dtype(q.dtype).name)
    bq = block_size(q.shape[1], config.block_q, opts, align)
    bk = block_size(k.shape[1], config.block_kv, opts, align)
    return Tiling.of(q, k, v, bq, bk, opts.has_segments)


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
    q seg lo/hi (2*B*nq), k seg lo/hi (2*B*nk), and with sink tokens too the keys' lowest offset in their
    document (B*nk)]; tiles: q positions [nq, bq, 1], k positions [nk, 1, bk] and with segments ids
    [B, nq, bq, 1], [B, nk, 1, bk] (with sink tokens doubled, a key's low bit set where it is one of its
    document's first `num_sink_tokens`: `MetaRefs.visible` reads it back).
    """

    scalars: tuple
    tiles: tuple


def _side(info: TokenInfo, size: int, column: bool, sink_tokens: int = 0):
    """Range scalars and mask tiles of the queries (tiles [n, size, 1]) or keys (tiles [n, 1, size]);
    `sink_tokens`: those of each packed document (`Meta`)."""
    r = block_ranges(info, size)
    shape = (-1, size, 1) if column else (-1, 1, size)

    def flat(lo, hi):
        return jnp.concatenate([lo.reshape(-1), hi.reshape(-1)]).astype(jnp.int32)

    scalars, tiles = [flat(r.pos_lo, r.pos_hi)], [info.pos.astype(jnp.int32).reshape(shape)]
    if info.seg is not None:
        scalars.append(flat(r.seg_lo, r.seg_hi))
        seg = info.seg.astype(jnp.int32)
        if sink_tokens:
            seg = masks.flag_sink_ids(info.seg, info.segpos, sink_tokens, keys=not column)
            if not column:
                scalars.append(r.segpos_lo.reshape(-1).astype(jnp.int32))
        tiles.append(seg.reshape(info.seg.shape[0], *shape))
    return scalars, tiles


def token_meta(q_info: TokenInfo, k_infos: list[TokenInfo], tl: Tiling, stacked: bool = False,
               sink_tokens: int = 0) -> Meta:
    """Meta of one step, or with `stacked` of every source shard in `k_infos` (the fused ring):
    K range scalars then concatenated per source, K tiles stacked on a leading source axis. `sink_tokens`: those
    of each packed document, where segment ids come (else 0)."""
    sink_tokens = sink_tokens if q_info.seg is not None else 0
    q_scalars, q_tiles = _side(q_info, tl.block_q, column=True, sink_tokens=sink_tokens)
    k_sides = [_side(info, tl.block_kv, column=False, sink_tokens=sink_tokens) for info in k_infos]
    if stacked:
        k_scalars = [jnp.concatenate(parts) for parts in zip(*(side[0] for side in k_sides))]
        k_tiles = [jnp.stack(parts) for parts in zip(*(side[1] for side in k_sides))]
    else:
        ((k_scalars, k_tiles),) = k_sides
    # order: q positions, k positions, then q and k segment ids
    return Meta(tuple(q_scalars[:1] + k_scalars[:1] + q_scalars[1:] + k_scalars[1:]),
                tuple(q_tiles[:1] + k_tiles[:1] + q_tiles[1:] + k_tiles[1:]))


def grid_order(q_first: bool):
    """Index-map adapter: f(b, h, i, j) for a grid (b, h, i, j) if `q_first`, else (b, h, j, i);
    b batch, h KV head, i query tile, j key tile (extra arguments, scalar refs, are ignored)."""
    if q_first:
        return lambda f: (lambda b, h, i, j, *_: f(b, h, i, j))
    return lambda f: (lambda b, h, j, i, *_: f(b, h, i, j))


def q_spec(tl: Tiling, last: int, q_first: bool):
    """[G, bq, last] tiles of a [B, KVH, G, T, last] array (queries, dO, outputs; last 1: lse, delta)."""
    pl, _ = _pallas()
    index = grid_order(q_first)(lambda b, h, i, j: (b, h, 0, i, 0))
    return pl.BlockSpec((None, None, tl.groups, tl.block_q, last), index)


def meta_specs(tl: Tiling, q_first: bool, src=None):
    """BlockSpecs of Meta.tiles; with `src`, K tiles are stacked over source shards (the fused ring)
    and the tiles of shard `src` are read."""
    pl, _ = _pallas()
    at = grid_order(q_first)
    lead = () if src is None else (None,)

    def k_index(*index):
        return index if src is None else (src, *index)

    specs = [pl.BlockSpec((None, tl.block_q, 1), at(lambda b, h, i, j: (i, 0, 0))),
             pl.BlockSpec((*lead, None, 1, tl.block_kv), at(lambda b, h, i, j: k_index(j, 0, 0)))]
    if tl.has_segments:
        specs += [pl.BlockSpec((None, None, tl.block_q, 1), at(lambda b, h, i, j: (b, i, 0, 0))),
                  pl.BlockSpec((*lead, None, None, 1, tl.block_kv), at(lambda b, h, i, j: k_index(b, j, 0, 0)))]
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
        """Block ranges of query tile i and key tile j; without segments a token's offset (the sink rule's) is its
        position, so the keys' lowest offset is their lowest position."""
        nq, nk = self.tl.num_q, self.tl.num_kv
        qr, kr = self.scalar_refs[0], self.scalar_refs[1]
        kb = self.src * 2 * nk
        if not self.tl.has_segments:
            k_lo = kr[kb + j]
            return BlockRange(qr[i], qr[nq + i], None, None), BlockRange(k_lo, kr[kb + nk + j], None, None, k_lo)
        qs, ks = self.scalar_refs[2], self.scalar_refs[3]
        nb = qs.shape[0] // (2 * nq)
        sb = self.src * 2 * nb * nk
        # sink tokens of packed documents: the keys' lowest offsets (`Meta`)
        k_off = self.scalar_refs[4][self.src * nb * nk + b * nk + j] if len(self.scalar_refs) > 4 else None
        q_rng = BlockRange(qr[i], qr[nq + i], qs[b * nq + i], qs[nb * nq + b * nq + i])
        k_rng = BlockRange(kr[kb + j], kr[kb + nk + j], ks[sb + b * nk + j], ks[sb + nb * nk + b * nk + j], k_off)
        return q_rng, k_rng

    def distance(self):
        """ALiBi's distance of the current tile pair, -|i - j| as float32 [bq, bk] (`modifiers`)."""
        return modifiers.alibi_distance_pairs(self.tile_refs[0][...], self.tile_refs[1][...])

    def visible(self, opts: AttentionOptions):
        """Exact mask of the current tile pair, bool [bq, bk]."""
        qpos, kpos = self.tile_refs[0][...], self.tile_refs[1][...]
        qseg = kseg = None
        if self.tl.has_segments:
            qseg, kseg = self.tile_refs[2][...], self.tile_refs[3][...]
        return masks.visible_pairs(opts, qpos, kpos, *masks.tile_ids(opts, qpos, kpos, qseg, kseg))  # ids: `Meta`


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


def alibi_bias(s, r, meta: MetaRefs, tl: Tiling):
    """[G * bq, bk] logits plus ALiBi's slope x distance (a no-op without ALiBi), and the distance tile of
    its rows (None without): each of the G query heads of the rows has its slope in the `slopes` column."""
    slopes = r.get("slopes") if r is not None else None
    if slopes is None:
        return s, None
    dist = meta.distance()
    rows = (slopes[...].reshape(tl.groups, tl.block_q, 1) * dist[None]).reshape(s.shape)
    return s + rows, dist


def dropout_scale(r, meta: MetaRefs, opts: AttentionOptions, tl: Tiling):
    """[G * bq, bk] float32 keep / (1 - rate) of the current tile pair by dropout's counter-based hash
    (`modifiers`), what P (and in the backward dP) is multiplied by; None without dropout. Each of the G query
    heads of the rows has its key (seed, batch, head) in `dropout_keys`; the positions come from the mask tiles."""
    keys = r.get("dropout_keys") if r is not None else None
    if keys is None:
        return None
    qpos, kpos = meta.tile_refs[0][...], meta.tile_refs[1][...]
    q_term, k_term = modifiers.dropout_terms(keys[...], qpos[None], kpos[None])  # [1, bq, 1], [G, 1, bk]
    keep = modifiers.dropout_keep_terms(opts.dropout_rate, q_term, k_term).reshape(tl.rows, -1)
    return jnp.where(keep, 1.0 / (1.0 - opts.dropout_rate), 0.0)


def _scaled(x, scale):
    return x if scale is None else x * scale


def key_spec(tl: Tiling, q_first: bool):
    """The [G, 1, 1] dropout keys of a tile's query heads, of [B, KVH, G, 1, 1]."""
    pl, _ = _pallas()
    return pl.BlockSpec((None, None, tl.groups, 1, 1), grid_order(q_first)(lambda b, h, i, j: (b, h, 0, 0, 0)))


def dropout_keys(extras: Extras, tl: Tiling):
    """uint32 [B, KVH, G, 1, 1]: the hash's key of each (batch row, query head), seed and global head folded
    in (`modifiers.dropout_key`)."""
    batch = jnp.arange(tl.batch, dtype=jnp.int32)[:, None]
    heads = jnp.arange(tl.heads, dtype=jnp.int32)[None, :]
    seed = extras.dropout_seed
    key = modifiers.dropout_key(seed[0], seed[1], modifiers.dropout_batch_head(extras.head_slice, batch, heads,
                                                                              tl.heads))
    return key.reshape(tl.batch, tl.kv_heads, tl.groups, 1, 1)


def extra_operands(ins: Operands, extras: Extras, tl: Tiling, q_first: bool) -> Operands:
    """`ins` with ALiBi's slope column and dropout's keys where the call has them."""
    if extras.alibi_slopes is not None:
        ins.add("slopes", slope_rows(extras, tl), slope_spec(tl, q_first))
    if extras.dropout_seed is not None:
        ins.add("dropout_keys", dropout_keys(extras, tl), key_spec(tl, q_first))
    return ins


def slope_spec(tl: Tiling, q_first: bool):
    """[G, bq, 1] tiles of the per-row slopes [KVH, G, bq, 1] (the same for every query tile)."""
    pl, _ = _pallas()
    return pl.BlockSpec((None, tl.groups, tl.block_q, 1), grid_order(q_first)(lambda b, h, i, j: (h, 0, 0, 0)))


def slope_rows(extras: Extras, tl: Tiling):
    """ALiBi's slopes [H] as the column the query tiles read, [KVH, G, bq, 1] float32."""
    slopes = extras.alibi_slopes.astype(jnp.float32).reshape(tl.kv_heads, tl.groups, 1, 1)
    return jnp.broadcast_to(slopes, (tl.kv_heads, tl.groups, tl.block_q, 1))


# ---------------------------------------------------------------- forward


def online_softmax_step(q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, meta: MetaRefs, opts: AttentionOptions,
                        tl: Tiling, r=None):
    """Fold one K/V tile into the running max m, denominator l and unnormalised output acc; `r`: the kernel's
    refs, for ALiBi's slopes and dropout's keys (None: neither)."""
    prec = matmul_precision(q_ref.dtype)
    q = q_ref[...].reshape(tl.rows, tl.head_dim)
    v = v_ref[...]
    s, _ = alibi_bias(modifiers.logits(_dot(q, k_ref[...], _NT, prec), opts), r, meta, tl)
    if masks.may_skip(opts):
        s = mask_rows(s, meta.visible(opts), tl.groups, -jnp.inf)
    m_prev = m_ref[...].reshape(tl.rows, 1)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    m_safe = finite_or_zero(m_new)  # rows with no key yet
    p = jnp.exp(s - m_safe)  # exactly 0 where masked
    alpha = jnp.exp(m_prev - m_safe)
    # dropout leaves the normaliser whole
    l_ref[...] = (alpha * l_ref[...].reshape(tl.rows, 1) + p.sum(axis=1, keepdims=True)).reshape(l_ref.shape)
    m_ref[...] = m_new.reshape(m_ref.shape)
    pv = _dot(_scaled(p, dropout_scale(r, meta, opts, tl)).astype(v.dtype), v, _NN, prec)
    acc = alpha * acc_ref[...].reshape(tl.rows, tl.v_head_dim) + pv
    acc_ref[...] = acc.reshape(acc_ref.shape)


def _fwd_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling):
    pl, _ = _pallas()
    r = Refs(layout, refs)
    meta = MetaRefs(tl, r.scalars, r.tiles)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        r.m[...] = jnp.full(r.m.shape, -jnp.inf, jnp.float32)
        r.l[...] = jnp.zeros(r.l.shape, jnp.float32)
        r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)

    when_visible(opts, meta, b, i, j, lambda: online_softmax_step(r.q, r.k, r.v, r.m, r.l, r.acc, meta, opts, tl, r))

    @pl.when(j == tl.num_kv - 1)
    def _finish():
        out, lse = finish(r.acc[...], r.m[...], r.l[...])
        r.out[...] = out.reshape(r.out.shape)
        r.lse[...] = lse.reshape(r.lse.shape)


def _launch(kernel, name: str, tl: Tiling, opts: AttentionOptions, config: TpuConfig, meta: Meta, ins: Operands,
            outs: Operands, *, q_first: bool, contracted: int, scratch: Operands | None = None):
    """One pallas_call over grid (B, KVH, nq, nk) if `q_first` else (B, KVH, nk, nq), the last axis
    sequential; `meta.scalars` are prefetched to SMEM, `outs` holds (shape, dtype) pairs. `contracted`: the
    head_dims the kernel's tile matmuls contract or produce, summed (its FLOPs per score, halved)."""
    pl, pltpu = _pallas()
    scratch = scratch or Operands()
    operands = _compat.align_vma(*meta.scalars, *ins.arrays)
    layout = (("scalars", len(meta.scalars)),) + ins.layout + outs.layout + scratch.layout
    tiles = (tl.num_q, tl.num_kv) if q_first else (tl.num_kv, tl.num_q)
    itemsize = jnp.dtype(ins.arrays[0].dtype).itemsize
    width = tl.head_dim + tl.v_head_dim
    q_bytes, kv_bytes = tl.batch * tl.q_len * tl.heads * width, tl.batch * tl.kv_len * tl.kv_heads * width
    cost = pl.CostEstimate(flops=int(2 * contracted * tl.batch * tl.heads * tl.q_len * tl.kv_len),
                           transcendentals=int(tl.batch * tl.heads * tl.q_len * tl.kv_len),
                           bytes_accessed=int((q_bytes + kv_bytes * 2) * itemsize))
    return pl.pallas_call(
        functools.partial(kernel, layout=layout, opts=opts, tl=tl),
        out_shape=[_compat.struct_like(shape, dtype, *operands) for shape, dtype in outs.arrays],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta.scalars),
            grid=(tl.batch, tl.kv_heads, *tiles),
            in_specs=ins.specs,
            out_specs=outs.specs,
            scratch_shapes=scratch.arrays,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret_params(config),
        name=name,
    )(*operands)


def _k_spec(tl: Tiling, q_first: bool, width: int):
    """[bk, width] tiles of a [B, KVH, S, width] array (K, V, dK, dV)."""
    pl, _ = _pallas()
    return pl.BlockSpec((None, None, tl.block_kv, width), grid_order(q_first)(lambda b, h, i, j: (b, h, j, 0)))


def chunks_as_segments(opts: AttentionOptions, batch: int, *infos: TokenInfo):
    """(opts, *infos) with chunks (`chunk_size` without `segment_ids`) as segment ids numbering them, position //
    chunk_size: the kernels then compare an id per score instead of dividing two positions; the ring's plan
    keeps the chunks (it runs only the steps they reach). Per-document chunks come as segments already."""
    if opts.chunk_size is None or opts.has_segments or opts.num_sink_tokens:  # sinks: refused (`config.refusal`)
        return (opts, *infos)
    c = opts.chunk_size
    ids = [info._replace(seg=jnp.broadcast_to((info.pos // c).astype(jnp.int32)[None], (batch, info.pos.shape[0])))
           for info in infos]
    return (dataclasses.replace(opts, chunk_size=None, has_segments=True), *ids)


def block_fwd(q, k, v, q_info: TokenInfo, k_info: TokenInfo, extras: Extras, opts: AttentionOptions,
              config: TpuConfig):
    """One ring step forward: (out f32 [B,T,H,Dv], lse f32 [B,H,T])."""
    _, pltpu = _pallas()
    opts, q_info, k_info = chunks_as_segments(opts, q.shape[0], q_info, k_info)
    tl = tiling(q, k, v, opts, config)
    meta = token_meta(q_info, [k_info], tl, sink_tokens=opts.num_sink_tokens)
    b, kvh, g, t, d, dv = tl.batch, tl.kv_heads, tl.groups, tl.q_len, tl.head_dim, tl.v_head_dim
    ins = (Operands().add("q", heads_major(q, kvh), q_spec(tl, d, True))
           .add("k", kv_major(k), _k_spec(tl, True, d)).add("v", kv_major(v), _k_spec(tl, True, dv))
           .add_group("tiles", meta.tiles, meta_specs(tl, True)))
    extra_operands(ins, extras, tl, True)
    outs = (Operands().add("out", ((b, kvh, g, t, dv), jnp.float32), q_spec(tl, dv, True))
            .add("lse", ((b, kvh, g, t, 1), jnp.float32), q_spec(tl, 1, True)))
    scratch = (Operands().add("m", pltpu.VMEM((tl.rows, 1), jnp.float32))
               .add("l", pltpu.VMEM((tl.rows, 1), jnp.float32)).add("acc", pltpu.VMEM((tl.rows, dv), jnp.float32)))
    out, lse = _launch(_fwd_kernel, "ringjax_tpu_fwd", tl, opts, config, meta, ins, outs, q_first=True,
                       contracted=d + dv, scratch=scratch)
    return tokens_major(out), lse.reshape(b, tl.heads, t)


# ---------------------------------------------------------------- backward


def _probs_and_dscores(q, k, v, do, lse, delta, meta, opts, tl, prec, r):
    """(P as dV takes it, dS, dS by the logits, ALiBi's distance tile or None) for one tile pair, [G*bq, bk] f32:
    dS = P * (dP - delta) * dlogits/dqk, by the logits (ALiBi's slope gradient sums it times the distance)
    without the last factor; with dropout, P and dP are the kept ones scaled."""
    s, slope = modifiers.logits_and_slope(_dot(q, k, _NT, prec), opts)
    s, dist = alibi_bias(s, r, meta, tl)
    p = jnp.exp(s - lse)
    if masks.may_skip(opts):
        p = mask_rows(p, meta.visible(opts), tl.groups, 0.0)
    dp = _dot(do, v, _NT, prec)
    # d out / d logit = P * (keep/(1-rate) * dP - delta): dropout enters through dP, and dV takes the dropped P
    keep = dropout_scale(r, meta, opts, tl)  # one hash per tile pair for both
    ds_logit = p * (_scaled(dp, keep) - delta)
    return _scaled(p, keep), ds_logit * slope, ds_logit, dist


def _load_rows(r, tl: Tiling):
    """q, k, v, dO, lse, delta of the current tile pair from refs named so, queries as [G * bq, .] rows."""
    rows = tl.rows
    return (r.q[...].reshape(rows, tl.head_dim), r.k[...], r.v[...], r.do[...].reshape(rows, tl.v_head_dim),
            r.lse[...].reshape(rows, 1), r.delta[...].reshape(rows, 1))


def grad_step(r, meta: MetaRefs, opts: AttentionOptions, tl: Tiling, *, dq=None, dk=None, dv=None, dslope=None):
    """Add one tile pair's contribution to the dQ tile `dq` (and with ALiBi to the rows' slope gradient
    `dslope`), or to the dK and dV tiles `dk`, `dv`; `r` names the q, k, v, do, lse, delta (and slopes) refs."""
    prec = matmul_precision(r.q.dtype)
    q, k, v, do, lse, delta = _load_rows(r, tl)
    p, ds, ds_logit, dist = _probs_and_dscores(q, k, v, do, lse, delta, meta, opts, tl, prec, r)
    if dslope is not None:
        by_row = (ds_logit.reshape(tl.groups, tl.block_q, -1) * dist[None]).sum(axis=2, keepdims=True)
        dslope[...] += by_row.reshape(dslope.shape)
    if dq is not None:
        dq[...] += _dot(ds.astype(k.dtype), k, _NN, prec).reshape(dq.shape)
    if dk is not None:
        dv[...] += _dot(p.T.astype(do.dtype), do, _NN, prec)
        dk[...] += _dot(ds.T.astype(q.dtype), q, _NN, prec)


def _grad_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling):
    """dQ of a query tile over the key tiles (grid (B, KVH, nq, nk)) if the layout names a "dq" output,
    else dK and dV of a key tile over the query tiles (grid (B, KVH, nk, nq))."""
    pl, _ = _pallas()
    r = Refs(layout, refs)
    meta = MetaRefs(tl, r.scalars, r.tiles)
    b, outer, inner = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    wrt_q = r.get("dq") is not None
    i, j = (outer, inner) if wrt_q else (inner, outer)
    grads = {"dq": r.dq} if wrt_q else {"dk": r.dk, "dv": r.dv}
    if wrt_q and r.get("dslope") is not None:
        grads["dslope"] = r.dslope

    @pl.when(inner == 0)
    def _init():
        for ref in grads.values():
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    when_visible(opts, meta, b, i, j, lambda: grad_step(r, meta, opts, tl, **grads))


def backward_operands(tl: Tiling, q, dout, lse, delta, q_first: bool | None) -> Operands:
    """q, dO, lse and delta as the backward kernels read them ([B, KVH, G, T, .]), with BlockSpecs for
    the grid order (none if `q_first` is None: the fused ring keeps its operands in HBM).

    Rows that see no key have lse -inf: they are shifted by 0 instead, every P of theirs is masked to 0.
    """
    kvh = tl.kv_heads

    def spec(last):
        return None if q_first is None else q_spec(tl, last, q_first)

    return (Operands().add("q", heads_major(q, kvh), spec(tl.head_dim))
            .add("do", heads_major(dout, kvh), spec(tl.v_head_dim))
            .add("lse", rows_major(finite_or_zero(lse).astype(jnp.float32), kvh), spec(1))
            .add("delta", rows_major(delta.astype(jnp.float32), kvh), spec(1)))


def block_bwd(q, k, v, dout, lse, delta, q_info: TokenInfo, k_info: TokenInfo, extras: Extras,
              opts: AttentionOptions, config: TpuConfig):
    """One ring step backward: (dq, dk, dv, d alibi_slopes or None) float32, from the whole-ring lse and delta.
    ALiBi's slope gradient is summed per query row in the dQ kernel, then over rows here."""
    opts, q_info, k_info = chunks_as_segments(opts, q.shape[0], q_info, k_info)
    tl = tiling(q, k, v, opts, config)
    meta = token_meta(q_info, [k_info], tl, sink_tokens=opts.num_sink_tokens)
    d, d_v = tl.head_dim, tl.v_head_dim
    alibi = extras.alibi_slopes is not None

    def operands(q_first: bool) -> Operands:
        ins = backward_operands(tl, q, dout, lse, delta, q_first)
        ins.add("k", kv_major(k), _k_spec(tl, q_first, d)).add("v", kv_major(v), _k_spec(tl, q_first, d_v))
        return extra_operands(ins.add_group("tiles", meta.tiles, meta_specs(tl, q_first)), extras, tl, q_first)

    # dK, dV: kv tiles outer, q tiles inner; S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q
    outs = Operands()
    for name, width in (("dk", d), ("dv", d_v)):
        outs.add(name, ((tl.batch, tl.kv_heads, tl.kv_len, width), jnp.float32), _k_spec(tl, False, width))
    dk, dv = _launch(_grad_kernel, "ringjax_tpu_bwd_dkv", tl, opts, config, meta, operands(False), outs,
                     q_first=False, contracted=2 * d + 2 * d_v)
    # dQ: q tiles outer, kv tiles inner; S, dP, dQ += dS K
    dq_shape = ((tl.batch, tl.kv_heads, tl.groups, tl.q_len, d), jnp.float32)
    outs = Operands().add("dq", dq_shape, q_spec(tl, d, True))
    if alibi:
        outs.add("dslope", ((tl.batch, tl.kv_heads, tl.groups, tl.q_len, 1), jnp.float32), q_spec(tl, 1, True))
    dq, *dslope = _launch(_grad_kernel, "ringjax_tpu_bwd_dq", tl, opts, config, meta, operands(True), outs,
                          q_first=True, contracted=2 * d + d_v)
    dslopes = dslope[0].sum(axis=(0, 3, 4)).reshape(tl.heads) if alibi else None
    return tokens_major(dq), kv_major(dk), kv_major(dv), dslopes

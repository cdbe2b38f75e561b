"""The forward ring as one Pallas TPU kernel: K/V move by remote DMA while the current shard is computed.

One pallas_call per device, grid = (ring steps,). At step s a device computes its
queries against the K/V shard in slot s % 2 of a double buffer in HBM while a
remote DMA sends that same slot to the right neighbour's other slot, so the
transfer hides under the step's compute. Per step:

1. wait until the K/V sent by the left neighbour last step has landed in slot s % 2;
2. (s + 1 < steps) wait for the right neighbour's go-ahead that its slot (s + 1) % 2
   is free (not needed at s = 0: that slot is unused), then start sending slot s % 2;
3. run the flash-attention tiles (an inner `emit_pipeline` over batch, KV head, q tile
   and kv tile) unless the mask empties the whole step; the online-softmax state
   (max, denominator, unnormalised output) persists in HBM across steps;
4. wait until the send has left slot s % 2, then tell the left neighbour that slot
   s % 2 may be overwritten (only if it will send again).

The step is the same double-buffered handshake as the all-reduce in the Pallas TPU
distributed guide: a device never writes a slot its neighbour may still read. At
entry a double barrier with both neighbours makes sure they are inside the kernel
(and not still in a previous call) before any remote write. K positions of every
shard are static tables and segment ids are all-gathered once, so only K/V travel.

The backward pass is the ppermute ring of block kernels (`ring_fwd` hook of
ringjax.ring.BlockKernel); a fused backward is not implemented.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax import masks
from ringjax.layouts import local_positions
from ringjax.masks import TokenInfo, block_range
from ringjax.options import AttentionOptions
from ringjax.pallas.tpu import block
from ringjax.pallas.tpu.block import MetaRefs, Tiling, align_vma, online_softmax_step, out_struct
from ringjax.pallas.tpu.config import TpuConfig
from ringjax.schedule import ring_plan, steps_may_be_empty


def _shift(x, opts: AttentionOptions, d: int):
    """Device r receives the value of device r - d (mod N)."""
    n = opts.axis_size
    d %= n
    if d == 0:
        return x
    return lax.ppermute(x, opts.axis_name, [(i, (i + d) % n) for i in range(n)])


def _ranges(x, axis):
    return jnp.concatenate([x.min(axis=axis).reshape(-1), x.max(axis=axis).reshape(-1)])


def _tables(opts: AttentionOptions, tl: Tiling, t: int, shard, plan, q_seg, kv_seg):
    """Scalar tables (SMEM) and tile tables (HBM) over every source shard.

    scalars: live[steps], q ranges [2*nq], k ranges [N * 2*nk], and with segments
    q segment ranges [2*B*nq], k segment ranges [N * 2*B*nk]; tiles: q positions
    [nq, bq, 1], k positions [N, nk, 1, bk], and with segments [B, nq, bq, 1],
    [N, B, nk, 1, bk].
    """
    n, nq, bq, nk, bk = opts.axis_size, tl.num_q, tl.block_q, tl.num_kv, tl.block_kv
    pos_all = np.stack([local_positions(opts.layout, s, n, t, xp=np) for s in range(n)]).astype(np.int32)
    q_pos = jnp.asarray(pos_all)[shard]
    seg_all = None
    if tl.has_segments:
        seg_all = lax.all_gather(kv_seg, opts.axis_name) if opts.axis_name is not None else kv_seg[None]
        seg_all = seg_all.astype(jnp.int32)  # [N, B, S]
    q_info = TokenInfo(q_pos, q_seg)
    live = []
    for step in range(plan.num_steps):
        src = plan.source(shard, step, n)
        k_info = TokenInfo(jnp.asarray(pos_all)[src], None if seg_all is None else seg_all[src])
        live.append(masks.maybe_visible(opts, block_range(q_info), block_range(k_info)))
    kpos = jnp.asarray(pos_all.reshape(n, nk, bk))
    scalars = [
        jnp.stack(live).astype(jnp.int32),
        _ranges(q_pos.reshape(nq, bq), 1).astype(jnp.int32),
        jnp.concatenate([_ranges(kpos[s], 1) for s in range(n)]).astype(jnp.int32),
    ]
    tiles = [q_pos.reshape(nq, bq, 1), kpos[:, :, None, :]]
    if tl.has_segments:
        b = q_seg.shape[0]
        qseg = q_seg.astype(jnp.int32).reshape(b, nq, bq)
        kseg = seg_all.reshape(n, b, nk, bk)
        scalars += [_ranges(qseg, 2), jnp.concatenate([_ranges(kseg[s], 2) for s in range(n)])]
        tiles += [qseg[..., None], kseg[:, :, :, None, :]]
    return scalars, tiles


def _barrier(opts: AttentionOptions, left, right):
    """Both neighbours are inside this kernel call (two rounds: none is still in the previous one)."""
    pl, pltpu = block._pallas()

    def round_trip(sem):
        for neighbour in (left, right):
            pl.semaphore_signal(sem, 1, device_id={opts.axis_name: neighbour},
                                device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(sem, 2)

    round_trip(pltpu.get_barrier_semaphore())
    pl.run_scoped(round_trip, pltpu.SemaphoreType.REGULAR)


def _wait_for_capacity(capacity):
    """Block until the right neighbour says the slot we are about to write is free."""
    pl, _ = block._pallas()
    pl.semaphore_wait(capacity, 1)


def _grant_capacity(capacity, opts: AttentionOptions, left):
    """Tell the left neighbour it may overwrite the slot we just finished with."""
    pl, _ = block._pallas()
    pl.semaphore_signal(capacity, 1, device_id={opts.axis_name: left}, device_id_type=pl.DeviceIdType.MESH)


def _kernel(*refs, opts: AttentionOptions, tl: Tiling, num_steps: int, offset: int):
    pl, pltpu = block._pallas()
    n_tables = 4 if tl.has_segments else 2
    ids_ref, live_ref, scalar_refs = refs[0], refs[1], refs[2 : 2 + n_tables]
    refs = refs[2 + n_tables :]
    q_ref, kv0_ref = refs[:2]
    tile_refs = refs[2 : 2 + n_tables]
    acc_ref, m_ref, l_ref, kv_buf, send_sems, recv_sems, local_sem, capacity = refs[2 + n_tables :]

    n = opts.axis_size
    step = pl.program_id(0)
    slot = step % 2
    # ring indices come from SMEM, not lax.axis_index: the interpreter re-evaluates axis_index
    # as a value varying over the mesh axis, which mixes badly with constants under check_vma
    left, right = ids_ref[1], ids_ref[2]
    src = (ids_ref[0] + offset - step + n) % n  # whose K/V slot `slot` holds now
    more = step + 1 < num_steps

    def send(to_slot):
        return pltpu.make_async_remote_copy(
            kv_buf.at[slot], kv_buf.at[to_slot], send_sems.at[slot], recv_sems.at[to_slot],
            device_id={opts.axis_name: right}, device_id_type=pl.DeviceIdType.MESH,
        )

    @pl.when(step == 0)
    def _start():
        if num_steps > 1:
            _barrier(opts, left, right)
        copy = pltpu.make_async_copy(kv0_ref, kv_buf.at[0], local_sem)
        copy.start()
        copy.wait()

    @pl.when(step > 0)
    def _arrived():
        send(slot).wait_recv()  # the left neighbour's DMA of last step, into our slot `slot`

    @pl.when(more)
    def _send():
        @pl.when(step > 0)
        def _():
            _wait_for_capacity(capacity)

        send(1 - slot).start()

    g, bq, bk, d = tl.groups, tl.block_q, tl.block_kv, tl.head_dim
    meta_shape = lambda bi, hi, i, j: (bi, hi, 0, i, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), meta_shape),
        pl.BlockSpec((None, None, None, None, bk, d), lambda bi, hi, i, j: (slot, 0, bi, hi, j, 0)),
        pl.BlockSpec((None, None, None, None, bk, d), lambda bi, hi, i, j: (slot, 1, bi, hi, j, 0)),
        pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (i, 0, 0)),
        pl.BlockSpec((None, None, 1, bk), lambda bi, hi, i, j: (src, j, 0, 0)),
    ]
    if tl.has_segments:
        in_specs += [
            pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i, j: (bi, i, 0, 0)),
            pl.BlockSpec((None, None, None, 1, bk), lambda bi, hi, i, j: (src, bi, j, 0, 0)),
        ]
    state_specs = [
        pl.BlockSpec((None, None, g, bq, d), meta_shape),
        pl.BlockSpec((None, None, g, bq, 1), meta_shape),
        pl.BlockSpec((None, None, g, bq, 1), meta_shape),
    ]

    def tile_body(q_t, k_t, v_t, *rest):
        tiles, (acc_in, m_in, l_in, acc_t, m_t, l_t) = rest[:n_tables], rest[n_tables:]
        bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        meta = MetaRefs(tl, scalar_refs, tiles, src=src)

        @pl.when(j == 0)
        def _load_state():
            @pl.when(step == 0)
            def _():
                m_t[...] = jnp.full(m_t.shape, -jnp.inf, jnp.float32)
                l_t[...] = jnp.zeros(l_t.shape, jnp.float32)
                acc_t[...] = jnp.zeros(acc_t.shape, jnp.float32)

            @pl.when(step > 0)
            def _():
                m_t[...] = m_in[...]
                l_t[...] = l_in[...]
                acc_t[...] = acc_in[...]

        def body():
            online_softmax_step(q_t, k_t, v_t, m_t, l_t, acc_t, meta, opts, tl)

        block.when_visible(opts, meta, bi, i, j, body)

    pipeline = pltpu.emit_pipeline(
        tile_body, grid=(q_ref.shape[0], q_ref.shape[1], tl.num_q, tl.num_kv),
        in_specs=in_specs + state_specs, out_specs=state_specs,
    )

    def compute():
        pipeline(q_ref, kv_buf, kv_buf, *tile_refs, acc_ref, m_ref, l_ref, acc_ref, m_ref, l_ref)

    if steps_may_be_empty(opts):
        # skip steps the mask empties; step 0 always runs: it initialises the state
        pl.when(jnp.logical_or(live_ref[step] != 0, step == 0))(compute)
    else:
        compute()

    @pl.when(more)
    def _sent():
        send(1 - slot).wait_send()

        # the left neighbour sends again next step, into our slot `slot`: it is free now
        @pl.when(step + 2 < num_steps)
        def _():
            _grant_capacity(capacity, opts, left)


def fused_forward(q, k, v, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """The whole forward ring in one kernel: (out f32 [B,T,H,D], lse f32 [B,H,T]) before sinks."""
    pl, pltpu = block._pallas()
    block.assume_tpu_tiling()  # the inner pipeline asks for the TPU's tiling while tracing
    b, t, h, d = q.shape
    kvh = k.shape[2]
    n = opts.axis_size
    tl = block.tiling(q, k, opts, config)
    plan = ring_plan(opts, t)
    shard = lax.axis_index(opts.axis_name) if opts.axis_name is not None else jnp.int32(0)
    kv0 = _shift(jnp.stack([block.kv_major(k), block.kv_major(v)]), opts, -plan.offset)
    scalars, tiles = _tables(opts, tl, t, shard, plan, q_seg, kv_seg)
    ids = jnp.stack([shard, (shard - 1) % n, (shard + 1) % n]).astype(jnp.int32)
    scalars = [ids] + scalars
    operands = align_vma(*scalars, block.heads_major(q, kvh), kv0, *tiles)
    g = tl.groups
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = [
        out_struct((b, kvh, g, t, d), jnp.float32, operands),
        out_struct((b, kvh, g, t, 1), jnp.float32, operands),
        out_struct((b, kvh, g, t, 1), jnp.float32, operands),
        out_struct((2,) + kv0.shape, kv0.dtype, operands),  # the K/V double buffer, in HBM
    ]
    params = dict(dimension_semantics=("arbitrary",))
    if plan.num_steps > 1:
        params["collective_id"] = 0  # the barrier semaphore of the entry barrier
    acc, m, denom, _ = pl.pallas_call(
        functools.partial(_kernel, opts=opts, tl=tl, num_steps=plan.num_steps, offset=plan.offset),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(plan.num_steps,),
            in_specs=[any_spec] * (2 + len(tiles)),
            out_specs=[any_spec] * 4,
            scratch_shapes=[
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.REGULAR,
            ],
        ),
        compiler_params=pltpu.CompilerParams(**params),
        interpret=block.interpret_params(config),
        name="ringjax_tpu_fused_ring_fwd",
    )(*operands)
    seen = denom > 0.0
    safe = jnp.where(seen, denom, 1.0)
    out = block.tokens_major(acc / safe)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf).reshape(b, h, t)
    return out, lse

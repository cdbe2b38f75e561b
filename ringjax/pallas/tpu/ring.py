"""The ring as one Pallas TPU kernel per direction: K/V (and dK/dV) move by remote DMA beside the compute.

Forward: one pallas_call per device, grid = (ring steps,). At step s a device computes
its queries against the K/V shard in slot s % 2 of a double buffer in HBM while a
remote DMA sends that slot to the right neighbour's other slot. Per step:

1. wait until the K/V the left neighbour sent last step has landed in slot s % 2;
2. (s + 1 < steps) wait for the right neighbour's go-ahead that its slot (s + 1) % 2
   is free (not needed at s = 0: that slot is unused), then start sending slot s % 2;
3. run the flash-attention tiles (an inner `emit_pipeline` over batch, KV head, q tile
   and kv tile) unless the mask empties the whole step; the online-softmax state
   (max, denominator, unnormalised output) persists in HBM across steps;
4. wait until the send has left slot s % 2, then tell the left neighbour that slot
   s % 2 may be overwritten (only if it will send again).

This is the double-buffered handshake of the all-reduce in the Pallas TPU distributed
guide: a device never writes a slot its neighbour may still read. At entry a double
barrier with both neighbours makes sure they are inside the kernel (and not still in a
previous call) before any remote write. K positions of every shard are static tables
and segment ids are all-gathered once, so only K/V travel.

Backward: K/V rotate the same way. The float32 dK/dV partial sum of each shard follows
its K/V one step behind: after computing its contribution for the shard it holds, a
device waits for the partial sum the left neighbour sent, adds, and sends the sum on
(the DMA runs beside the next step's compute), with its own handshake on a second
double buffer. dQ accumulates locally. One ppermute after the kernel sends each
finished dK/dV home.
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
    pos_all = np.stack([local_positions(opts.layout, s, n, t, xp=np, subshards=opts.subshards)
                        for s in range(n)]).astype(np.int32)
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


class _Ring:
    """One device's view of ring step `step` inside a fused kernel (grid = (steps,))."""

    def __init__(self, ids_ref, opts: AttentionOptions, num_steps: int, offset: int):
        pl, _ = block._pallas()
        self.opts = opts
        self.num_steps = num_steps
        self.step = pl.program_id(0)
        self.slot = self.step % 2
        # ring indices come from SMEM, not lax.axis_index: the interpreter re-evaluates axis_index
        # as a value varying over the mesh axis, which mixes badly with constants under check_vma
        self.left, self.right = ids_ref[1], ids_ref[2]
        n = opts.axis_size
        self.src = (ids_ref[0] + offset - self.step + n) % n  # whose K/V slot `slot` holds now
        self.more = self.step + 1 < num_steps

    def copy(self, buf, send_sems, recv_sems, from_slot, to_slot):
        """Remote DMA of buf[from_slot] here into buf[to_slot] of the right neighbour."""
        pl, pltpu = block._pallas()
        return pltpu.make_async_remote_copy(
            buf.at[from_slot], buf.at[to_slot], send_sems.at[from_slot], recv_sems.at[to_slot],
            device_id={self.opts.axis_name: self.right}, device_id_type=pl.DeviceIdType.MESH,
        )

    def begin(self, kv0_ref, kv_buf, local_sem, kv_send, kv_recv, kv_capacity):
        """Entry barrier and local K/V into slot 0 (step 0); receive this step's K/V; send it on."""
        pl, pltpu = block._pallas()
        step, slot = self.step, self.slot

        @pl.when(step == 0)
        def _start():
            if self.num_steps > 1:
                _barrier(self.opts, self.left, self.right)
            copy = pltpu.make_async_copy(kv0_ref, kv_buf.at[0], local_sem)
            copy.start()
            copy.wait()

        @pl.when(step > 0)
        def _arrived():  # the left neighbour's DMA of last step, into our slot `slot`
            self.copy(kv_buf, kv_send, kv_recv, 1 - slot, slot).wait_recv()

        @pl.when(self.more)
        def _send():
            @pl.when(step > 0)
            def _():
                _wait_for_capacity(kv_capacity)

            self.copy(kv_buf, kv_send, kv_recv, slot, 1 - slot).start()

    def end(self, kv_buf, kv_send, kv_recv, kv_capacity):
        """Wait until our K/V has left slot `slot`, then free that slot for the left neighbour."""
        pl, _ = block._pallas()

        @pl.when(self.more)
        def _sent():
            self.copy(kv_buf, kv_send, kv_recv, self.slot, 1 - self.slot).wait_send()

            # the left neighbour sends again next step, into our slot `slot`: it is free now
            @pl.when(self.step + 2 < self.num_steps)
            def _():
                _grant_capacity(kv_capacity, self.opts, self.left)


def _kv_specs(tl: Tiling, ring: _Ring, q_first: bool):
    """BlockSpecs of the K, V, position and segment tiles of the slot being computed.

    Grid indices are (b, h, i, j) when `q_first`, else (b, h, j, i).
    """
    pl, _ = block._pallas()
    bq, bk, d = tl.block_q, tl.block_kv, tl.head_dim
    slot, src = ring.slot, ring.src

    def index(f):  # f(b, h, i, j) whatever the grid order
        return (lambda b, h, i, j: f(b, h, i, j)) if q_first else (lambda b, h, j, i: f(b, h, i, j))

    specs = [
        pl.BlockSpec((None, None, None, None, bk, d), index(lambda b, h, i, j: (slot, 0, b, h, j, 0))),
        pl.BlockSpec((None, None, None, None, bk, d), index(lambda b, h, i, j: (slot, 1, b, h, j, 0))),
        pl.BlockSpec((None, bq, 1), index(lambda b, h, i, j: (i, 0, 0))),
        pl.BlockSpec((None, None, 1, bk), index(lambda b, h, i, j: (src, j, 0, 0))),
    ]
    if tl.has_segments:
        specs += [
            pl.BlockSpec((None, None, bq, 1), index(lambda b, h, i, j: (b, i, 0, 0))),
            pl.BlockSpec((None, None, None, 1, bk), index(lambda b, h, i, j: (src, b, j, 0, 0))),
        ]
    return specs


def _q_spec(tl: Tiling, last: int, q_first: bool):
    """[G, bq, last] tiles of a [B, KVH, G, T, last] array."""
    pl, _ = block._pallas()
    if q_first:
        return pl.BlockSpec((None, None, tl.groups, tl.block_q, last), lambda bi, hi, i, j: (bi, hi, 0, i, 0))
    return pl.BlockSpec((None, None, tl.groups, tl.block_q, last), lambda bi, hi, j, i: (bi, hi, 0, i, 0))


def _run_unless_empty(opts: AttentionOptions, live_ref, ring: _Ring, compute):
    """Skip steps the mask empties; step 0 always runs: it initialises the accumulators."""
    pl, _ = block._pallas()
    if steps_may_be_empty(opts):
        pl.when(jnp.logical_or(live_ref[ring.step] != 0, ring.step == 0))(compute)
    else:
        compute()


def _fwd_kernel(*refs, opts: AttentionOptions, tl: Tiling, num_steps: int, offset: int):
    pl, pltpu = block._pallas()
    n_tables = 4 if tl.has_segments else 2
    ids_ref, live_ref, scalar_refs = refs[0], refs[1], refs[2 : 2 + n_tables]
    refs = refs[2 + n_tables :]
    q_ref, kv0_ref = refs[:2]
    tile_refs = refs[2 : 2 + n_tables]
    acc_ref, m_ref, l_ref, kv_buf, kv_send, kv_recv, local_sem, kv_capacity = refs[2 + n_tables :]
    ring = _Ring(ids_ref, opts, num_steps, offset)
    ring.begin(kv0_ref, kv_buf, local_sem, kv_send, kv_recv, kv_capacity)
    step = ring.step
    state_specs = [_q_spec(tl, tl.head_dim, True), _q_spec(tl, 1, True), _q_spec(tl, 1, True)]

    def tile_body(q_t, k_t, v_t, *rest):
        tiles, (acc_in, m_in, l_in, acc_t, m_t, l_t) = rest[:n_tables], rest[n_tables:]
        bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        meta = MetaRefs(tl, scalar_refs, tiles, src=ring.src)

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
        in_specs=[_q_spec(tl, tl.head_dim, True)] + _kv_specs(tl, ring, True) + state_specs,
        out_specs=state_specs,
    )
    _run_unless_empty(opts, live_ref, ring, lambda: pipeline(
        q_ref, kv_buf, kv_buf, *tile_refs, acc_ref, m_ref, l_ref, acc_ref, m_ref, l_ref))
    ring.end(kv_buf, kv_send, kv_recv, kv_capacity)


def _bwd_kernel(*refs, opts: AttentionOptions, tl: Tiling, num_steps: int, offset: int):
    """K/V rotate as in the forward; the dK/dV accumulator of each shard follows its K/V one step
    behind: at step s a device adds its contribution for the shard it holds to the partial sum
    the left neighbour sent (after the left's step s-1), and sends the sum on. dQ stays local."""
    pl, pltpu = block._pallas()
    n_tables = 4 if tl.has_segments else 2
    ids_ref, live_ref, scalar_refs = refs[0], refs[1], refs[2 : 2 + n_tables]
    refs = refs[2 + n_tables :]
    q_ref, kv0_ref, do_ref, lse_ref, delta_ref = refs[:5]
    tile_refs = refs[5 : 5 + n_tables]
    (dq_ref, kv_buf, dkv_buf, kv_send, kv_recv, dkv_send, dkv_recv, local_sem, kv_capacity,
     dkv_capacity) = refs[5 + n_tables :]
    ring = _Ring(ids_ref, opts, num_steps, offset)
    ring.begin(kv0_ref, kv_buf, local_sem, kv_send, kv_recv, kv_capacity)
    step, slot = ring.step, ring.slot
    # this step's contribution goes straight into the outgoing slot at step 0 (nothing to add
    # to yet) and into slot 2, the local scratch, later
    target = jnp.where(step == 0, 0, 2)
    bk, d = tl.block_kv, tl.head_dim

    def rows_specs(q_first):
        return [_q_spec(tl, d, q_first), _q_spec(tl, d, q_first), _q_spec(tl, 1, q_first),
                _q_spec(tl, 1, q_first)]

    def dkv_body(q_t, k_t, v_t, *rest):
        tiles = rest[:n_tables]
        do_t, lse_t, delta_t, dk_t, dv_t = rest[n_tables:]
        bi, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        meta = MetaRefs(tl, scalar_refs, tiles, src=ring.src)

        @pl.when(i == 0)
        def _init():
            dk_t[...] = jnp.zeros(dk_t.shape, jnp.float32)
            dv_t[...] = jnp.zeros(dv_t.shape, jnp.float32)

        block.when_visible(opts, meta, bi, i, j,
                           lambda: block.dkv_step(q_t, k_t, v_t, do_t, lse_t, delta_t, dk_t, dv_t, meta, opts, tl))

    def dq_body(q_t, k_t, v_t, *rest):
        tiles = rest[:n_tables]
        do_t, lse_t, delta_t, dq_in, dq_t = rest[n_tables:]
        bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        meta = MetaRefs(tl, scalar_refs, tiles, src=ring.src)

        @pl.when(j == 0)
        def _load():
            @pl.when(step == 0)
            def _():
                dq_t[...] = jnp.zeros(dq_t.shape, jnp.float32)

            @pl.when(step > 0)
            def _():
                dq_t[...] = dq_in[...]

        block.when_visible(opts, meta, bi, i, j,
                           lambda: block.dq_step(q_t, k_t, v_t, do_t, lse_t, delta_t, dq_t, meta, opts, tl))

    grid_kv_first = (q_ref.shape[0], q_ref.shape[1], tl.num_kv, tl.num_q)
    dkv_out = [
        pl.BlockSpec((None, None, None, None, bk, d), lambda bi, hi, j, i, which=which: (target, which, bi, hi, j, 0))
        for which in (0, 1)
    ]
    dkv_pipeline = pltpu.emit_pipeline(
        dkv_body, grid=grid_kv_first,
        in_specs=[_q_spec(tl, d, False)] + _kv_specs(tl, ring, False) + rows_specs(False)[1:],
        out_specs=dkv_out,
    )
    dq_pipeline = pltpu.emit_pipeline(
        dq_body, grid=(q_ref.shape[0], q_ref.shape[1], tl.num_q, tl.num_kv),
        in_specs=[_q_spec(tl, d, True)] + _kv_specs(tl, ring, True) + rows_specs(True)[1:] + [_q_spec(tl, d, True)],
        out_specs=[_q_spec(tl, d, True)],
    )

    def compute():
        dkv_pipeline(q_ref, kv_buf, kv_buf, *tile_refs, do_ref, lse_ref, delta_ref, dkv_buf, dkv_buf)
        dq_pipeline(q_ref, kv_buf, kv_buf, *tile_refs, do_ref, lse_ref, delta_ref, dq_ref, dq_ref)

    _run_unless_empty(opts, live_ref, ring, compute)

    def add_body(acc_t, part_t, out_t):
        out_t[...] = acc_t[...] + part_t[...]

    tile = lambda which: pl.BlockSpec((None, None, None, None, bk, d),  # noqa: E731
                                      lambda c, bi, hi, j: (which, c, bi, hi, j, 0))
    add_pipeline = pltpu.emit_pipeline(
        add_body, grid=(2, q_ref.shape[0], q_ref.shape[1], tl.num_kv),
        in_specs=[tile(slot), tile(2)], out_specs=[tile(slot)],
    )

    @pl.when(step > 0)
    def _partial_sent():
        # last step's partial sum has left slot 1 - slot (its DMA ran beside this step's compute):
        # the left neighbour may refill it. Granting before waiting for our own grant keeps the
        # ring free of a cycle of waits.
        ring.copy(dkv_buf, dkv_send, dkv_recv, 1 - slot, slot).wait_send()

        @pl.when(ring.more)
        def _():
            _grant_capacity(dkv_capacity, opts, ring.left)

    @pl.when(step > 0)
    def _accumulate():
        # the partial sum for the shard we hold, sent by the left neighbour after its last step
        ring.copy(dkv_buf, dkv_send, dkv_recv, 1 - slot, slot).wait_recv()
        live = live_ref[step] != 0 if steps_may_be_empty(opts) else True
        pl.when(live)(lambda: add_pipeline(dkv_buf, dkv_buf, dkv_buf))

    @pl.when(ring.more)
    def _send_partial():
        @pl.when(step > 0)
        def _():
            _wait_for_capacity(dkv_capacity)

        ring.copy(dkv_buf, dkv_send, dkv_recv, slot, 1 - slot).start()

    ring.end(kv_buf, kv_send, kv_recv, kv_capacity)


def _prologue(q, k, v, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """What both fused kernels take: tiling, ring plan, SMEM scalars, HBM tiles, the first K/V."""
    block.assume_tpu_tiling()  # the inner pipelines ask for the TPU's tiling while tracing
    t = q.shape[1]
    n = opts.axis_size
    tl = block.tiling(q, k, opts, config)
    plan = ring_plan(opts, t)
    shard = lax.axis_index(opts.axis_name) if opts.axis_name is not None else jnp.int32(0)
    kv0 = _shift(jnp.stack([block.kv_major(k), block.kv_major(v)]), opts, -plan.offset)
    scalars, tiles = _tables(opts, tl, t, shard, plan, q_seg, kv_seg)
    ids = jnp.stack([shard, (shard - 1) % n, (shard + 1) % n]).astype(jnp.int32)
    return tl, plan, [ids] + scalars, tiles, kv0


def _call(kernel, name, tl, plan, opts, config, scalars, operands, out_shape, scratch):
    pl, pltpu = block._pallas()
    params = dict(dimension_semantics=("arbitrary",))
    if plan.num_steps > 1:
        params["collective_id"] = 0  # the barrier semaphore of the entry barrier
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(kernel, opts=opts, tl=tl, num_steps=plan.num_steps, offset=plan.offset),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(plan.num_steps,),
            in_specs=[any_spec] * (len(operands) - len(scalars)),
            out_specs=[any_spec] * len(out_shape),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(**params),
        interpret=block.interpret_params(config),
        name=name,
    )(*operands)


def fused_forward(q, k, v, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """The whole forward ring in one kernel: (out f32 [B,T,H,D], lse f32 [B,H,T]) before sinks."""
    _, pltpu = block._pallas()
    b, t, h, d = q.shape
    kvh = k.shape[2]
    tl, plan, scalars, tiles, kv0 = _prologue(q, k, v, q_seg, kv_seg, opts, config)
    operands = align_vma(*scalars, block.heads_major(q, kvh), kv0, *tiles)
    g = tl.groups
    out_shape = [
        out_struct((b, kvh, g, t, d), jnp.float32, operands),
        out_struct((b, kvh, g, t, 1), jnp.float32, operands),
        out_struct((b, kvh, g, t, 1), jnp.float32, operands),
        out_struct((2,) + kv0.shape, kv0.dtype, operands),  # the K/V double buffer, in HBM
    ]
    scratch = [pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA,
               pltpu.SemaphoreType.REGULAR]
    acc, m, denom, _ = _call(_fwd_kernel, "ringjax_tpu_fused_ring_fwd", tl, plan, opts, config, scalars, operands,
                             out_shape, scratch)
    seen = denom > 0.0
    safe = jnp.where(seen, denom, 1.0)
    out = block.tokens_major(acc / safe)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf).reshape(b, h, t)
    return out, lse


def fused_backward(q, k, v, dout, lse, delta, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """The whole backward ring in one kernel: (dq, dk, dv) float32.

    dK/dV of the last shard each device holds are complete when the kernel ends; one
    ppermute sends them home (nothing is left to overlap that transfer with).
    """
    _, pltpu = block._pallas()
    b, t, h, d = q.shape
    kvh = k.shape[2]
    tl, plan, scalars, tiles, kv0 = _prologue(q, k, v, q_seg, kv_seg, opts, config)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see no key: every P is masked to 0
    operands = align_vma(
        *scalars, block.heads_major(q, kvh), kv0, block.heads_major(dout, kvh),
        block.rows_major(lse.astype(jnp.float32), kvh), block.rows_major(delta.astype(jnp.float32), kvh), *tiles,
    )
    out_shape = [
        out_struct((b, kvh, tl.groups, t, d), jnp.float32, operands),
        out_struct((2,) + kv0.shape, kv0.dtype, operands),  # the K/V double buffer
        out_struct((3,) + kv0.shape, jnp.float32, operands),  # dK/dV double buffer and local scratch
    ]
    dma2 = pltpu.SemaphoreType.DMA((2,))
    scratch = [dma2, dma2, dma2, dma2, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.REGULAR,
               pltpu.SemaphoreType.REGULAR]
    dq, _, dkv = _call(_bwd_kernel, "ringjax_tpu_fused_ring_bwd", tl, plan, opts, config, scalars, operands,
                       out_shape, scratch)
    dkv = _shift(dkv[(plan.num_steps - 1) % 2], opts, plan.home_shift)
    return block.tokens_major(dq), block.kv_major(dkv[0]), block.kv_major(dkv[1])

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

K and V share one buffer, so they travel with one head_dim: where v's differs from q's and k's, q, k,
v (and dO) are padded with zero columns to the wider one and the results cut back. That is exact (zero
columns add nothing to Q K^T, dO V^T or the products that use them) at the price of the padded work
and K/V bytes; the per-step kernels take the two head_dims as they are.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax import _compat
from ringjax.backends.pallas_tpu import kernels as block
from ringjax.backends.pallas_tpu.config import TpuConfig
from ringjax.backends.pallas_tpu.kernels import MetaRefs, grid_order, meta_specs, online_softmax_step, q_spec
from ringjax.core import masks
from ringjax.core.masks import TokenInfo
from ringjax.core.operands import Operands, Refs
from ringjax.core.schedule import ring_plan, steps_may_be_empty
from ringjax.core.shards import shard_index, shift
from ringjax.core.tiles import Tiling, shard_range
from ringjax.layouts import local_positions
from ringjax.merge import finish
from ringjax.options import AttentionOptions


def _tables(opts: AttentionOptions, tl: Tiling, shard, plan, q_seg, kv_seg):
    """(live, meta): whether each step's K/V may be seen at all (int32 [steps]), and the block ranges
    and mask tiles of every source shard, as `block.token_meta` stacks them."""
    n = opts.axis_size
    pos_all = np.stack([local_positions(opts.layout, s, n, tl.q_len, xp=np, subshards=opts.subshards)
                        for s in range(n)]).astype(np.int32)
    seg_all = None
    if tl.has_segments:
        seg_all = lax.all_gather(kv_seg, opts.axis_name) if opts.axis_name is not None else kv_seg[None]
        seg_all = seg_all.astype(jnp.int32)  # [N, B, S]

    def source(s):
        return TokenInfo(jnp.asarray(pos_all)[s], None if seg_all is None else seg_all[s])

    q_info = TokenInfo(jnp.asarray(pos_all)[shard], q_seg)
    live = [masks.maybe_visible(opts, shard_range(q_info), shard_range(source(plan.source(shard, step, n))))
            for step in range(plan.num_steps)]
    return jnp.stack(live).astype(jnp.int32), block.token_meta(q_info, [source(s) for s in range(n)], tl, stacked=True)


def _barrier(opts: AttentionOptions, left, right):
    """Both neighbours are inside this kernel call (two rounds: none is still in the previous one)."""
    pl, pltpu = block._pallas()

    def round_trip(sem):
        for neighbour in (left, right):
            pl.semaphore_signal(sem, 1, device_id={opts.axis_name: neighbour})
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
    pl.semaphore_signal(capacity, 1, device_id={opts.axis_name: left})


class _Ring:
    """One device's view of ring step `step` inside a fused kernel (grid = (steps,)).

    `r` holds the kernel's refs by name: "ids" (this device, left, right), the K/V double
    buffer "kv_buf" with its DMA semaphores "kv_send" and "kv_recv", "kv0" (the first K/V),
    "local_sem" and the handshake semaphore "kv_capacity".
    """

    def __init__(self, r: Refs, opts: AttentionOptions, num_steps: int, offset: int):
        pl, _ = block._pallas()
        self.r = r
        self.opts = opts
        self.num_steps = num_steps
        self.step = pl.program_id(0)
        self.slot = self.step % 2
        # ring indices come from SMEM, not lax.axis_index: the interpreter re-evaluates axis_index
        # as a value varying over the mesh axis, which mixes badly with constants under check_vma
        self.left, self.right = r.ids[1], r.ids[2]
        n = opts.axis_size
        self.src = (r.ids[0] + offset - self.step + n) % n  # whose K/V slot `slot` holds now
        self.more = self.step + 1 < num_steps

    def copy(self, buf, send_sems, recv_sems, from_slot, to_slot):
        """Remote DMA of buf[from_slot] here into buf[to_slot] of the right neighbour."""
        _, pltpu = block._pallas()
        return pltpu.make_async_remote_copy(
            buf.at[from_slot], buf.at[to_slot], send_sems.at[from_slot], recv_sems.at[to_slot],
            device_id={self.opts.axis_name: self.right},
        )

    def copy_kv(self, from_slot, to_slot):
        return self.copy(self.r.kv_buf, self.r.kv_send, self.r.kv_recv, from_slot, to_slot)

    def begin(self):
        """Entry barrier and local K/V into slot 0 (step 0); receive this step's K/V; send it on."""
        pl, pltpu = block._pallas()
        step, slot, r = self.step, self.slot, self.r

        @pl.when(step == 0)
        def _start():
            if self.num_steps > 1:
                _barrier(self.opts, self.left, self.right)
            copy = pltpu.make_async_copy(r.kv0, r.kv_buf.at[0], r.local_sem)
            copy.start()
            copy.wait()

        @pl.when(step > 0)
        def _arrived():  # the left neighbour's DMA of last step, into our slot `slot`
            self.copy_kv(1 - slot, slot).wait_recv()

        @pl.when(self.more)
        def _send():
            @pl.when(step > 0)
            def _():
                _wait_for_capacity(r.kv_capacity)

            self.copy_kv(slot, 1 - slot).start()

    def end(self):
        """Wait until our K/V has left slot `slot`, then free that slot for the left neighbour."""
        pl, _ = block._pallas()

        @pl.when(self.more)
        def _sent():
            self.copy_kv(self.slot, 1 - self.slot).wait_send()

            # the left neighbour sends again next step, into our slot `slot`: it is free now
            @pl.when(self.step + 2 < self.num_steps)
            def _():
                _grant_capacity(self.r.kv_capacity, self.opts, self.left)

    def kv_spec(self, tl: Tiling, which: int, q_first: bool):
        """[bk, D] tiles of K (which 0) or V (1) in the slot being computed, of the [2, 2, B, KVH, S, D] buffer."""
        pl, _ = block._pallas()
        return pl.BlockSpec((None, None, None, None, tl.block_kv, tl.head_dim),
                            grid_order(q_first)(lambda b, h, i, j: (self.slot, which, b, h, j, 0)))

    def kv_operands(self, ops: Operands, tl: Tiling, q_first: bool) -> Operands:
        """`ops` and then K, V and the mask tiles of the shard being computed, for an inner pipeline."""
        return (ops.add("k", self.r.kv_buf, self.kv_spec(tl, 0, q_first))
                .add("v", self.r.kv_buf, self.kv_spec(tl, 1, q_first))
                .add_group("tiles", self.r.tiles, meta_specs(tl, q_first, src=self.src)))

    def pipeline(self, body, tl: Tiling, ins: Operands, outs: Operands, q_first: bool):
        """An inner pipeline over (B, KVH, nq, nk) tiles (nk, nq if not `q_first`); `body(t, meta)` gets
        the tile refs by name and the mask metadata of the tile pair."""
        _, pltpu = block._pallas()
        layout = ins.layout + outs.layout

        def tile_body(*refs):
            t = Refs(layout, refs)
            body(t, MetaRefs(tl, self.r.scalars, t.tiles, src=self.src))

        tiles = (tl.num_q, tl.num_kv) if q_first else (tl.num_kv, tl.num_q)
        run = pltpu.emit_pipeline(tile_body, grid=(tl.batch, tl.kv_heads, *tiles), in_specs=ins.specs,
                                  out_specs=outs.specs)
        return lambda: run(*ins.arrays, *outs.arrays)

    def run_unless_empty(self, compute):
        """Skip steps the mask empties; step 0 always runs: it initialises the accumulators."""
        pl, _ = block._pallas()
        if steps_may_be_empty(self.opts):
            pl.when(jnp.logical_or(self.r.live[self.step] != 0, self.step == 0))(compute)
        else:
            compute()


def _fwd_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling, num_steps: int, offset: int):
    pl, _ = block._pallas()
    r = Refs(layout, refs)
    ring = _Ring(r, opts, num_steps, offset)
    ring.begin()
    step, d = ring.step, tl.head_dim
    # the online-softmax state in HBM is read (acc_in, m_in, l_in) and written back (acc, m, l)
    state = [("acc", r.acc, q_spec(tl, d, True)), ("m", r.m, q_spec(tl, 1, True)), ("l", r.l, q_spec(tl, 1, True))]
    ins = ring.kv_operands(Operands().add("q", r.q, q_spec(tl, d, True)), tl, True)
    outs = Operands()
    for name, ref, spec in state:
        ins.add(f"{name}_in", ref, spec)
        outs.add(name, ref, spec)

    def tile_body(t: Refs, meta: MetaRefs):
        bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _load_state():  # the online-softmax state persists in HBM across ring steps
            @pl.when(step == 0)
            def _():
                t.m[...] = jnp.full(t.m.shape, -jnp.inf, jnp.float32)
                t.l[...] = jnp.zeros(t.l.shape, jnp.float32)
                t.acc[...] = jnp.zeros(t.acc.shape, jnp.float32)

            @pl.when(step > 0)
            def _():
                t.m[...] = t.m_in[...]
                t.l[...] = t.l_in[...]
                t.acc[...] = t.acc_in[...]

        block.when_visible(opts, meta, bi, i, j,
                           lambda: online_softmax_step(t.q, t.k, t.v, t.m, t.l, t.acc, meta, opts, tl))

    ring.run_unless_empty(ring.pipeline(tile_body, tl, ins, outs, q_first=True))
    ring.end()


def _bwd_kernel(*refs, layout, opts: AttentionOptions, tl: Tiling, num_steps: int, offset: int):
    """K/V rotate as in the forward; the dK/dV accumulator of each shard follows its K/V one step
    behind: at step s a device adds its contribution for the shard it holds to the partial sum
    the left neighbour sent (after the left's step s-1), and sends the sum on. dQ stays local."""
    pl, pltpu = block._pallas()
    r = Refs(layout, refs)
    ring = _Ring(r, opts, num_steps, offset)
    ring.begin()
    step, slot = ring.step, ring.slot
    _compute_gradients(r, ring, opts, tl)

    def copy_dkv(from_slot, to_slot):
        return ring.copy(r.dkv_buf, r.dkv_send, r.dkv_recv, from_slot, to_slot)

    def add_body(acc_t, part_t, out_t):
        out_t[...] = acc_t[...] + part_t[...]

    def tile(which):  # [bk, D] tiles of dK and dV in slot `which` of the [3, 2, B, KVH, S, D] buffer
        shape = (None, None, None, None, tl.block_kv, tl.head_dim)
        return pl.BlockSpec(shape, lambda c, b, h, j: (which, c, b, h, j, 0))

    add_partial = pltpu.emit_pipeline(add_body, grid=(2, tl.batch, tl.kv_heads, tl.num_kv),
                                      in_specs=[tile(slot), tile(2)], out_specs=[tile(slot)])

    @pl.when(step > 0)
    def _partial_sent():
        # last step's partial sum has left slot 1 - slot (its DMA ran beside this step's compute):
        # the left neighbour may refill it. Granting before waiting for our own grant keeps the
        # ring free of a cycle of waits.
        copy_dkv(1 - slot, slot).wait_send()

        @pl.when(ring.more)
        def _():
            _grant_capacity(r.dkv_capacity, opts, ring.left)

    @pl.when(step > 0)
    def _accumulate():
        # the partial sum for the shard we hold, sent by the left neighbour after its last step
        copy_dkv(1 - slot, slot).wait_recv()
        live = r.live[step] != 0 if steps_may_be_empty(opts) else True
        pl.when(live)(lambda: add_partial(r.dkv_buf, r.dkv_buf, r.dkv_buf))

    @pl.when(ring.more)
    def _send_partial():
        @pl.when(step > 0)
        def _():
            _wait_for_capacity(r.dkv_capacity)

        copy_dkv(slot, 1 - slot).start()

    ring.end()


def _compute_gradients(r: Refs, ring: _Ring, opts: AttentionOptions, tl: Tiling):
    """This step's dK/dV for the shard it holds, into the outgoing slot at step 0 (nothing to add to
    yet) and into slot 2, the local scratch, later; and dQ, accumulated in place."""
    pl, _ = block._pallas()
    step, d = ring.step, tl.head_dim
    target = jnp.where(step == 0, 0, 2)

    def rows(q_first):  # q, k, v, mask tiles, dO, lse, delta
        ops = ring.kv_operands(Operands().add("q", r.q, q_spec(tl, d, q_first)), tl, q_first)
        return (ops.add("do", r.do, q_spec(tl, d, q_first)).add("lse", r.lse, q_spec(tl, 1, q_first))
                .add("delta", r.delta, q_spec(tl, 1, q_first)))

    def dkv_body(t: Refs, meta: MetaRefs):
        bi, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

        @pl.when(i == 0)
        def _init():
            t.dk[...] = jnp.zeros(t.dk.shape, jnp.float32)
            t.dv[...] = jnp.zeros(t.dv.shape, jnp.float32)

        block.when_visible(opts, meta, bi, i, j, lambda: block.grad_step(t, meta, opts, tl, dk=t.dk, dv=t.dv))

    def dq_body(t: Refs, meta: MetaRefs):
        bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _load():
            @pl.when(step == 0)
            def _():
                t.dq[...] = jnp.zeros(t.dq.shape, jnp.float32)

            @pl.when(step > 0)
            def _():
                t.dq[...] = t.dq_in[...]

        block.when_visible(opts, meta, bi, i, j, lambda: block.grad_step(t, meta, opts, tl, dq=t.dq))

    def dkv_tile(which):  # [bk, D] tiles of dK (0) or dV (1) in slot `target` of the dK/dV buffer
        return pl.BlockSpec((None, None, None, None, tl.block_kv, d),
                            grid_order(False)(lambda b, h, i, j: (target, which, b, h, j, 0)))

    dkv_outs = Operands().add("dk", r.dkv_buf, dkv_tile(0)).add("dv", r.dkv_buf, dkv_tile(1))
    dkv = ring.pipeline(dkv_body, tl, rows(False), dkv_outs, q_first=False)
    dq_outs = Operands().add("dq", r.dq, q_spec(tl, d, True))
    dq = ring.pipeline(dq_body, tl, rows(True).add("dq_in", r.dq, q_spec(tl, d, True)), dq_outs, q_first=True)

    def compute():
        dkv()
        dq()

    ring.run_unless_empty(compute)


def _prologue(q, k, v, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """What both fused kernels take: tiling, ring plan, SMEM scalars, HBM mask tiles, the first K/V."""
    block.assume_tpu_tiling()  # the inner pipelines ask for the TPU's tiling while tracing
    n = opts.axis_size
    tl = block.tiling(q, k, v, opts, config)
    plan = ring_plan(opts, tl.q_len)
    shard = shard_index(opts)
    kv0 = shift(jnp.stack([block.kv_major(k), block.kv_major(v)]), opts, -plan.offset)
    live, meta = _tables(opts, tl, shard, plan, q_seg, kv_seg)
    ids = jnp.stack([shard, (shard - 1) % n, (shard + 1) % n]).astype(jnp.int32)
    scalars = Operands().add("ids", ids).add("live", live).add_group("scalars", meta.scalars, ())
    return tl, plan, scalars, meta.tiles, kv0


def _call(kernel, name: str, tl: Tiling, plan, opts: AttentionOptions, config: TpuConfig, scalars: Operands,
          ins: Operands, outs: Operands, scratch: Operands):
    """The fused kernel over grid (ring steps,): every operand stays in HBM (the inner pipelines
    bring tiles into VMEM); `outs` holds (shape, dtype) pairs."""
    pl, pltpu = block._pallas()
    params = {"dimension_semantics": ("arbitrary",)}
    if plan.num_steps > 1:
        params["collective_id"] = 0  # the barrier semaphore of the entry barrier
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    operands = _compat.align_vma(*scalars.arrays, *ins.arrays)
    layout = scalars.layout + ins.layout + outs.layout + scratch.layout
    return pl.pallas_call(
        functools.partial(kernel, layout=layout, opts=opts, tl=tl, num_steps=plan.num_steps, offset=plan.offset),
        out_shape=[_compat.struct_like(shape, dtype, *operands) for shape, dtype in outs.arrays],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars.arrays),
            grid=(plan.num_steps,),
            in_specs=[any_spec] * len(ins.arrays),
            out_specs=[any_spec] * len(outs.arrays),
            scratch_shapes=scratch.arrays,
        ),
        compiler_params=pltpu.CompilerParams(**params),
        interpret=block.interpret_params(config),
        name=name,
    )(*operands)


def _widened(*xs):
    """xs [..., head_dim] padded with zero columns to the widest head_dim among them."""
    width = max(x.shape[-1] for x in xs)
    return [jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]) for x in xs]


def fused_forward(q, k, v, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """The whole forward ring in one kernel: (out f32 [B,T,H,Dv], lse f32 [B,H,T]) before sinks."""
    if q.shape[-1] != v.shape[-1]:  # one K/V buffer: one head_dim (see the module docstring)
        out, lse = fused_forward(*_widened(q, k, v), q_seg, kv_seg, opts, config)
        return out[..., :v.shape[-1]], lse
    _, pltpu = block._pallas()
    tl, plan, scalars, tiles, kv0 = _prologue(q, k, v, q_seg, kv_seg, opts, config)
    b, kvh, g, t, d = tl.batch, tl.kv_heads, tl.groups, tl.q_len, tl.head_dim
    ins = Operands().add("q", block.heads_major(q, kvh)).add("kv0", kv0).add_group("tiles", tiles, ())
    outs = (Operands().add("acc", ((b, kvh, g, t, d), jnp.float32)).add("m", ((b, kvh, g, t, 1), jnp.float32))
            .add("l", ((b, kvh, g, t, 1), jnp.float32))
            .add("kv_buf", ((2,) + kv0.shape, kv0.dtype)))  # the K/V double buffer, in HBM
    dma = pltpu.SemaphoreType.DMA
    scratch = (Operands().add("kv_send", dma((2,))).add("kv_recv", dma((2,))).add("local_sem", dma)
               .add("kv_capacity", pltpu.SemaphoreType.REGULAR))
    acc, m, denom, _ = _call(_fwd_kernel, "ringjax_tpu_fused_ring_fwd", tl, plan, opts, config, scalars, ins, outs,
                             scratch)
    out, lse = finish(acc, m, denom)
    return block.tokens_major(out), lse.reshape(b, tl.heads, t)


def fused_backward(q, k, v, dout, lse, delta, q_seg, kv_seg, opts: AttentionOptions, config: TpuConfig):
    """The whole backward ring in one kernel: (dq, dk, dv) float32.

    dK/dV of the last shard each device holds are complete when the kernel ends; one
    ppermute sends them home (nothing is left to overlap that transfer with).
    """
    if q.shape[-1] != v.shape[-1]:  # one K/V buffer: one head_dim (see the module docstring)
        dq, dk, dv = fused_backward(*_widened(q, k, v, dout), lse, delta, q_seg, kv_seg, opts, config)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    _, pltpu = block._pallas()
    tl, plan, scalars, tiles, kv0 = _prologue(q, k, v, q_seg, kv_seg, opts, config)
    ins = block.backward_operands(tl, q, dout, lse, delta, q_first=None).add("kv0", kv0).add_group("tiles", tiles, ())
    outs = (Operands().add("dq", ((tl.batch, tl.kv_heads, tl.groups, tl.q_len, tl.head_dim), jnp.float32))
            .add("kv_buf", ((2,) + kv0.shape, kv0.dtype))  # the K/V double buffer
            .add("dkv_buf", ((3,) + kv0.shape, jnp.float32)))  # dK/dV double buffer and local scratch
    dma, regular = pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.REGULAR
    scratch = (Operands().add("kv_send", dma((2,))).add("kv_recv", dma((2,))).add("dkv_send", dma((2,)))
               .add("dkv_recv", dma((2,))).add("local_sem", dma).add("kv_capacity", regular)
               .add("dkv_capacity", regular))
    dq, _, dkv = _call(_bwd_kernel, "ringjax_tpu_fused_ring_bwd", tl, plan, opts, config, scalars, ins, outs,
                       scratch)
    dkv = shift(dkv[(plan.num_steps - 1) % 2], opts, plan.home_shift)
    return block.tokens_major(dq), block.kv_major(dkv[0]), block.kv_major(dkv[1])

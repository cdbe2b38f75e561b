"""Tile sizes and pipeline depths of the Mosaic GPU (Hopper) ring step."""

from __future__ import annotations

import dataclasses

from ringjax.core.masks import is_sink_step
from ringjax.core.problem import KernelConfig, int_in, one_of
from ringjax.core.schedule import reach

ROWS = 64  # rows of one consumer warpgroup's tile: the M of one wgmma instruction
SMEM_LIMIT = 227 * 1024  # shared memory one block may opt into on sm90 (H100, H200)
_BLOCKS = (64, 128, 256)
# wgmma takes any multiple of 16 up to 256; these are the sizes models use and the tests cover
HEAD_DIMS = (64, 96, 128, 192, 256)
# what Pallas reserves beside a kernel's scratch wherever it reduces (its `CompilerParams.reduction_scratch_bytes`,
# 2 KiB in jax 0.10.2 to 0.12): left out, a 192 / 128 forward with 128-key blocks was counted 229,888 bytes and
# refused by the compiler at 232,536, over the 232,448 a block may use
REDUCTION_SCRATCH = 128 * 4 * 4


def _aligned(nbytes: int) -> int:
    """A shared-memory buffer's bytes with the padding to the 1 KiB boundary the next one starts on."""
    return -(-nbytes // 1024) * 1024


def epilogue_slots(head_dim: int) -> int:
    """Shared-memory slots per consumer for writing results out: one above head_dim 128 (the 16 KiB the
    second would take are what 256-wide tiles need)."""
    return 1 if head_dim > 128 else 2


def split_head_dim(head_dim: int, v_head_dim: int | None = None) -> bool:
    """Whether the backward kernels split the head_dims between the two consumers (`kernels._Walk.split`): when
    q/k's or v's (None: q/k's) exceeds 128."""
    return max(head_dim, head_dim if v_head_dim is None else v_head_dim) > 128


def supports_fused_bwd(head_dim: int, v_head_dim: int) -> bool:
    """Whether `kernels.fused_ring_bwd` can run: its copy CTAs stage K/V through the dK/dV kernel's whole-width
    query slots, which head_dims above 128 split in halves."""
    return not split_head_dim(head_dim, v_head_dim)


def dq_k_copy(head_dim: int, itemsize: int = 2) -> bool:
    """Whether the fused backward keeps a second, narrower-swizzled copy of its K tiles for dQ: where half the
    head_dim (each consumer's columns of dQ) is narrower than a 128-byte swizzled row (head_dim 64)."""
    return head_dim // 2 * itemsize < 128


def sinks_apart(opts) -> bool:
    """Whether the dK/dV kernel (split or fused: then with their dQ share, unless ALiBi) leaves the sink tokens to
    a dense product in XLA (`kernels._sink_key_grads`; fused, `_sink_pair_grads`): where a window or chunks hide
    some of their pairs (else the base rule shows them all) and without segments (whose sinks start every
    document); not on the ring's sink step, whose keys are the sink tokens alone."""
    return (bool(opts.num_sink_tokens) and not opts.has_segments and reach(opts) is not None
            and not is_sink_step(opts))


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig(KernelConfig):
    """Block sizes and pipeline depths of the forward, dQ and dK/dV kernels.

    Each kernel runs two consumer warpgroups of 64 query (or key) rows and one producer
    warpgroup that streams the other operand's tiles through `*_stages` shared-memory slots:
    `block_kv` keys per forward step, `dq_block_kv` keys per dQ step, `dkv_block_q` queries
    per dK/dV step. `pair_heads`: with an even GQA group the two consumers of a forward or
    dQ block take two query heads on the same rows (one K/V tile, one mask); otherwise, and
    always without GQA, two adjacent row tiles of one head. `bwd_fused`: one backward kernel
    (the dK/dV kernel also adds each block's dQ into global memory by TMA reduce-add, the
    softmax recomputed once; with ALiBi each consumer also sums its keys' slope gradient) instead of a dQ
    and a dK/dV kernel; where it cannot run (head_dim other than 64 or 128, `dkv_block_q` other than 64,
    or too little shared memory for its dS^T tiles beside `dkv_num_stages` stages: `split_bwd_reason`)
    the two kernels do, and the "ringjax.implementation" report says which ran and why. `bwd_dq_first`: the
    fused backward issues each visit's dQ product before its dV product, not between dV and dK, so dQ's store
    and add overlap both (and the dS^T store none): faster without a causal mask (1 H200, 2026-12-01), and
    with one since the dQ write became one commit a visit (1 H100, 2026-12-06); the heuristic sets it at
    head_dim 128. Its dQ
    sums in an order that varies from run to run; the two kernels are deterministic, and run instead
    with the op's `deterministic=True`.
    `bwd_tile_major`: the dQ and dK/dV kernels' CTAs start row tile by row tile, each tile of every head before the
    next tile, instead of head by head (the forward's persistent CTAs order their work themselves); under a causal
    mask the first tiles are the heaviest, so this is the longest-first order: fwd+bwd 1.05-1.07x at 8K causal,
    1.2-1.4x at 4K, 1-2% slower at 16K and at head_dim 256 (1 H200, docs/performance.md); the heuristic sets it on
    causal shards up to 8K
    (`implementation.TILE_MAJOR_SEQ`). `bwd_reverse`: the dK/dV kernel walks each key tile's query blocks
    last first, so under a causal mask the CTAs running at once read the same query blocks (from the last)
    instead of each its own diagonal's. `fused`: the forward ring as one kernel per call that copies the other
    devices' K/V into receive slots itself (remote TMA, semaphores; `kernels.fused_ring_fwd`) while it computes on
    its own, instead of a kernel per ring step with ppermutes between them; the backward's dK/dV likewise one kernel
    that also stores the other sources' float32 partials into their owners' slots (`kernels.fused_ring_bwd`;
    head_dims up to 128, above that the step ring's backward). K/V of every source are resident at once, and in the
    backward their dK/dV partials (O(sequence) per device, not O(sequence / devices)); the ring axis must span every
    device. The heuristic config (what `auto` runs untuned) sets it where the call allows and those slots fit
    (`implementation.fuses_ring`).
    `persistent`: where no row tile can visit more than 128 key blocks (64 over all sources of a fused ring
    pass), the forward launches one CTA per SM that walks row tiles sorted by their work
    (`kernels._Persist`), so one tile's pipeline fill and epilogue overlap the next tile's loads; in a
    fused pass the first CTAs copy K/V before their first tile. False: a CTA per row tile.
    `half_blocks`: the forward scores only the visible half of a masked block at either end of a row tile's
    keys where the other half is hidden from the whole tile (a causal diagonal, a window's or a chunk's edge:
    a quarter of such a block is visible to a 64-row tile), with half-wide wgmma products (`visits.half_flags`);
    the step kernels only (a `fused` ring pass keeps whole blocks).
    `interpret=True` runs the same kernels in jax's GPU interpreter on any platform, with the block
    matmuls as jnp.dot: for eager per-step tests on CPU (slow; under jit the interpreter can stall on
    hosts with few cores).
    """

    block_kv: int = one_of(_BLOCKS, default=128)
    num_stages: int = int_in(2, 6, default=2)
    dq_block_kv: int = one_of(_BLOCKS, default=64)
    dq_num_stages: int = int_in(2, 6, default=2)
    dkv_block_q: int = one_of(_BLOCKS, default=64)
    dkv_num_stages: int = int_in(2, 6, default=3)
    pair_heads: bool = True
    bwd_fused: bool = False
    bwd_dq_first: bool = False
    bwd_tile_major: bool = False
    bwd_reverse: bool = False
    fused: bool = False
    persistent: bool = True
    half_blocks: bool = True
    interpret: bool = False

    def smem_bytes(self, head_dim: int, itemsize: int = 2, segments: bool = False,
                   v_head_dim: int | None = None, alibi: bool = False) -> dict[str, int]:
        """Shared memory each kernel allocates (bytes), by the same sums the kernels use: every buffer starts on
        a 1 KiB boundary (`_aligned`), and a kernel that reduces (the forward; the dQ kernel with ALiBi, whose
        slope gradient it sums) has Pallas's `REDUCTION_SCRATCH` besides; the barriers fit the 1 KiB margin
        callers keep. q and k tiles are head_dim wide, v and dO tiles v_head_dim (None: head_dim). Checked
        against the compiler's count by lowering for CUDA (tests/test_pallas_mosaic_gpu.py)."""
        d, dv = head_dim, head_dim if v_head_dim is None else v_head_dim
        w = (d + dv) * itemsize  # a row of a q and a dO tile, or of a K and a V tile
        # the backward's consumers share their tiles when they split the head_dims (split_head_dim)
        bwd_tiles = ROWS * w * (1 if max(d, dv) > 128 else 2)
        epilogue = 2 * epilogue_slots(max(d, dv)) * ROWS * 32 * 4  # float32 slots of 32 columns per warpgroup
        rows = _aligned(2 * ROWS * 4)  # a [2, 64] float32 or int32 vector
        seg = rows + _aligned(2 * max(self.block_kv, self.dq_block_kv, self.dkv_block_q) * 4) if segments else 0
        fwd = 2 * ROWS * d * itemsize + self.num_stages * self.block_kv * w + epilogue + rows + REDUCTION_SCRATCH
        dq = bwd_tiles + self.dq_num_stages * self.dq_block_kv * w + epilogue + 2 * rows
        dq += REDUCTION_SCRATCH if alibi else 0
        dkv = bwd_tiles + self.dkv_num_stages * self.dkv_block_q * w + 2 * _aligned(
            self.dkv_num_stages * self.dkv_block_q * 4) + epilogue  # lse and delta per stage
        if max(d, dv) > 128:  # the consumers' P^T and dS^T over half a block each share the epilogue's memory
            dkv += max(0, 2 * ROWS * self.dkv_block_q * itemsize - epilogue)
        return {"forward": fwd + seg, "dq": dq + seg, "dkv": dkv + seg}

    def fused_bwd_bytes(self, head_dim: int, itemsize: int = 2, segments: bool = False,
                        v_head_dim: int | None = None, alibi: bool = False) -> int:
        """Shared memory of the fused backward (`bwd_fused`): the dK/dV kernel's, plus its dS^T tiles per
        consumer and call parity, the K tiles' copy for dQ (`dq_k_copy`), with ALiBi the consumers' slope
        gradient rows and the reduction scratch their sums take, and the 1 KiB alignment a swizzled buffer may
        need."""
        dkv = self.smem_bytes(head_dim, itemsize, segments, v_head_dim)["dkv"]
        k_copy = 2 * ROWS * head_dim * itemsize if dq_k_copy(head_dim, itemsize) else 0
        slopes = _aligned(2 * ROWS * 4) + REDUCTION_SCRATCH if alibi else 0
        return dkv + 4 * ROWS * self.dkv_block_q * itemsize + k_copy + slopes + 1024

    def split_bwd_reason(self, opts, head_dim: int, v_head_dim: int, itemsize: int = 2) -> str | None:
        """Why a step's backward with `bwd_fused` runs the dQ and dK/dV kernels instead of the fused one, or None
        when it runs fused. Its dQ tile is [64 queries, head_dim] and leaves in an even number of 32-column
        chunks; its dS^T tiles need shared memory beside the dK/dV kernel's; TMA reduce-adds sum dQ in no fixed
        order."""
        if not self.bwd_fused:
            return "bwd_fused is off"
        if opts.deterministic:
            return "deterministic=True (the fused backward's dQ sums in no fixed order)"
        if head_dim not in (64, 128) or v_head_dim > 128:
            return f"head_dim {head_dim} / v_head_dim {v_head_dim} (it takes head_dim 64 or 128, v up to 128)"
        if self.dkv_block_q != ROWS:
            return f"dkv_block_q={self.dkv_block_q} (it takes {ROWS})"
        need = self.fused_bwd_bytes(head_dim, itemsize, opts.has_segments, v_head_dim, opts.has_alibi)
        if need > SMEM_LIMIT - 1024:
            return (f"its dS^T tiles do not fit beside dkv_num_stages={self.dkv_num_stages} stages ({need:,} bytes "
                    f"of shared memory against {SMEM_LIMIT - 1024:,}; fewer stages fit)")
        return None


DECODE_BLOCKS = (64, 128, 256)
# one float32 [64, 32] epilogue slot per consumer: written once per CTA, its 8 KiB go to a third K/V stage
DECODE_EPILOGUE_SLOTS = 1


@dataclasses.dataclass(frozen=True)
class DecodeConfig(KernelConfig):
    """Split-K decode (`decode.partials`): the cache of a row is cut into `num_splits` ranges of
    `block_k`-key blocks, one CTA per (batch row, KV head, split), each streaming its blocks through
    `num_stages` shared-memory slots."""

    block_k: int = one_of(DECODE_BLOCKS, default=128)
    num_splits: int = int_in(1, 4096, default=32)
    num_stages: int = int_in(2, 8, default=3)

    def smem_bytes(self, rows: int, head_dim: int, head_dim_v: int, itemsize: int = 2) -> int:
        """Shared memory of one CTA (bytes): q tiles, K/V and key position slots, the row positions, the float32
        epilogue and lse, each buffer 1 KiB-aligned, and Pallas's reduction scratch (as `MosaicGpuConfig.
        smem_bytes`; without the last two, 192 / 128 at 128 rows was counted at the limit and needed 234,576)."""
        tiles = rows // ROWS
        q = rows * head_dim * itemsize
        stream = self.num_stages * self.block_k * (head_dim + head_dim_v) * itemsize
        positions = _aligned(self.num_stages * self.block_k * 4)
        epilogue = tiles * DECODE_EPILOGUE_SLOTS * ROWS * 32 * 4
        return q + stream + positions + epilogue + 2 * _aligned(rows * 4) + REDUCTION_SCRATCH

"""The TPU backend's config, what it refuses and why, and how it cuts a shard into blocks.

Block shapes follow the TPU's (8, 128) register tiling: the sequence dimension of
every tile is a multiple of the sublane count (8 for 32-bit, 16 for 16-bit dtypes)
or the whole shard. Positions and segment ids reach the kernel as [bq, 1] columns
and [1, bk] rows, so they impose no lane constraint on the block sizes.
"""

from __future__ import annotations

import dataclasses

from ringjax.core.problem import KernelConfig, positive
from ringjax.core.tiles import divisor_block, pick_block
from ringjax.options import AttentionOptions

# VMEM a kernel may use without raising the scoped limit: 16 MiB on TPU v4, v5e and v5p (v6e: 32)
VMEM_BUDGET = 16 << 20



@dataclasses.dataclass(frozen=True)
class TpuConfig(KernelConfig):
    """Block sizes and execution mode of the Pallas TPU ring.

    block_q, block_kv: upper bounds; each is shrunk to a sublane-aligned divisor of the
      shard (a divisor of one zigzag chunk where possible). The query tile holds all
      query heads of one KV head, so it has (heads // kv_heads) * block_q rows.
    fused: run each direction of the ring as one kernel that moves K/V (and, backward,
      dK/dV) to the neighbour with remote DMA while computing (ringjax.backends.pallas_tpu.fused_ring);
      otherwise each ring step is a kernel call and K/V move with lax.ppermute.
    interpret: run the kernels in the Pallas TPU interpreter (on CPU, for tests).
    detect_races: with interpret, run the interpreter's data race detector; it prints
      every race it finds and `ringjax.backends.pallas_tpu.kernels.races_found()` reports them.
    """

    block_q: int = positive(default=256)
    block_kv: int = positive(default=512)
    fused: bool = False
    interpret: bool = False
    detect_races: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.detect_races and not self.interpret:
            raise ValueError("TpuConfig.detect_races needs interpret=True (races are detected by the interpreter)")


def sublanes(dtype: str) -> int:
    """Rows of one (sublane x 128) register tile for `dtype`."""
    return 16 if dtype == "bfloat16" else 8


def block_size(length: int, want: int, opts: AttentionOptions, align: int) -> int:
    """Largest aligned block size <= want that divides the shard, preferring one zigzag chunk.

    Falls back to the whole shard, which is always a legal block.
    """
    return (pick_block(length, want, opts, multiple_of=align) or divisor_block(length, want, multiple_of=align)
            or length)


def vmem_bytes(config: TpuConfig, groups: int, head_dim: int, dtype: str, v_head_dim: int | None = None) -> int:
    """A conservative estimate of the VMEM of the largest kernel of `config`, bytes (upper-bound blocks).

    With rows = groups * block_q query rows per tile, bk = block_kv, d = head_dim (q, k), dv = v_head_dim
    (v, out, dO; None: d), w = d + dv, s = itemsize, and [n, 1] columns padded to 128 lanes: Pallas
    double-buffers every block it pipelines; the f32 score-sized temporaries (s, p, dp, dS) are
    rows * bk * 4 bytes each. The fused ring pads both head_dims to the wider one (see fused_ring).
      forward:  2 * (rows*d*s + bk*w*s + rows*dv*4 + rows*128*4)  (q, k, v, out, lse)
                + 3 * rows*dv*4 + 4 * rows*128*4  (acc, m, l: scratch, and their fused-ring copies)
                + 3 * rows*bk*4
      backward: 2 * (rows*w*s + 2*rows*128*4 + bk*w*s + max(bk, rows)*w*4)  (q, dO, lse, delta,
                k, v, and dK, dV or dQ) + 4 * rows*bk*4
    """
    rows, bk, d = groups * config.block_q, config.block_kv, head_dim
    dv = d if v_head_dim is None else v_head_dim
    if config.fused:
        d = dv = max(d, dv)
    w = d + dv
    s = 2 if dtype == "bfloat16" else 4
    column = rows * 128 * 4
    forward = 2 * (rows * d * s + bk * w * s + rows * dv * 4 + column) + 3 * rows * dv * 4 + 4 * column
    forward += 3 * rows * bk * 4
    backward = 2 * (rows * w * s + 2 * column + bk * w * s + max(bk, rows) * w * 4) + 4 * rows * bk * 4
    return max(forward, backward)


def fit(config: TpuConfig, groups: int, head_dim: int, dtype: str, budget: int = VMEM_BUDGET,
        v_head_dim: int | None = None) -> TpuConfig | None:
    """`config` with key blocks (down to 128) and then query blocks halved until its kernels fit
    `budget` bytes of VMEM (unchanged if they fit), or None if even the smallest do not."""
    align = sublanes(dtype)
    while vmem_bytes(config, groups, head_dim, dtype, v_head_dim) > budget:
        if config.block_kv > 128:
            config = dataclasses.replace(config, block_kv=config.block_kv // 2)
        elif config.block_q > align:
            config = dataclasses.replace(config, block_q=max(align, config.block_q // 2))
        elif config.block_kv > align:
            config = dataclasses.replace(config, block_kv=max(align, config.block_kv // 2))
        else:
            return None
    return config


def refusal(problem) -> str | None:
    """Why the TPU kernels cannot run this per-device problem beyond the feature table, or None."""
    dtype, head_dim, seq = problem.dtype, problem.head_dim, problem.seq
    if problem.opts.num_sink_tokens and problem.opts.chunk_size is not None:
        return ("sink tokens with chunk_size: the kernels run chunks as segment ids, which would confine the "
                "sinks to their chunk")
    align = sublanes(dtype)
    if seq % align:
        return f"local sequence length {seq} must be a multiple of {align} for {dtype} (TPU sublane tiling)"
    smallest = TpuConfig(block_q=align, block_kv=align)
    if fit(smallest, problem.gqa_ratio, head_dim, dtype, v_head_dim=problem.v_head_dim) is None:
        need = vmem_bytes(smallest, problem.gqa_ratio, head_dim, dtype, problem.v_head_dim)
        return f"even the smallest tiles need about {need} bytes of VMEM, more than the {VMEM_BUDGET} a kernel gets"
    return None

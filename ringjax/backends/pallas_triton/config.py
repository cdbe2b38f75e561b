"""Tile sizes and launch parameters of the Pallas GPU (Triton) ring step, and the shared memory they need."""

from __future__ import annotations

import dataclasses
import functools

from ringjax.core.problem import KernelConfig, int_in, one_of, power_of_two
from ringjax.core.tiles import pick_block
from ringjax.options import AttentionOptions

MIN_BLOCK = 16  # Triton's dot needs every operand dimension >= 16

# Shared memory one thread block may use, bytes, by compute capability (CUDA's occupancy tables).
SHARED_MEMORY = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}
MIN_CAPABILITY = (8, 0)  # bfloat16 dots and the async copies Triton pipelines with
# what the kernels are fitted to where no GPU can be asked (the interpreter on a CPU): H100 / H200
ASSUMED_CAPABILITY = (9, 0)


def _warps(*, default: int):
    return one_of((1, 2, 4, 8, 16), default=default, expected="one of 1, 2, 4, 8, 16")


@dataclasses.dataclass(frozen=True)
class GpuConfig(KernelConfig):
    """Launch parameters of the forward and backward kernels.

    Block sizes are powers of two >= 16; each is shrunk to the largest power of two
    dividing the shard's unit length (half a shard under zigzag). `interpret=True`
    runs the same kernels through the Pallas interpreter (CPU tests; slow).
    `bwd_fused=True` computes dQ inside the dK/dV kernel with float32 atomic adds (5 block
    matmuls per block pair instead of 7; the summation order of dQ is then not fixed; the op's
    `deterministic=True` runs the split kernels instead). `bwd_xla=True` runs the backward as the XLA step
    does (`core.blockwise`, blocks of `blockwise.gpu_blocks`) after the Triton forward: in float32 XLA's
    backward is the faster one.
    """

    block_q: int = power_of_two(MIN_BLOCK, default=128)
    block_kv: int = power_of_two(MIN_BLOCK, default=128)
    num_warps: int = _warps(default=8)
    num_stages: int = int_in(1, 8, default=3)
    bwd_block_q: int = power_of_two(MIN_BLOCK, default=64)
    bwd_block_kv: int = power_of_two(MIN_BLOCK, default=64)
    bwd_num_warps: int = _warps(default=4)
    bwd_num_stages: int = int_in(1, 8, default=2)
    bwd_fused: bool = False
    bwd_xla: bool = False
    interpret: bool = False


def block_sizes(opts: AttentionOptions, t: int, s: int, want_q: int, want_kv: int) -> tuple[int, int]:
    """Power-of-two blocks >= 16 that divide the shard and never straddle a zigzag chunk boundary."""
    bq = pick_block(t, want_q, opts, multiple_of=MIN_BLOCK, power_of_two=True)
    bk = pick_block(s, want_kv, opts, multiple_of=MIN_BLOCK, power_of_two=True)
    if bq is None or bk is None:
        per = opts.shards_per_device
        raise ValueError(f"pallas_triton needs shard units divisible by {MIN_BLOCK}, got {t // per} and {s // per}")
    return bq, bk


def used_blocks(config: GpuConfig, opts: AttentionOptions, seq: int) -> GpuConfig:
    """`config` with the block sizes the kernels use on shards of `seq` tokens."""
    bq, bk = block_sizes(opts, seq, seq, config.block_q, config.block_kv)
    bbq, bbk = block_sizes(opts, seq, seq, config.bwd_block_q, config.bwd_block_kv)
    return dataclasses.replace(config, block_q=bq, block_kv=bk, bwd_block_q=bbq, bwd_block_kv=bbk)


# ---------------------------------------------------------------- shared memory


def shared_memory_limit(capability: tuple[int, int]) -> int:
    """Shared memory one thread block may use on a GPU of `capability` (the smallest table entry if unknown)."""
    if capability in SHARED_MEMORY:
        return SHARED_MEMORY[capability]
    if capability[0] == 10:  # Blackwell data-centre parts keep Hopper's 228 KiB
        return SHARED_MEMORY[(9, 0)]
    return min(SHARED_MEMORY.values())


@functools.cache
def device_capability(platform: str) -> tuple[int, int] | None:
    """Compute capability of the first device of `platform` if it is a CUDA GPU here, else None."""
    import jax

    try:
        device = jax.devices(platform)[0]
    except RuntimeError:  # no such backend on this machine
        return None
    text = getattr(device, "compute_capability", None)
    if not text:
        return (0, 0)  # a GPU that reports none (not CUDA): below MIN_CAPABILITY
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def shared_memory_bytes(config: GpuConfig, head_dim: int, itemsize: int, v_head_dim: int | None = None
                        ) -> dict[str, int]:
    """A conservative estimate of each kernel's shared memory, bytes.

    Triton keeps every tile that a loop loads in `num_stages` buffers (the software pipeline)
    and each tile loaded once before the loop in one; dots read both operands from shared
    memory, and reductions take a little scratch (1 KiB here). With s = itemsize, d = head_dim
    (of Q and K), dv = v_head_dim (of V and dO; None: d) and w = d + dv:
      forward:  stages * block_kv * w * s  (K, V)  + block_q * d * s  (Q)                + 1024
      dQ:       stages * block_kv * w * s  (K, V)  + block_q * w * s  (Q, dO)            + 1024
      dK/dV:    stages * (block_q * w * s + 2 * block_q * 4)  (Q, dO, lse, delta)
                + block_kv * w * s  (K, V)                                              + 1024
                fused (`bwd_fused`): + block_q * d * 4 + block_q * block_kv * 4  (dQ's tile, dS)
    Measured on an H200: the float32, head_dim 128 forward at 128 x 128, 3 stages asked for
    394240 bytes, the loop term + 1024; the Q term is the margin. The fused float32 dK/dV kernel at
    64 x 64, 2 stages asked for 247296, 48640 above the split one's estimate (2026-12-03).
    """
    d, s, scratch = head_dim, itemsize, 1024
    w = d + (d if v_head_dim is None else v_head_dim)
    bq, bk, bbq, bbk = config.block_q, config.block_kv, config.bwd_block_q, config.bwd_block_kv
    return {
        "forward": config.num_stages * bk * w * s + bq * d * s + scratch,
        "dq": config.bwd_num_stages * bbk * w * s + bbq * w * s + scratch,
        "dkv": (config.bwd_num_stages * (bbq * w * s + 2 * bbq * 4) + bbk * w * s + scratch
                + (bbq * d * 4 + bbq * bbk * 4 if config.bwd_fused else 0)),
    }


def over_limit(config: GpuConfig, head_dim: int, itemsize: int, limit: int, v_head_dim: int | None = None
               ) -> str | None:
    """Which kernel of `config` needs more shared memory than `limit`, and how much; None if all fit."""
    for kernel, need in shared_memory_bytes(config, head_dim, itemsize, v_head_dim).items():
        if need > limit:
            return f"the {kernel} kernel needs about {need} bytes of shared memory, the GPU has {limit}"
    return None


def _shrink(block_q: int, block_kv: int, stages: int, floor_q: int):
    """The next smaller (block_q, block_kv, stages), cheapest loss first: pipeline depth beyond 2,
    key blocks down to 32, query blocks down to `floor_q`, then everything to the minimum."""
    if stages > 2:
        return block_q, block_kv, stages - 1
    if block_kv > 2 * MIN_BLOCK:
        return block_q, block_kv // 2, stages
    if block_q > floor_q:
        return block_q // 2, block_kv, stages
    if stages > 1:
        return block_q, block_kv, 1
    if block_kv > MIN_BLOCK:
        return block_q, block_kv // 2, stages
    if block_q > MIN_BLOCK:
        return block_q // 2, block_kv, stages
    return None


def fit(config: GpuConfig, head_dim: int, itemsize: int, limit: int, v_head_dim: int | None = None
        ) -> GpuConfig | None:
    """`config` with the forward and backward tiles shrunk until every kernel fits `limit` bytes
    of shared memory (unchanged if it fits), or None if even the smallest tiles do not."""
    fwd = (config.block_q, config.block_kv, config.num_stages)
    while fwd is not None:
        config = dataclasses.replace(config, block_q=fwd[0], block_kv=fwd[1], num_stages=fwd[2])
        if shared_memory_bytes(config, head_dim, itemsize, v_head_dim)["forward"] <= limit:
            break
        fwd = _shrink(*fwd, floor_q=64)
    bwd = (config.bwd_block_q, config.bwd_block_kv, config.bwd_num_stages)
    while bwd is not None:
        config = dataclasses.replace(config, bwd_block_q=bwd[0], bwd_block_kv=bwd[1], bwd_num_stages=bwd[2])
        need = shared_memory_bytes(config, head_dim, itemsize, v_head_dim)
        if need["dq"] <= limit and need["dkv"] <= limit:
            break
        bwd = _shrink(*bwd, floor_q=32)
    return None if fwd is None or bwd is None else config

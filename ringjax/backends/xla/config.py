"""The XLA backend's config: block sizes of its blockwise step."""

from __future__ import annotations

import dataclasses

from ringjax.core.problem import KernelConfig


@dataclasses.dataclass(frozen=True)
class XlaConfig(KernelConfig):
    """Block sizes of the XLA step; each is shrunk to a divisor of the shard length."""

    block_q: int = 512
    block_kv: int = 512

    def __post_init__(self):
        self._check_ints(("block_q", "block_kv"), lambda v: v >= 1, "a positive int")


GPU_SCORES = 1 << 27  # float32 scores of one block pair on a GPU (512 MiB): 32 heads of 2048 x 2048


def gpu_blocks(batch: int, heads: int) -> XlaConfig:
    """The step's blocks on a GPU: square, the largest power of two up to 2048 whose float32 scores of all
    `batch` rows and `heads` query heads stay within GPU_SCORES, and never below the default 512.

    Each block pair is a few kernel launches, so on a GPU larger blocks win until the scores crowd memory:
    8K causal on one H200 (jax 0.11.2, 2026-12-03) ran float32 fwd+bwd at 38.1 TFLOP/s with 512 x 512 blocks,
    57.0 with 1024 and 60.8 with 2048 (26.8 against 21.6 at "highest"); bf16 23.0 ms at 1024 against 35.8-48.6.
    """
    side = 2048
    while side > XlaConfig.block_q and batch * heads * side * side > GPU_SCORES:
        side //= 2
    return XlaConfig(block_q=side, block_kv=side)


@dataclasses.dataclass(frozen=True)
class XlaCacheConfig(KernelConfig):
    """Tiling of the XLA `cache_attention` partials: `block_q` queries per block (blocks run one after
    another), keys read in steps of at most `max_scores` / (batch * heads * block_q) slots, each step
    split into chunks of `block_kv` slots computed in parallel (split-K) and merged by their max."""

    block_q: int = 64
    block_kv: int = 512
    max_scores: int = 1 << 25  # float32 scores live at once per step (128 MiB): 1M slots for 32 heads, t=1
    # QK and PV as dots (XLA may lay K / V out again for them), or as float32 multiply-and-reduce
    # fusions that read K and V where they lie (few query rows: decode is memory-bound)
    dots: bool = True

    def __post_init__(self):
        self._check_ints(("block_q", "block_kv", "max_scores"), lambda v: v >= 1, "a positive int")
        self._check_bools(("dots",))

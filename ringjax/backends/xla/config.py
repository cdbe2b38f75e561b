"""The XLA backend's config: block sizes of its blockwise step."""

from __future__ import annotations

import dataclasses

from ringjax.core import blockwise
from ringjax.core.problem import KernelConfig


@dataclasses.dataclass(frozen=True)
class XlaConfig(KernelConfig):
    """Block sizes of the XLA step; each is shrunk to a divisor of the shard length."""

    block_q: int = blockwise.DEFAULT_BLOCK
    block_kv: int = blockwise.DEFAULT_BLOCK

    def __post_init__(self):
        self._check_ints(("block_q", "block_kv"), lambda v: v >= 1, "a positive int")


def gpu_blocks(batch: int, heads: int) -> XlaConfig:
    """`core.blockwise.gpu_blocks` as this backend's config: the blocks it takes on a GPU."""
    return XlaConfig(**blockwise.gpu_blocks(batch, heads)._asdict())


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

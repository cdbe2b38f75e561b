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

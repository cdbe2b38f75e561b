"""Tile sizes and launch parameters of the Pallas GPU (Triton) ring step."""

from __future__ import annotations

import dataclasses
import json

MIN_BLOCK = 16  # Triton's dot needs every operand dimension >= 16


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """Launch parameters of the forward and backward kernels.

    Block sizes are powers of two >= 16; each is shrunk to the largest power of two
    dividing the shard's unit length (half a shard under zigzag). `interpret=True`
    runs the same kernels through the Pallas interpreter (CPU tests; slow).
    `bwd_fused=True` computes dQ inside the dK/dV kernel with float32 atomic adds (5 block
    matmuls per block pair instead of 7; the summation order of dQ is then not fixed).
    """

    block_q: int = 128
    block_kv: int = 128
    num_warps: int = 8
    num_stages: int = 3
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    bwd_fused: bool = False
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not _is_pow2(value) or value < MIN_BLOCK:
                raise ValueError(f"GpuConfig.{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")
        for name in ("num_warps", "bwd_num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in (1, 2, 4, 8, 16):
                raise ValueError(f"GpuConfig.{name} must be one of 1, 2, 4, 8, 16, got {value!r}")
        for name in ("num_stages", "bwd_num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
                raise ValueError(f"GpuConfig.{name} must be an int in [1, 8], got {value!r}")
        for name in ("bwd_fused", "interpret"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GpuConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GpuConfig:
        return cls(**json.loads(text))


def pick_block(unit: int, want: int) -> int | None:
    """Largest power of two <= `want` dividing `unit`, or None if below MIN_BLOCK."""
    b = 1
    while b * 2 <= min(want, unit) and unit % (b * 2) == 0:
        b *= 2
    return b if b >= MIN_BLOCK else None

"""How one ring step is cut into tiles: block sizes, the static tiling, per-block ranges.

Every backend cuts the local queries [T] and the step's keys [S] into blocks of
`block_q` and `block_kv` tokens. Under zigzag a shard is two chunks far apart in the
sequence; blocks never straddle them, so each block's positions form a tight range
and the mask can skip whole blocks (`masks.maybe_visible` on `block_ranges`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax.core.masks import BlockRange, TokenInfo
from ringjax.layouts import local_positions
from ringjax.options import AttentionOptions


def divisor_block(unit: int, want: int, *, multiple_of: int = 1, power_of_two: bool = False) -> int | None:
    """Largest size <= `want` that divides `unit` and is a multiple of `multiple_of`
    (and a power of two if asked), or None if there is none."""
    for size in range(min(want, unit) // multiple_of * multiple_of, 0, -multiple_of):
        if unit % size == 0 and not (power_of_two and size & (size - 1)):
            return size
    return None


def pick_block(length: int, want: int, opts: AttentionOptions, **rules) -> int | None:
    """`divisor_block` of one chunk of a shard of `length` tokens (half the shard under zigzag)."""
    return divisor_block(length // opts.shards_per_device, want, **rules)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block structure of one step: q [batch, q_len, heads, head_dim] against k [batch, kv_len, kv_heads, _]
    and v [batch, kv_len, kv_heads, v_head_dim] (v's head_dim may differ from q's and k's)."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    has_segments: bool = False

    @classmethod
    def of(cls, q, k, v, block_q: int, block_kv: int, has_segments: bool = False) -> Tiling:
        b, t, h, d = q.shape
        return cls(b, h, k.shape[2], d, v.shape[3], t, k.shape[1], block_q, block_kv, has_segments)

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def num_q(self) -> int:
        return self.q_len // self.block_q

    @property
    def num_kv(self) -> int:
        return self.kv_len // self.block_kv

    @property
    def rows(self) -> int:
        """Rows of a query tile holding all query heads of one KV head."""
        return self.groups * self.block_q


def block_ranges(info: TokenInfo, size: int) -> BlockRange:
    """Bounds of each block of `size` tokens: positions [n], segment ids and offsets [rows, n]."""
    n = info.pos.shape[0] // size

    def per_block(x, reduce: str):
        # methods, not jnp functions: numpy positions (`TokenInfo.on_device`) stay numpy
        return None if x is None else getattr(x.reshape(x.shape[0], n, size), reduce)(axis=2)

    pos = info.pos.reshape(n, size)
    return BlockRange(pos.min(axis=1), pos.max(axis=1), per_block(info.seg, "min"), per_block(info.seg, "max"),
                      per_block(info.segpos, "min"))


def shard_range(info: TokenInfo) -> BlockRange:
    """Bounds over all tokens of a shard (and every batch row): scalars."""
    r = block_ranges(info, info.pos.shape[0])

    def lo(x):
        return None if x is None else x.min()

    def hi(x):
        return None if x is None else x.max()

    return BlockRange(lo(r.pos_lo), hi(r.pos_hi), lo(r.seg_lo), hi(r.seg_hi), lo(r.segpos_lo))


def block_stride(opts: AttentionOptions, length: int, size: int, *, natural: bool = False) -> int | None:
    """The position step inside every block of `size` tokens of a device's `length` tokens (static), or
    None if some block's positions are not evenly spaced by one common step.

    `natural`: the tokens are in natural order (all-gathered keys, the sink step's keys); else they
    are a shard of `opts.layout` with `opts.subshards`. Kernels that take a block's positions as
    start + step * i use it to pick block sizes and to refuse layouts they cannot walk.
    """
    if length % size:
        return None
    if natural:
        return 1
    pos = local_positions(opts.layout, 0, opts.axis_size, length, xp=np, subshards=opts.subshards)
    steps = np.diff(pos.reshape(-1, size), axis=1)
    if size == 1:
        return 1
    return int(steps[0, 0]) if (steps == steps[0, 0]).all() else None


def matmul_precision(dtype):
    """float32 tiles get true float32 products (GPUs would otherwise round the inputs to TF32)."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT

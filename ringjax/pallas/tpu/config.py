"""The TPU backend's config, what it refuses and why, and how it cuts a shard into blocks.

Block shapes follow the TPU's (8, 128) register tiling: the sequence dimension of
every tile is a multiple of the sublane count (8 for 32-bit, 16 for 16-bit dtypes)
or the whole shard. Positions and segment ids reach the kernel as [bq, 1] columns
and [1, bk] rows, so they impose no lane constraint on the block sizes.
"""

from __future__ import annotations

import dataclasses

from ringjax.options import AttentionOptions

DTYPES = ("float32", "bfloat16")

# AttentionOptions fields the TPU kernels implement; any other field set away from its
# default (a feature added later) makes `refusal` refuse rather than ignore it.
KNOWN_OPTIONS = frozenset(
    {"causal", "window", "softmax_scale", "logits_soft_cap", "layout", "axis_name", "axis_size",
     "has_segments", "has_sinks", "gather_kv", "subshards"}
)


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Block sizes and execution mode of the Pallas TPU ring.

    block_q, block_kv: upper bounds; each is shrunk to a sublane-aligned divisor of the
      shard (a divisor of one zigzag chunk where possible). The query tile holds all
      query heads of one KV head, so it has (heads // kv_heads) * block_q rows.
    fused: run each direction of the ring as one kernel that moves K/V (and, backward,
      dK/dV) to the neighbour with remote DMA while computing (ringjax.pallas.tpu.ring);
      otherwise each ring step is a kernel call and K/V move with lax.ppermute.
    interpret: run the kernels in the Pallas TPU interpreter (on CPU, for tests).
    detect_races: with interpret, run the interpreter's data race detector; it prints
      every race it finds and `ringjax.pallas.tpu.block.races_found()` reports them.
    """

    block_q: int = 256
    block_kv: int = 512
    fused: bool = False
    interpret: bool = False
    detect_races: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TpuConfig.{name} must be a positive int, got {value!r}")
        for name in ("fused", "interpret", "detect_races"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TpuConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.detect_races and not self.interpret:
            raise ValueError("TpuConfig.detect_races needs interpret=True (races are detected by the interpreter)")


def sublanes(dtype: str) -> int:
    """Rows of one (sublane x 128) register tile for `dtype`."""
    return 16 if dtype == "bfloat16" else 8


def unknown_options(opts: AttentionOptions) -> list[str]:
    """Options set away from their defaults that these kernels do not implement."""
    out = []
    for field in dataclasses.fields(opts):
        if field.name in KNOWN_OPTIONS:
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        if getattr(opts, field.name) != default:
            out.append(field.name)
    return out


def refusal(*, opts: AttentionOptions, seq: int, head_dim: int, dtype: str) -> str | None:
    """Why the TPU kernels cannot run this per-device problem, or None."""
    unknown = unknown_options(opts)
    if unknown:
        return f"option(s) {', '.join(unknown)} not implemented by the TPU kernels"
    if dtype not in DTYPES:
        return f"dtype {dtype} not supported (TPU kernels take {' or '.join(DTYPES)})"
    if not (head_dim % 128 == 0 or head_dim in (8, 16, 32, 64)):
        return f"head_dim {head_dim} not supported: needs a multiple of 128, or 8, 16, 32 or 64"
    align = sublanes(dtype)
    if seq % align:
        return f"local sequence length {seq} must be a multiple of {align} for {dtype} (TPU sublane tiling)"
    return None


def pick_block(length: int, want: int, opts: AttentionOptions, align: int) -> int:
    """Largest aligned block size <= want that divides the shard, preferring one zigzag chunk.

    Falls back to the whole shard, which is always a legal block.
    """
    unit = length // opts.shards_per_device
    for span in (unit, length):
        sizes = [d for d in range(align, min(want, span) + 1, align) if span % d == 0]
        if sizes:
            return max(sizes)
    return length

"""The frozen options object every backend reads, and validation of user input.

User arguments are checked once here, at the public boundary, while the op is
traced and before any device work; backends trust what they receive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Everything that changes which function is computed, independent of block sizes.

    `window` is (left, right): query i sees key j iff i - left <= j <= i + right,
    in global token positions. `axis_size` is 1 when there is no ring.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    softmax_scale: float = 1.0
    logits_soft_cap: float | None = None
    layout: str = "contiguous"
    axis_name: str | None = None
    axis_size: int = 1
    has_segments: bool = False
    has_sinks: bool = False
    chunk_size: int | None = None
    has_alibi: bool = False
    dropout_rate: float = 0.0
    num_sink_tokens: int = 0
    # K/V of the whole axis gathered once (the all_gather strategy) instead of travelling the ring
    gather_kv: bool = False
    # a device holds `subshards` layout shards of axis_size * subshards: shards i * axis_size + r
    # (i < subshards), concatenated; what a Ulysses all-to-all over a major axis leaves (strategies.py)
    subshards: int = 1

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.window is not None:
            left, right = self.window
            if left < 0 or right < 0:
                raise ValueError(f"sliding_window must be non-negative, got {self.window}")
            if self.causal and right != 0:
                raise ValueError("window right extent must be 0 when causal")
        if not (self.softmax_scale > 0 and math.isfinite(self.softmax_scale)):
            raise ValueError(f"softmax_scale must be a positive finite float, got {self.softmax_scale}")
        if self.logits_soft_cap is not None and not (
            self.logits_soft_cap > 0 and math.isfinite(self.logits_soft_cap)
        ):
            raise ValueError(
                f"logits_soft_cap must be a positive finite float or None, got {self.logits_soft_cap}"
            )
        if self.axis_size < 1:
            raise ValueError(f"axis_size must be >= 1, got {self.axis_size}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be >= 0, got {self.num_sink_tokens}")
        if self.subshards < 1:
            raise ValueError(f"subshards must be >= 1, got {self.subshards}")

    @property
    def shards_per_device(self) -> int:
        """How many separately placed runs (zigzag chunks, subshards) a device's tokens form; blocks never
        straddle two."""
        return chunks_per_shard(self.layout) * self.subshards


def chunks_per_shard(layout: str) -> int:
    """How many contiguous chunks of the global sequence one layout shard holds (zigzag: 2)."""
    return 2 if layout == "zigzag" else 1


def sequence_chunks(layout: str, axis_size: int) -> int:
    """How many equal chunks `layout` cuts a global sequence into on `axis_size` devices:
    its length must be a multiple of this."""
    return axis_size * chunks_per_shard(layout)


def _static_number(value: Any, name: str, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a Python {kind.__name__} (static), got {type(value).__name__}")
    if kind is int and not float(value).is_integer():
        raise TypeError(f"{name} must be an integer, got {value}")
    return kind(value)


def normalize_window(sliding_window, causal: bool) -> tuple[int, int] | None:
    """`int w` means (w, w); with causal the right extent is 0."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (tuple, list)):
        if len(sliding_window) != 2:
            raise ValueError(f"sliding_window must be an int or (left, right), got {sliding_window!r}")
        left = _static_number(sliding_window[0], "sliding_window[0]", int)
        right = _static_number(sliding_window[1], "sliding_window[1]", int)
    else:
        left = right = _static_number(sliding_window, "sliding_window", int)
    if causal:
        right = 0
    return (left, right)  # AttentionOptions checks the values


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def check_inputs(q, k, v, segment_ids, sinks, *, axis_size: int, layout: str, local: bool,
                 alibi_slopes=None, dropout_rate=0.0, dropout_rng=None) -> None:
    """Raise ValueError/TypeError naming the argument for every misuse.

    `local` means q, k, v are per-device shards (inside shard_map); otherwise they
    are global arrays that will be split `axis_size` ways along the sequence.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim], got {x.shape}")
        if not _is_float(x.dtype):
            raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seq, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.shape[0] != batch:
        raise ValueError(f"k batch {k.shape[0]} must equal q batch {batch}")
    if k.shape[1] != seq:
        raise ValueError(
            f"k sequence length {k.shape[1]} must equal q's {seq} (ring attention is self-attention "
            "over one sharded sequence)"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim {k.shape[3]} must equal q head_dim {head_dim}")
    kv_heads = k.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    chunks = sequence_chunks(layout, axis_size)
    if local:
        if seq % chunks_per_shard(layout):
            raise ValueError(f"zigzag layout needs an even local sequence length, got {seq}")
    elif seq % chunks:
        what = "2 x the axis size" if layout == "zigzag" else "the axis size"
        raise ValueError(f"sequence length {seq} must be divisible by {what} ({chunks})")
    if seq == 0:
        raise ValueError("sequence length must be positive")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape"):
            raise TypeError(f"segment_ids must be an int32 array, got {type(segment_ids).__name__}")
        if segment_ids.shape != (batch, seq):
            raise ValueError(f"segment_ids must have shape [batch, seq] = {(batch, seq)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"segment_ids must be an integer array (int32), got {segment_ids.dtype}")
    if sinks is not None:
        if not hasattr(sinks, "shape"):
            raise TypeError(f"sinks must be a float array of shape [heads], got {type(sinks).__name__}")
        if sinks.shape != (heads,):
            raise ValueError(f"sinks must have shape [heads] = ({heads},), got {sinks.shape}")
        if not _is_float(sinks.dtype):
            raise TypeError(f"sinks must be a floating-point array, got {sinks.dtype}")
    if alibi_slopes is not None:
        if not hasattr(alibi_slopes, "shape"):
            raise TypeError(f"alibi_slopes must be a float array of shape [heads], got {type(alibi_slopes).__name__}")
        if alibi_slopes.shape != (heads,):
            raise ValueError(f"alibi_slopes must have shape [heads] = ({heads},), got {alibi_slopes.shape}")
        if not _is_float(alibi_slopes.dtype):
            raise TypeError(f"alibi_slopes must be a floating-point array, got {alibi_slopes.dtype}")
    if dropout_rate and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng (a jax.random key)")
    if dropout_rng is not None and not dropout_rate:
        raise ValueError("dropout_rng was given but dropout_rate is 0: pass dropout_rate > 0 or drop dropout_rng")


def make_options(
    q,
    *,
    causal,
    sliding_window,
    softmax_scale,
    logits_soft_cap,
    layout,
    axis_name,
    axis_size,
    has_segments,
    has_sinks,
    chunk_size=None,
    has_alibi=False,
    dropout_rate=0.0,
    num_sink_tokens=0,
) -> AttentionOptions:
    """Turn user keyword arguments into one AttentionOptions: types are converted here, values checked there."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, got {type(layout).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    softmax_scale = _static_number(softmax_scale, "softmax_scale", float)
    if logits_soft_cap is not None:
        logits_soft_cap = _static_number(logits_soft_cap, "logits_soft_cap", float)
    if chunk_size is not None:
        chunk_size = _static_number(chunk_size, "chunk_size", int)
    dropout_rate = _static_number(dropout_rate, "dropout_rate", float)
    num_sink_tokens = _static_number(num_sink_tokens, "num_sink_tokens", int)
    return AttentionOptions(
        causal=causal,
        window=normalize_window(sliding_window, causal),
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        layout=layout,
        axis_name=axis_name,
        axis_size=axis_size,
        has_segments=has_segments,
        has_sinks=has_sinks,
        chunk_size=chunk_size,
        has_alibi=has_alibi,
        dropout_rate=dropout_rate,
        num_sink_tokens=num_sink_tokens,
    )

"""flash-attn style entry points: packed QKV / KV, and varlen with `cu_seqlens`.

All three only reshape their arguments and call `ring_attention`, so they take its
keyword arguments and support exactly what it supports.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from ringjax.api import ring_attention
from ringjax.dispatch import calling
from ringjax.layouts import local_positions
from ringjax.options import KEYWORDS_BY_NAME, check_keywords, chunks_per_shard, sequence_chunks


def _check_packed(x, name: str, parts: int, shape_text: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array of shape {shape_text}, got {type(x).__name__}")
    if x.ndim != 5 or x.shape[2] != parts:
        raise ValueError(f"{name} must have shape {shape_text}, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")


def ring_attention_qkvpacked(qkv: Float[Array, "batch seq 3 heads head_dim"], **kwargs):
    """`ring_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], **kwargs)`.

    Takes every keyword argument of `ring_attention`; gradients flow to `qkv`.
    Grouped-query attention needs separate K/V heads: use `ring_attention_kvpacked`; v with a
    head_dim of its own (multi-head latent attention) needs separate k and v: `ring_attention`.
    """
    check_keywords("ring_attention_qkvpacked", kwargs, KEYWORDS_BY_NAME)
    _check_packed(qkv, "qkv", 3, "[batch, seq, 3, heads, head_dim]")
    return ring_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], **kwargs)


def ring_attention_kvpacked(
    q: Float[Array, "batch seq heads head_dim"],
    kv: Float[Array, "batch seq 2 kv_heads head_dim"],
    **kwargs,
):
    """`ring_attention(q, kv[:, :, 0], kv[:, :, 1], **kwargs)`; gradients flow to `kv`.

    K and V packed in one array share one head_dim, q's: for v with a head_dim of its own (multi-head
    latent attention) pass k and v separately to `ring_attention`.
    """
    check_keywords("ring_attention_kvpacked", kwargs, KEYWORDS_BY_NAME)
    _check_packed(kv, "kv", 2, "[batch, seq, 2, kv_heads, head_dim]")
    if getattr(q, "ndim", None) == 4 and q.shape[3] != kv.shape[4]:
        raise ValueError(f"kv packs K and V with one head_dim ({kv.shape[4]}), which must equal q's head_dim "
                         f"({q.shape[3]}); for a v_head_dim other than q's (multi-head latent attention) pass k "
                         "and v separately to ring_attention")
    return ring_attention(q, kv[:, :, 0], kv[:, :, 1], **kwargs)


def _check_varlen(q, k, v, cu_seqlens) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 3:
            what = {"q": "heads, head_dim", "k": "kv_heads, head_dim", "v": "kv_heads, v_head_dim"}[name]
            raise ValueError(f"{name} must have shape [total_tokens, {what}], got {x.shape}")
    if not hasattr(cu_seqlens, "shape") or not hasattr(cu_seqlens, "dtype"):
        raise TypeError(f"cu_seqlens must be an int32 array, got {type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must have shape [num_seqs + 1], got {cu_seqlens.shape}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"cu_seqlens must be an integer array (int32), got {cu_seqlens.dtype}")


def _check_cu_values(cu_seqlens, total: int) -> None:
    """Value checks, only possible when cu_seqlens is concrete (not under jit)."""
    try:
        cu = np.asarray(cu_seqlens)
    except Exception:  # noqa: BLE001 - a tracer: values unknown until run time
        return
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    if cu[-1] > total:
        raise ValueError(f"cu_seqlens[-1] ({cu[-1]}) exceeds the global number of tokens ({total})")


def _global_order_positions(layout: str, axis_size: int, total: int) -> np.ndarray:
    """Positions of a global array in `layout` order (what `to_layout` produces)."""
    local = total // axis_size
    return np.concatenate([local_positions(layout, s, axis_size, local, xp=np) for s in range(axis_size)])


def ring_attention_varlen(
    q: Float[Array, "total_tokens heads head_dim"],
    k: Float[Array, "total_tokens kv_heads head_dim"],
    v: Float[Array, "total_tokens kv_heads v_head_dim"],
    cu_seqlens: Int[Array, " num_seqs_plus_1"],
    **kwargs,
):
    """Ring attention over sequences packed end to end, as flash-attn's varlen functions.

    `cu_seqlens` holds the cumulative lengths [0, len_0, len_0 + len_1, ...] over the
    whole global batch, also inside `shard_map` where q, k, v are local shards.
    Sequence i is global positions [cu_seqlens[i], cu_seqlens[i+1]); tokens at or beyond
    cu_seqlens[-1] are padding (output 0, lse -inf). Global arrays, as for
    `ring_attention`, are in `layout` order (see `to_layout`).

    Takes the keyword arguments of `ring_attention` except `segment_ids` (derived from
    cu_seqlens) and the hybrid strategy (one axis_name). Returns out [total_tokens, heads,
    v_head_dim] and, with `return_lse`, lse [heads, total_tokens]. cu_seqlens values are
    checked (start 0, non-decreasing, within the tokens) only when concrete; under jit they
    are trusted.
    """
    check_keywords("ring_attention_varlen", kwargs, KEYWORDS_BY_NAME.keys() - {"segment_ids"},
                   hints={"segment_ids": "it derives segment_ids from cu_seqlens"})
    _check_varlen(q, k, v, cu_seqlens)
    axis_name = kwargs.get("axis_name", "sp")
    if isinstance(axis_name, (tuple, list)) or kwargs.get("strategy") == "hybrid":
        raise ValueError("ring_attention_varlen takes one axis_name, not the hybrid strategy's (head_axis, ring_axis) "
                         "pair; for hybrid, call ring_attention with segment_ids")
    layout = kwargs.get("layout", "contiguous")
    call = calling.resolve(axis_name, kwargs.get("mesh"))
    mode, axis_size = call.mode, call.axis_size
    local_len = q.shape[0]
    if mode == "local":
        total = local_len * axis_size
        if local_len % chunks_per_shard(layout):
            raise ValueError(f"zigzag layout needs an even local sequence length, got {local_len}")
        pos = local_positions(layout, lax.axis_index(axis_name), axis_size, local_len)
    else:
        total = local_len
        chunks = sequence_chunks(layout, axis_size)
        if mode == "global" and total % chunks:
            raise ValueError(f"total_tokens {total} must be divisible by {chunks} (axis size, layout {layout!r})")
        pos = jnp.asarray(_global_order_positions(layout, axis_size, total) if mode == "global"
                          else np.arange(total, dtype=np.int32))
    _check_cu_values(cu_seqlens, total)
    cu = cu_seqlens.astype(jnp.int32)
    seg = jnp.searchsorted(cu, pos, side="right").astype(jnp.int32) - 1
    seg = jnp.where(pos >= cu[-1], -1, seg)
    result = ring_attention(q[None], k[None], v[None], segment_ids=seg[None], **kwargs)
    if kwargs.get("return_lse", False) is True:
        out, lse = result
        return out[0], lse[0]
    return result[0]

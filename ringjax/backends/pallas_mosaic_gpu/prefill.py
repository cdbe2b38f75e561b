"""Prefill: a long chunk of new tokens against one device's cache part, on the ring's forward kernel.

`cache_attention` gives each device queries at consecutive positions per row (q_pos[b, i] = q_pos[b, 0] + i)
and a cache part striped over the axis (slot j of device d holds position j * n + d). The forward kernel
(`kernels.block_fwd`) takes a 64-token block's positions as start + stride * i, one static stride for the
queries and the keys, and one position vector for every batch row. So the queries are regrouped by position
mod n (query n * j + r becomes row j of group r): both then step by n, as in the striped ring. Rows, whose
positions differ, run one after another (`lax.map`). Causal masks hide the slots past a row's length (its
queries lie before them); without `causal`, padding segment ids do.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax.backends.pallas_mosaic_gpu.config import ROWS, MosaicGpuConfig
from ringjax.core.masks import Extras, TokenInfo
from ringjax.core.problem import Problem
from ringjax.options import AttentionOptions

_FAR = 1 << 30  # how far before position 0 the tiles of padding alone sit


def kernel_options(opts: AttentionOptions) -> AttentionOptions:
    """The kernel's options: without `causal` the slots past each row's length are segment -1 (padding)."""
    return opts if opts.causal else dataclasses.replace(opts, has_segments=True)


def refusal(problem: Problem, config: MosaicGpuConfig | None = None) -> str | None:
    """Why `partials` cannot run a `cache_attention` problem (q_seq new tokens against seq cache slots per
    device), or None: the forward kernel's own refusal of the call, and what the regrouping needs."""
    from ringjax.backends.pallas_mosaic_gpu import implementation

    opts = problem.opts
    if not opts.causal and opts.num_sink_tokens:
        return "sink tokens without causal: the prefill kernel masks slots past a row's length by segment ids"
    kernel_problem = dataclasses.replace(problem, opts=kernel_options(opts), q_seq=None)
    return implementation._refusal(kernel_problem, config)


def _regroup(x, n: int, axis: int):
    """Element n * j + r of `axis` to position r * (len / n) + j (positions mod n together); numpy or jax."""
    shape = x.shape[:axis] + (x.shape[axis] // n, n) + x.shape[axis + 1:]
    return x.reshape(shape).swapaxes(axis, axis + 1).reshape(x.shape)


def _ungroup(x, n: int, axis: int):
    """The inverse of `_regroup`."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return x.reshape(shape).swapaxes(axis, axis + 1).reshape(x.shape)


def partials(q, k, v, q_pos, k_pos, k_len, opts: AttentionOptions, extras: Extras | None = None,
             config: MosaicGpuConfig | None = None):
    """Attention of q [B, t, H, D] to this device's cache part k [B, S, KVH, D], v [B, S, KVH, Dv].

    q_pos [B, t] int32: consecutive positions per row (q_pos[b, 0] + i); k_pos [S] int32: the part's slots,
    striped with stride `opts.axis_size`; k_len [B]: slot s of row b is a key iff k_pos[s] < k_len[b].
    `extras` carries ALiBi's slopes. Returns out [B, t, H, Dv] and lse [B, t, H], float32, as
    `decode.partials`; a row that sees no key gets 0 and -inf.
    """
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_fwd

    n = opts.axis_size
    b, t, h, d = q.shape
    config = config or MosaicGpuConfig()
    # every group of the regrouped queries holds whole pairs of 64-row tiles
    unit = 2 * ROWS * n
    padded = -(-t // unit) * unit
    q = _regroup(jnp.pad(q, ((0, 0), (0, padded - t), (0, 0), (0, 0))), n, 1)
    order = _regroup(np.arange(padded), n, 0)  # each regrouped row's query index
    padding = order >= t
    # 64-row tiles of padding alone sit far before position 0 (and in no segment): they see no key, so the
    # kernel's visit table skips them
    idle = np.repeat(padding.reshape(-1, ROWS).all(axis=1), ROWS)
    offsets = jnp.asarray(np.where(idle, order - _FAR, order), jnp.int32)
    kernel_opts = kernel_options(opts)
    k_pos = k_pos.astype(jnp.int32)
    extras = extras or Extras()

    def row(args):
        q_row, k_row, v_row, first, length = args
        q_seg = k_seg = None
        if kernel_opts.has_segments:
            q_seg = jnp.asarray(np.where(padding, -1, 0), jnp.int32)[None]
            k_seg = jnp.where(k_pos < length, 0, -1)[None]
        out, lse = block_fwd(q_row[None], k_row[None], v_row[None], TokenInfo(first + offsets, q_seg),
                             TokenInfo(k_pos, k_seg), extras, kernel_opts, config)
        return out[0], lse[0]

    out, lse = lax.map(row, (q, k, v, q_pos[:, 0].astype(jnp.int32), k_len.astype(jnp.int32)))
    out = _ungroup(out, n, 1)[:, :t]  # [B, t, H, Dv]
    lse = _ungroup(lse, n, 2)[:, :, :t].swapaxes(1, 2)  # [B, t, H]
    return out, lse


__all__ = ["kernel_options", "partials", "refusal"]

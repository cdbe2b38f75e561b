"""The score modifiers, written once as functions on values that every kernel calls.

Logits (scale and soft cap, in natural or base-2 units, with their slope for the backward),
ALiBi's distance term, and dropout's counter-based keep mask. Kernels apply them to whatever
tile they hold: XLA arrays, Triton blocks or Mosaic GPU register tiles.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ringjax.options import AttentionOptions

LOG2E = 1.0 / math.log(2.0)


def logits(qk: jnp.ndarray, opts: AttentionOptions) -> jnp.ndarray:
    """Scaled (and soft-capped) logits from raw float32 dot products."""
    s = qk * opts.softmax_scale
    if opts.logits_soft_cap is not None:
        cap = opts.logits_soft_cap
        s = cap * jnp.tanh(s / cap)
    return s


def logits2(qk, opts: AttentionOptions):
    """Base-2 logits (logits * log2 e, so exp2 replaces exp) of raw dot products, and tanh of the
    soft cap (None without one). Without a soft cap log2 e folds into the scale: one multiply."""
    x = folded_scores(qk, opts)
    return x * logit_factor(opts), (None if opts.logits_soft_cap is None else x)


def folded_scores(qk, opts: AttentionOptions):
    """Scores x whose base-2 logits are x * `logit_factor`: the raw dot products, or with a soft cap
    tanh(qk scale / cap). The factor is a positive constant, so a kernel keeps it out of the row max and
    multiplies it in where exp2's argument is one FMA anyway."""
    if opts.logits_soft_cap is None:
        return qk
    return jnp.tanh(qk * (opts.softmax_scale / opts.logits_soft_cap))


def logit_factor(opts: AttentionOptions) -> float:
    """log2 e times the scale, or with a soft cap times the cap: see `folded_scores`."""
    return (opts.softmax_scale if opts.logits_soft_cap is None else opts.logits_soft_cap) * LOG2E


def cap_slope(t):
    """d (cap * tanh(s / cap)) / ds from its tanh t: the soft cap's factor in the backward."""
    return 1.0 - t * t


def logit_slope(t, opts: AttentionOptions):
    """d logits / d qk from `logits2`'s tanh (t is None without a soft cap)."""
    if t is None:
        return opts.softmax_scale
    return opts.softmax_scale * cap_slope(t)


def logits_and_slope(qk: jnp.ndarray, opts: AttentionOptions) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Logits and their derivative with respect to the raw dot product."""
    s = qk * opts.softmax_scale
    if opts.logits_soft_cap is None:
        return s, jnp.asarray(opts.softmax_scale, qk.dtype)
    t = jnp.tanh(s / opts.logits_soft_cap)
    return opts.logits_soft_cap * t, opts.softmax_scale * cap_slope(t)


def alibi_distance(q_pos, k_pos) -> jnp.ndarray:
    """-|i - j| [Tq, Tk] float32: ALiBi adds slope[h] times this to the logits (after the soft cap)."""
    return alibi_distance_pairs(q_pos[:, None], k_pos[None, :])


def alibi_distance_pairs(q_pos, k_pos) -> jnp.ndarray:
    """`alibi_distance` on positions that already broadcast against each other (kernel tiles)."""
    return -jnp.abs(q_pos - k_pos).astype(jnp.float32)


def _fmix32(x):
    # murmur3's finaliser: a bijection on uint32 with full avalanche
    x = _fmix32_high(x)
    return x ^ (x >> 16)


def _fmix32_high(x):
    """murmur3's finaliser without its last xor-shift, which changes only the low 16 bits: the same top 16
    bits, so a threshold test on it decides as the finaliser does but where those bits tie the threshold's."""
    return _fmix32_after_first_shift(_xor_shift16(x))


def _xor_shift16(x):
    """The finaliser's first step, x ^ (x >> 16). A logical shift distributes over xor, so for x = a ^ b it is
    _xor_shift16(a) ^ _xor_shift16(b)."""
    return x ^ (x >> 16)


def _fmix32_after_first_shift(x):
    x *= jnp.uint32(0x85EBCA6B)
    x ^= x >> 13
    x *= jnp.uint32(0xC2B2AE35)
    return x


def dropout_batch_head(head_slice, batch_index, head_index, local_heads: int):
    """The (batch, head) counter of the dropout hash: b * heads + h, in global head indices.

    `batch_index` and `head_index` are local and broadcast; `head_slice` is `Extras.head_slice`.
    """
    if head_slice is None:
        return batch_index * local_heads + head_index
    return batch_index * head_slice[1] + head_slice[0] + head_index


def dropout_keep(seed, rate: float, batch_head, q_pos, k_pos) -> jnp.ndarray:
    """Counter-based dropout mask: a pure function of (seed, batch*heads+head, i, j).

    `batch_head` broadcasts against [Tq, Tk] (e.g. shape [B, H, 1, 1]); the same key
    and global positions give the same mask on any ring size and layout.
    """
    key = dropout_key(seed[0], seed[1], batch_head)
    return dropout_keep_pairs(key, rate, q_pos[:, None], k_pos[None, :])


def dropout_key(seed0, seed1, batch_head):
    """The uint32 key of one (seed, batch*heads+head): everything of the hash but the positions."""
    x = _fmix32(batch_head.astype(jnp.uint32) * jnp.uint32(0xC2B2AE3D) + seed0)
    return _fmix32(x ^ seed1)


def dropout_terms(key, q_pos, k_pos):
    """The hash's query and key terms, each already through the finaliser's first xor-shift (`_xor_shift16`
    distributes over the xor that joins them); `dropout_keep_terms` mixes them. Kernels compute them on a
    tile's row and column vectors, so only the rest of the mixing runs per element."""
    q_term = q_pos.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
    k_term = k_pos.astype(jnp.uint32) * jnp.uint32(0x85EBCA77) + key
    return _xor_shift16(q_term), _xor_shift16(k_term)


def dropout_keep_terms(rate: float, q_term, k_term) -> jnp.ndarray:
    """Keep iff murmur3's finaliser of (q term xor k term), less its last xor-shift, clears the rate's threshold:
    6 integer operations per element (xor, two multiplies, a shift-xor, compare), the first xor-shift done per
    vector by `dropout_terms`. The last xor-shift cost the Mosaic GPU forward 14% at 8K (1 H100, 2026-11-26) and
    would change the decision of about one pair in 65536."""
    return _fmix32_after_first_shift(q_term ^ k_term) >= dropout_threshold(rate)


def dropout_keep_pairs(key, rate: float, q_pos, k_pos) -> jnp.ndarray:
    """`dropout_keep` on positions that already broadcast against each other, with the key of
    `dropout_key`."""
    return dropout_keep_terms(rate, *dropout_terms(key, q_pos, k_pos))


def dropout_threshold(rate: float):
    """uint32 t: a hash value x is kept iff x >= t, so a fraction `rate` is dropped."""
    return jnp.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))

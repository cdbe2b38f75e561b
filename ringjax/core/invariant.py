"""`deterministic="invariant"`: the same bits on any ring size and layout.

Every kernel call takes one granule of G queries against one granule of G keys, G a function of the global
sequence length alone (`granule`), so each partial result is the same computation on the same data whatever
the ring; the partials then add in fixed point (`core.fixed`), whose sums do not depend on their order. A kernel
whose rows do not depend on each other (`rows_at_once`) takes every local granule of one side at once against
one granule of the other: the same partials in 2m calls per ring step instead of m^2.

Forward: the ring runs twice. The first pass takes each query's largest partial lse (a max is exact); the
second adds every partial output scaled by w = exp(partial lse - that max) <= 1, and the w themselves, so
out = sum(w o) / sum(w) and lse = max + log(sum(w)). Backward: one pass; dQ, dK, dV and ALiBi's slopes add
per granule pair, dK/dV travelling with their K/V as int32 limbs. Every grid is set by bounds on the sums
built from maxima of |q|, |k|, |v|, |dO| and |delta| over the ring (exact, so the same on any ring).
Costs: the forward twice, a full ring (no shortened ring, no sink step), limbs 5x float32 in memory and on
the wire, and one kernel call per visible granule pair (or per granule, rows at once).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ringjax import _compat
from ringjax.core import fixed
from ringjax.core.masks import TokenInfo, maybe_visible
from ringjax.core.schedule import steps_may_be_empty
from ringjax.core.shards import query_info, shard_info, shift
from ringjax.core.tiles import shard_range
from ringjax.merge import sink_probability
from ringjax.options import AttentionOptions

MOST_GRANULE = 1024  # tokens
# granules per sequence at least: a granule must fit one contiguous run of a device's tokens, and the zigzag
# layout on 32 devices cuts a sequence into 64 runs
FEWEST_GRANULES = 64
# bounds are computed in float32 and products may round above them: each is taken 16x larger
_MARGIN = 16.0


def granule(seq: int) -> int:
    """Tokens per granule of a global sequence of `seq`: the largest power of two that divides it and is at
    most min(MOST_GRANULE, seq // FEWEST_GRANULES) (1 for short sequences)."""
    most = max(1, min(MOST_GRANULE, seq // FEWEST_GRANULES))
    g = 1
    while g * 2 <= most and seq % (g * 2) == 0:
        g *= 2
    return g


def check(opts: AttentionOptions, seq: int) -> None:
    """ValueError unless every contiguous run of a device's `seq` tokens is a whole number of granules."""
    if opts.layout == "striped" and opts.axis_size > 1:
        raise ValueError("deterministic='invariant' needs layout 'contiguous' or 'zigzag': a striped shard's tokens "
                         "are no run of the sequence, so its granules would change with the ring size")
    g = granule(seq * opts.axis_size)
    run = seq // opts.shards_per_device
    if run % g:
        raise ValueError(
            f"deterministic='invariant' cuts the sequence of {seq * opts.axis_size} tokens into granules of {g}, "
            f"which must divide each contiguous run of a device's tokens ({run} here: layout {opts.layout!r} on "
            f"{opts.axis_size} devices); use fewer devices or a sequence with more factors of two")


def strategy_refusal(strategy: str) -> str | None:
    """Why `deterministic="invariant"` cannot run under `strategy`, or None: the ring and the all-gather run
    the same granule pairs (to the bit), but Ulysses and hybrid spread the heads, so a device's kernel calls,
    and the order of their sums over heads, change with the number of devices."""
    if strategy in ("ulysses", "hybrid"):
        return (f"deterministic='invariant' runs strategy 'ring' or 'all_gather', not {strategy!r}: the heads each "
                "device holds, and with them how its kernels sum over heads, change with the number of devices")
    return None


def pair_problem(problem):
    """The problem each kernel call is (one granule pair on one device): what `supports()` must admit and what
    the config is chosen for, the same on any ring size."""
    g = granule(problem.seq * problem.opts.axis_size)
    return dataclasses.replace(problem, seq=g, q_seq=None, opts=pair_options(problem.opts), documents=None)


def pair_options(opts: AttentionOptions) -> AttentionOptions:
    """The options of one granule pair: one contiguous run of queries and one of keys on one device (the
    tokens' global positions, ids and offsets come with them)."""
    return dataclasses.replace(opts, axis_name=None, axis_size=1, layout="contiguous", subshards=1, gather_kv=False)


# ---------------------------------------------------------------------------- the ring over granule pairs


def _slice(x, start, size, axis):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis)


def _part(x, i, g: int, axis: int):
    """Granule i of x along `axis`, or all of x where i is None (a call over every local granule)."""
    return x if i is None else _slice(x, i * g, g, axis)


def _granule_info(info: TokenInfo, i, g: int) -> TokenInfo:
    return TokenInfo(_slice(info.pos, i * g, g, 0), _slice(info.seg, i * g, g, 1), _slice(info.segpos, i * g, g, 1))


def _add_at(limbs, term, i, g: int, axis: int):
    """limbs with `term` (limbs of one granule) added at granule i along `axis` of the values; of all of them
    where i is None."""
    if i is None:
        return fixed.add(limbs, term)
    part = lax.dynamic_slice_in_dim(limbs, i * g, g, axis + 1)
    return lax.dynamic_update_slice_in_dim(limbs, fixed.add(part, term), i * g, axis + 1)


def rows_at_once(opts: AttentionOptions, kernel, config) -> bool:
    """Whether each call takes every local granule of one side against one granule of the other (2m calls per
    ring step instead of m^2): where the kernel's rows do not depend on the others in the call
    (`BlockKernel.rows_independent`, which knows what its kernels sum beside them), and no gradient sums over both
    sides' tokens (ALiBi's slopes)."""
    return kernel.rows_independent(opts, config) and not opts.has_alibi


def _steps(opts, q, k, v, q_seg, kv_seg, state, per_step):
    """state = per_step(q_info, key/value shard, its key info, state) for the K/V of every shard in turn, where
    state = (carry, travelling): `travelling` (sums of the visiting shard's keys) moves with the K/V and comes
    home at the end. Returns (carry, travelling)."""
    n, t = opts.axis_size, q.shape[1]
    q_info = query_info(opts, q, q_seg)
    kv = (k, v, kv_seg, q_info.segpos)
    carry, travelling = state
    for step in range(n):
        k_cur, v_cur, seg_cur, segpos_cur = kv
        k_info = shard_info(opts, lambda r, step=step: (r - step) % n, t, seg_cur, segpos_cur)
        carry, travelling = per_step(q_info, k_cur, v_cur, k_info, (carry, travelling))
        if step + 1 < n:
            kv = shift(kv, opts, 1)
            travelling = shift(travelling, opts, 1)
    # after the last step device r holds shard r + 1: each shard's own sums come home from one device back
    return carry, shift(travelling, opts, 1)


def _ring(opts, kernel, q, k, v, q_seg, kv_seg, carry, body, travelling=None):
    """Run state = body(a, c, query and key granule infos, key and value granules, pair options, state) on
    every granule pair of the local queries and each ring step's K/V (`_steps`). Returns (carry, travelling)."""
    g = granule(q.shape[1] * opts.axis_size)
    m = q.shape[1] // g
    pair = pair_options(opts)
    maybe_empty = not kernel.skips_empty_steps and steps_may_be_empty(opts)

    def per_step(q_info, k_cur, v_cur, k_info, state):
        def over_keys(c, state):
            ki = _granule_info(k_info, c, g)
            kc, vc = _slice(k_cur, c * g, g, 1), _slice(v_cur, c * g, g, 1)

            def over_queries(a, state):
                qi = _granule_info(q_info, a, g)

                def visit(state):
                    return body(a, c, qi, ki, kc, vc, pair, state)

                if not maybe_empty:
                    return visit(state)
                return lax.cond(maybe_visible(pair, shard_range(qi), shard_range(ki)), visit, lambda s: s, state)

            return lax.fori_loop(0, m, over_queries, state)

        return lax.fori_loop(0, m, over_keys, state)

    return _steps(opts, q, k, v, q_seg, kv_seg, (carry, travelling), per_step)


def _ring_rows(opts, q, k, v, q_seg, kv_seg, carry, travelling=None, by_keys=None, by_queries=None):
    """`_ring` for kernels whose rows are independent (`rows_at_once`): on each ring step, state =
    by_keys(None, c, local query info, key granule c's info, its keys and values, pair options, state) for every
    key granule c, then by_queries(a, None, query granule a's info, the shard's key info, keys and values, pair
    options, state) for every local query granule a. Returns (carry, travelling)."""
    g = granule(q.shape[1] * opts.axis_size)
    m = q.shape[1] // g
    pair = pair_options(opts)

    def per_step(q_info, k_cur, v_cur, k_info, state):
        if by_keys is not None:
            def over_keys(c, state):
                kc, vc = _slice(k_cur, c * g, g, 1), _slice(v_cur, c * g, g, 1)
                return by_keys(None, c, q_info, _granule_info(k_info, c, g), kc, vc, pair, state)

            state = lax.fori_loop(0, m, over_keys, state)
        if by_queries is not None:
            def over_queries(a, state):
                return by_queries(a, None, _granule_info(q_info, a, g), k_info, k_cur, v_cur, pair, state)

            state = lax.fori_loop(0, m, over_queries, state)
        return state

    return _steps(opts, q, k, v, q_seg, kv_seg, (carry, travelling), per_step)


def _bound(x, opts):
    """max |x| over the ring (exact: a max does not depend on order), float32."""
    b = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return b if opts.axis_name is None else lax.pmax(b, opts.axis_name)


def _one_device(x, opts):
    """x on the ring's first device and zeros on the others: the sum over the ring that shard_map's transpose
    takes of a replicated input's cotangent is then x exactly (+0.0 turns a -0.0 into the zeros' sign)."""
    if opts.axis_name is None:
        return x + 0.0
    return jnp.where(lax.axis_index(opts.axis_name) == 0, x, 0.0) + 0.0


# ---------------------------------------------------------------------------- forward


def forward(opts, kernel, config, q, k, v, q_seg, kv_seg, extras):
    """(out f32, lse) before learnable sinks."""
    b, t, h, _ = q.shape
    g = granule(t * opts.axis_size)
    refs = (q, k)

    def ring(carry, body):  # body(a, ...) with a None takes every local query granule at once
        if rows_at_once(opts, kernel, config):
            return _ring_rows(opts, q, k, v, q_seg, kv_seg, carry, by_keys=body)
        return _ring(opts, kernel, q, k, v, q_seg, kv_seg, carry, body)

    def partial(a, qi, ki, kc, vc, pair):
        return kernel.fwd(_part(q, a, g, 1), kc, vc, qi, ki, extras, pair, config)

    def biggest(a, c, qi, ki, kc, vc, pair, state):
        most, _ = state
        _, lse = partial(a, qi, ki, kc, vc, pair)
        if a is None:
            return jnp.maximum(most, lse), None
        cur = lax.dynamic_slice_in_dim(most, a * g, g, 2)
        return lax.dynamic_update_slice_in_dim(most, jnp.maximum(cur, lse), a * g, 2), None

    most0 = _compat.match_vma(jnp.full((b, h, t), -jnp.inf, jnp.float32), *refs)
    most, _ = ring(most0, biggest)
    shift_by = jnp.where(jnp.isfinite(most), most, 0.0)

    # bounds of the sums: each w <= 1, |o| <= max |v| (a convex combination; dropout scales it up)
    count = t * opts.axis_size // g
    e_w = fixed.exponent(_MARGIN * count)
    e_o = fixed.exponent(_MARGIN * count * _bound(v, opts) / (1.0 - opts.dropout_rate))

    def add(a, c, qi, ki, kc, vc, pair, state):
        (out_l, w_l), _ = state
        o, lse = partial(a, qi, ki, kc, vc, pair)
        w = jnp.exp(lse - _part(shift_by, a, g, 2))  # 0 where the pair shows nothing
        wo = jnp.swapaxes(w, 1, 2)[..., None] * o.astype(jnp.float32)
        return (_add_at(out_l, fixed.encode(wo, e_o), a, g, 1), _add_at(w_l, fixed.encode(w, e_w), a, g, 2)), None

    zeros = (_compat.match_vma(fixed.zeros((b, t, h, v.shape[3])), *refs),
             _compat.match_vma(fixed.zeros((b, h, t)), *refs))
    (out_l, w_l), _ = ring(zeros, add)
    w = fixed.decode(w_l, e_w)
    seen = w > 0
    out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None],
                    fixed.decode(out_l, e_o) / jnp.swapaxes(jnp.where(seen, w, 1.0), 1, 2)[..., None], 0.0)
    lse = jnp.where(seen, shift_by + jnp.log(jnp.where(seen, w, 1.0)), -jnp.inf)
    return out, lse


# ---------------------------------------------------------------------------- backward


def backward(kernel, q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config):
    """(dq, dk, dv, d alibi_slopes or None), float32."""
    b, t, h, d = q.shape
    kvh, dv_dim = k.shape[2], v.shape[3]
    g = granule(t * opts.axis_size)
    seq = t * opts.axis_size
    keep = 1.0 - opts.dropout_rate
    scale = opts.softmax_scale
    groups = h // kvh
    # a row's |dS| sums to at most sum_j P_ij (|dP_ij| / keep + |delta_i|), with sum_j P_ij <= 1 / keep (dropout)
    # and |dP_ij| <= v's head_dim * max|dO| * max|V|; a soft cap's derivative is at most 1
    b_do, b_delta = _bound(dout, opts), _bound(delta, opts)
    row = (dv_dim * b_do * _bound(v, opts) / keep + b_delta) / keep
    e_dq = fixed.exponent(_MARGIN * scale * _bound(k, opts) * row)
    e_dk = fixed.exponent(_MARGIN * scale * _bound(q, opts) * groups * seq * row)
    e_dv = fixed.exponent(_MARGIN * groups * seq * b_do / keep)
    e_sl = fixed.exponent(_MARGIN * b * seq * seq * row)  # |i - j| < seq
    alibi = extras.alibi_slopes is not None
    refs = (q, k, dout)

    def grads(a, qi, ki, kc, vc, pair):
        """The kernel's gradients of query granule a (None: every local one) against the keys kc."""
        return kernel.bwd(_part(q, a, g, 1), kc, vc, _part(dout, a, g, 1), _part(lse, a, g, 2),
                          _part(delta, a, g, 2), qi, ki, extras, pair, config)

    def add(a, c, qi, ki, kc, vc, pair, state):
        (dq_l, sl_l), (dk_l, dv_l) = state
        dq, dk, dv, dsl = grads(a, qi, ki, kc, vc, pair)
        dq_l = _add_at(dq_l, fixed.encode(dq, e_dq), a, g, 1)
        dk_l = _add_at(dk_l, fixed.encode(dk, e_dk), c, g, 1)
        dv_l = _add_at(dv_l, fixed.encode(dv, e_dv), c, g, 1)
        if alibi:
            sl_l = fixed.add(sl_l, fixed.encode(dsl, e_sl))
        return (dq_l, sl_l), (dk_l, dv_l)

    # rows at once: dQ of every local query against key granule c, then dK/dV of every visiting key against
    # query granule a; each call's other gradients are left unused (XLA drops a kernel whose outputs go unused)
    def add_dq(a, c, qi, ki, kc, vc, pair, state):
        (dq_l, sl_l), travelling = state
        dq = grads(None, qi, ki, kc, vc, pair)[0]
        return (fixed.add(dq_l, fixed.encode(dq, e_dq)), sl_l), travelling

    def add_dkv(a, c, qi, ki, kc, vc, pair, state):
        carry, (dk_l, dv_l) = state
        _, dk, dv, _ = grads(a, qi, ki, kc, vc, pair)
        return carry, (fixed.add(dk_l, fixed.encode(dk, e_dk)), fixed.add(dv_l, fixed.encode(dv, e_dv)))

    def zeros(*shape):
        return _compat.match_vma(fixed.zeros(shape), *refs)

    carry = (zeros(b, t, h, d), zeros(h) if alibi else None)
    travelling = (zeros(b, t, kvh, d), zeros(b, t, kvh, dv_dim))
    if rows_at_once(opts, kernel, config):
        carry, travelling = _ring_rows(opts, q, k, v, q_seg, kv_seg, carry, travelling, add_dq, add_dkv)
    else:
        carry, travelling = _ring(opts, kernel, q, k, v, q_seg, kv_seg, carry, add, travelling)
    (dq_l, sl_l), (dk_l, dv_l) = carry, travelling
    dslopes = None
    if alibi:
        dslopes = _one_device(fixed.decode(fixed.psum(sl_l, opts.axis_name), e_sl), opts)
    return (fixed.decode(dq_l, e_dq), fixed.decode(dk_l, e_dk), fixed.decode(dv_l, e_dv), dslopes)


# ---------------------------------------------------------------------------- what ring.py's custom_vjp calls


def row_dots(dout, out, opts: AttentionOptions):
    """rowsum(dout * out) [B, H, T] float32, a granule at a time: XLA's reductions may group their terms by the
    shape of the whole array, which differs from one ring size to another; a granule's is always the same."""
    b, t, h, d = out.shape
    g = granule(t * opts.axis_size)

    def granule_rows(x):
        do, o = x
        return (do.astype(jnp.float32) * o.astype(jnp.float32)).sum(axis=-1)

    def split(x):
        return jnp.moveaxis(x.reshape(b, t // g, g, h, d), 1, 0)

    rows = lax.map(granule_rows, (split(dout), split(out)))  # [T / g, B, g, H]
    return jnp.moveaxis(rows, 0, 1).reshape(b, t, h).transpose(0, 2, 1)


def sinks_grad(sinks, lse, delta, opts: AttentionOptions):
    """d sinks = -sum over rows of P(sink) * delta: each row's term in fixed point, summed exactly over the ring."""
    b, h, t = lse.shape
    p_sink = sink_probability(sinks, lse)
    e_s = fixed.exponent(_MARGIN * b * t * opts.axis_size * _bound(delta, opts))
    part = fixed.total(fixed.encode(-(p_sink * delta), e_s), (0, 2))
    return _one_device(fixed.decode(fixed.psum(part, opts.axis_name), e_s), opts).astype(sinks.dtype)

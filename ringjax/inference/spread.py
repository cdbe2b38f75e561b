"""How `cache_attention` spreads its work over the cache's axis, and the rule that picks one way.

- "pass_q": every device attends all t queries to its own stripe of the cache; the partial results
  merge by their lse with one pmax and one psum (the decode path: queries are replicated anyway).
- "pass_kv": every device keeps one contiguous block of t / n queries while the cache stripes travel
  the ring (n - 1 `ppermute`s), then the blocks' outputs are gathered (prefill of a long chunk).

Both compute the same pairs; they differ in the bytes they move, which `transfer_bytes` counts.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ringjax.layouts import local_positions
from ringjax.merge import finite_or_zero, log_sum, merge_attention

STRATEGIES = ("auto", "pass_q", "pass_kv")
LAYOUT = "striped"


def check_strategy(strategy) -> None:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def transfer_bytes(strategy: str, *, batch: int, t: int, heads: int, kv_heads: int, head_dim: int, v_head_dim: int,
                   itemsize: int, slots: int, axis_size: int) -> float:
    """Bytes one device receives for one call: pass_q all-reduces the float32 partial outputs and
    their weights of all t queries; pass_kv receives the n - 1 other stripes of `slots` slots each,
    then gathers the other blocks' outputs."""
    n = axis_size
    if n == 1:
        return 0.0
    if strategy == "pass_q":
        return 2 * (n - 1) / n * batch * t * heads * (v_head_dim + 1) * 4
    stripes = (n - 1) * batch * slots * kv_heads * (head_dim + v_head_dim) * itemsize
    return float(stripes + (n - 1) / n * batch * t * heads * v_head_dim * itemsize)


def choose(strategy: str, *, local: bool, **shape) -> tuple[str, str]:
    """The strategy to run and why. `shape` as `transfer_bytes` takes it; "auto" picks the fewer bytes
    (pass_kv needs t divisible by the axis size, and inside shard_map it changes what q is, so there
    it runs only when asked for)."""
    if strategy != "auto":
        return strategy, f"strategy={strategy!r}"
    n = shape["axis_size"]
    if n == 1:
        return "pass_q", "one device"
    if local:
        return "pass_q", "inside shard_map q is replicated: pass_kv runs only when asked for"
    q_bytes, kv_bytes = (transfer_bytes(s, **shape) for s in ("pass_q", "pass_kv"))
    why = f"pass_q moves {q_bytes / 2**20:.3g} MiB per device, pass_kv {kv_bytes / 2**20:.3g} MiB"
    if shape["t"] % n:
        return "pass_q", f"t={shape['t']} is not a multiple of the axis size {n}"
    return ("pass_kv" if kv_bytes < q_bytes else "pass_q"), why


def query_positions(lengths, counts, index, t_total: int):
    """Global positions [B, t] of the queries `index` of a call with `t_total` queries per row, and
    whether each is a real token: query i of row b is the i-th of the tokens the last append added
    (lengths[b] - counts[b] + i; without counts, the last t_total tokens), real iff i < counts[b]
    and its position is not negative."""
    grow = jnp.full_like(lengths, t_total) if counts is None else counts.astype(lengths.dtype)
    pos = (lengths - grow)[:, None] + index[None, :]
    return pos.astype(jnp.int32), (index[None, :] < grow[:, None]) & (pos >= 0)


def stripe_positions(shard, axis_size: int, slots: int):
    """Global positions [slots] of the cache stripe of device `shard`."""
    return local_positions(LAYOUT, shard, axis_size, slots)


def merge_over_axis(out, lse, axis_name):
    """Merge per-device partials (out f32 [B, t, H, Dv], lse f32 [B, t, H]) by their lse: one pmax, one psum."""
    m = finite_or_zero(lax.pmax(lse, axis_name))
    w = jnp.exp(lse - m)  # 0 on devices that see no key of a row
    total = lax.psum(jnp.concatenate([out * w[..., None], w[..., None]], axis=-1), axis_name)
    denom = total[..., -1]
    return total[..., :-1] / jnp.where(denom > 0, denom, 1.0)[..., None], log_sum(m, denom)


def _merge(out_a, lse_a, out_b, lse_b):
    out, lse = merge_attention(out_a, lse_a.swapaxes(1, 2), out_b, lse_b.swapaxes(1, 2))
    return out, lse.swapaxes(1, 2)


def pass_q(partials, q, k, v, lengths, counts, *, shard, axis_name, axis_size: int, t_total: int, **kw):
    """All t queries against this device's stripe, merged over the axis: (out, lse [B, t, H], real [B, t])."""
    q_pos, real = query_positions(lengths, counts, jnp.arange(q.shape[1], dtype=jnp.int32), t_total)
    out, lse = partials(q, k, v, q_pos, stripe_positions(shard, axis_size, k.shape[1]), lengths, **kw)
    if axis_name is not None:  # also on an axis of one device: the result is then typed replicated over it
        out, lse = merge_over_axis(out, lse, axis_name)
    return out, lse, real


def pass_kv(partials, q, k, v, lengths, counts, *, shard, axis_name, axis_size: int, t_total: int, **kw):
    """This device's block of t / n queries against every stripe, the stripes travelling the ring."""
    n, t = axis_size, q.shape[1]
    q_pos, real = query_positions(lengths, counts, shard * t + jnp.arange(t, dtype=jnp.int32), t_total)
    perm = [(i, (i + 1) % n) for i in range(n)]
    kv = (k, v)
    out = lse = None
    for step in range(n):
        # the next stripe is on its way while this one is computed
        nxt = tuple(lax.ppermute(x, axis_name, perm) for x in kv) if step + 1 < n else None
        o, l = partials(q, *kv, q_pos, stripe_positions((shard - step) % n, n, k.shape[1]), lengths, **kw)
        out, lse = (o, l) if out is None else _merge(out, lse, o, l)
        kv = nxt
    return out, lse, real


RUNS = {"pass_q": pass_q, "pass_kv": pass_kv}

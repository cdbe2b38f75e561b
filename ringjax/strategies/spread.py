"""Context-parallel strategies: how a sequence sharded over mesh axes becomes per-device attention.

- ring: K/V travel around a ppermute ring over the axis (`ring.py`); O(local sequence) memory.
- all_gather: K/V (and segment ids) gathered once over the axis, local queries attend to the
  whole sequence, dK/dV reduce-scattered back (`ring.py`, `opts.gather_kv`); K/V memory is
  O(whole sequence) per device.
- ulysses: an all-to-all turns sequence-sharded q, k, v into whole sequences of a slice of
  the heads, sorted into natural token order, each device runs single-device attention on its
  heads, the output goes back the same way. Needs the query heads divisible by the axis size;
  with fewer KV heads K/V heads are repeated first (see `run_per_device`).
- hybrid: ulysses over a head axis, then the ring over a ring axis, for
  `axis_name=(head_axis, ring_axis)` with the sequence split over both, head axis major.
  Each ring device's tokens are sorted only where the result is a layout's shard (striped);
  elsewhere the kernels run on the all-to-all's order (`AttentionOptions.subshards`).

Every strategy runs the registry's implementation on a per-device `Problem` (`Strategy.problem`);
mask rules stay in masks.py, so every feature is computed exactly as by the ring.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringjax import _compat
from ringjax.core import invariant
from ringjax.core.schedule import reach
from ringjax.dispatch import costs, registry
from ringjax.layouts import sorted_shards
from ringjax.strategies import plan, predict

STRATEGIES = ("ring", "all_gather", "ulysses", "hybrid")
CHOICES = STRATEGIES + ("auto",)

log = logging.getLogger("ringjax.strategy")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One strategy bound to mesh axes: an all-to-all over `head_axis` (ulysses, hybrid), then
    K/V exchanged over `ring_axis` (ring, all_gather, hybrid). Sizes are the axes' sizes."""

    name: str
    head_axis: str | None = None
    head_size: int = 1
    ring_axis: str | None = None
    ring_size: int = 1
    # after the all-to-all, sort each device's tokens by position where a layout's shard then describes them
    # (`layouts.sorted_shards`): the kernels' walk from a tile's first visible block to its last crosses no
    # hidden chunk. False keeps the all-to-all's order, as the measurements of 2026-11-25 ran
    sort_tokens: bool = True

    @property
    def seq_axes(self):
        """What the sequence axis is sharded over: one axis name, a (head, ring) pair, or None."""
        if self.head_axis is not None and self.ring_axis is not None:
            return (self.head_axis, self.ring_axis)
        return self.head_axis if self.head_axis is not None else self.ring_axis

    @property
    def num_shards(self) -> int:
        return self.head_size * self.ring_size

    def problem(self, base: registry.Problem) -> registry.Problem:
        """The per-device problem the implementation runs, from the caller's local shapes.

        `base` has the local (sequence-sharded) shapes; its axis fields are replaced.
        """
        return self.placement(base)[0]

    def placement(self, base: registry.Problem) -> tuple[registry.Problem, TokenOrder | None]:
        """(`problem(base)`, the order that sorts a device's tokens after the all-to-all, None: none)."""
        ring = dict(axis_name=self.ring_axis, axis_size=self.ring_size)
        if self.head_axis is None:
            opts = dataclasses.replace(base.opts, **ring, gather_kv=self.name == "all_gather", subshards=1)
            return dataclasses.replace(base, opts=opts), None
        n = self.head_size
        if base.heads % n:
            raise ValueError(
                f"strategy={self.name!r} needs the query heads ({base.heads} per device) divisible by the size of "
                f"axis {self.head_axis!r} ({n}); use strategy='ring' or 'all_gather', or a smaller head axis"
            )
        seq = base.seq * n
        opts = dataclasses.replace(base.opts, **ring, gather_kv=False, subshards=n)
        found = _sorted(opts.layout, self.ring_size, seq, n) if self.sort_tokens else None
        order = None
        if found is not None:
            layout, order = found
            opts = dataclasses.replace(opts, layout=layout, subshards=1)
        problem = dataclasses.replace(base, opts=opts, seq=seq, heads=base.heads // n,
                                      kv_heads=_kv_heads_after_repeat(base.kv_heads, n) // n)
        return problem, order

    def describe(self) -> str:
        if self.name == "hybrid":
            return (f"hybrid (ulysses over {self.head_axis!r} of {self.head_size}, "
                    f"ring over {self.ring_axis!r} of {self.ring_size})")
        axis = self.seq_axes
        return self.name if axis is None else f"{self.name} over {axis!r} of {self.num_shards}"


@dataclasses.dataclass(frozen=True)
class TokenOrder:
    """A static permutation of a device's tokens that moves whole blocks of `block` tokens: sorted block j
    is stored block `blocks[j]`."""

    blocks: tuple[int, ...]
    block: int

    @classmethod
    def of(cls, index: np.ndarray) -> TokenOrder:
        """From `index` (the stored index of each sorted token), in the largest blocks it keeps whole."""
        breaks = np.flatnonzero(np.diff(index) != 1) + 1  # where a run of consecutive stored tokens ends
        block = math.gcd(index.size, *breaks.tolist(), *index[np.r_[0, breaks]].tolist())
        return cls(tuple(int(b) for b in index[::block] // block), block)

    @property
    def inverse(self) -> TokenOrder:
        return TokenOrder(tuple(int(b) for b in np.argsort(self.blocks)), self.block)

    def sort(self, x, axis: int = 1):
        """x with its tokens along `axis` in sorted order; the gradient is the inverse permutation."""
        return _permute(x, self, axis)

    def unsort(self, x, axis: int = 1):
        """The inverse of `sort`."""
        return _permute(x, self.inverse, axis)

    def take(self, x, axis: int = 1):
        shape = x.shape
        blocked = x.reshape(shape[:axis] + (shape[axis] // self.block, self.block) + shape[axis + 1:])
        moved = jnp.take(blocked, np.asarray(self.blocks, np.int32), axis=axis, mode="clip",
                         unique_indices=True)
        return moved.reshape(shape)


@functools.lru_cache(maxsize=64)
def _sorted(layout: str, ring_size: int, seq: int, subshards: int) -> tuple[str, TokenOrder | None] | None:
    """`layouts.sorted_shards` with its order as a `TokenOrder`."""
    found = sorted_shards(layout, ring_size, seq, subshards)
    if found is None:
        return None
    layout, index = found
    return layout, None if index is None else TokenOrder.of(index)


# a permutation's transpose is its inverse: a gather, not the scatter-add autodiff would make of one
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _permute(x, order: TokenOrder, axis: int):
    return order.take(x, axis)


def _permute_fwd(x, order, axis):
    return order.take(x, axis), None


def _permute_bwd(order, axis, _, g):
    return (order.inverse.take(g, axis),)


_permute.defvjp(_permute_fwd, _permute_bwd)


def _kv_heads_after_repeat(kv_heads: int, n: int) -> int:
    """KV heads after repeating each so that n devices can each take a whole number of them."""
    return math.lcm(kv_heads, n)


def check_strategy(strategy, axis_name) -> None:
    """ValueError/TypeError for a strategy name or an axis_name it cannot take."""
    if not isinstance(strategy, str) or strategy not in CHOICES:
        raise ValueError(f"strategy must be one of {CHOICES}, got {strategy!r}")
    pair = isinstance(axis_name, (tuple, list))
    if strategy == "hybrid" or (strategy == "auto" and pair):
        if not pair or len(axis_name) != 2 or not all(isinstance(a, str) for a in axis_name):
            raise TypeError(
                f"strategy={strategy!r} with a pair of axes takes axis_name=(head_axis, ring_axis): two mesh axis "
                "names, the sequence sharded over both with the head axis major, e.g. P(None, ('hp', 'sp')); got "
                f"{axis_name!r}" + (" (strategy='hybrid' always needs the pair)" if strategy == "hybrid" else "")
            )
        if axis_name[0] == axis_name[1]:
            raise ValueError(f"strategy={strategy!r} needs two different axes, got axis_name={tuple(axis_name)!r}")
    elif pair:
        raise TypeError(
            f"axis_name {tuple(axis_name)!r} is a pair of axes: only strategy='hybrid' (or 'auto') takes one "
            f"(got strategy={strategy!r}); the other strategies take one axis name"
        )


def bind(name: str, axis_name, sizes: dict[str, int]) -> Strategy:
    """A concrete strategy (not "auto") on the given axes; `sizes` maps axis names to their sizes."""
    if name == "hybrid":
        head, ring = axis_name
        return Strategy("hybrid", head, sizes[head], ring, sizes[ring])
    if axis_name is None:
        return Strategy(name)
    if name == "ulysses":
        return Strategy("ulysses", head_axis=axis_name, head_size=sizes[axis_name])
    return Strategy(name, ring_axis=axis_name, ring_size=sizes[axis_name])


def _head_slice(x, axis: str, first, count: int):
    """Rows [first, first + count) of a per-head parameter replicated over `axis`.

    It is cast to vary over `axis` first, so that its gradient is summed over the devices.
    """
    if x is None:
        return None
    return lax.dynamic_slice_in_dim(_compat.to_varying(x, axis), first, count)


def run_per_device(strategy: Strategy, impl, base: registry.Problem, config, q, k, v, seg, sinks, extras):
    """(out, lse) of one device's shards under `strategy`; `impl` and `config` are for `strategy.problem(base)`.

    Ulysses and hybrid: when the KV heads do not divide over the head axis, each KV head is
    repeated (lcm(kv_heads, axis size) / kv_heads times) before the all-to-all, so K/V traffic
    and memory grow by that factor; gradients of the copies are summed. The tokens the all-to-all
    leaves are sorted (`Strategy.placement`): a copy of q, k, v and of out and lse back.
    """
    problem, order = strategy.placement(base)
    if strategy.head_axis is None:
        return registry.run_per_device(impl, problem, config, q, k, v, seg, sinks, extras)
    axis, n = strategy.head_axis, strategy.head_size
    heads, local = q.shape[2], problem.heads
    repeats = problem.kv_heads * n // k.shape[2]
    if repeats > 1:
        k, v = (jnp.repeat(x, repeats, axis=2) for x in (k, v))
    # split the heads over the axis, concatenate the sequence shards in device order (layout order)
    q, k, v = (lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))
    if seg is not None:
        seg = lax.all_gather(seg, axis, axis=1, tiled=True)
    if order is not None:
        q, k, v = (order.sort(x) for x in (q, k, v))
        seg = None if seg is None else order.take(seg)
    first = lax.axis_index(axis) * local
    sinks = _head_slice(sinks, axis, first, local)
    head_slice = None
    if extras.dropout_seed is not None:  # the ring's dropout mask: hashed with the global head index
        head_slice = jnp.stack([first, jnp.int32(heads)]).astype(jnp.int32)
    extras = extras._replace(alibi_slopes=_head_slice(extras.alibi_slopes, axis, first, local), head_slice=head_slice)
    out, lse = registry.run_per_device(impl, problem, config, q, k, v, seg, sinks, extras)
    if order is not None:
        out, lse = order.unsort(out), order.unsort(lse, axis=2)
    out = lax.all_to_all(out, axis, 1, 2, tiled=True)
    lse = lax.all_to_all(lse, axis, 2, 1, tiled=True)
    return out, lse


def decide(base: registry.Problem, axis_name, sizes: dict[str, int], *, implementation: str = "auto",
           op: str = "ring_attention", chip: plan.Chip | None = None) -> tuple[Strategy, str]:
    """(strategy, reason) from the cost model alone: its fastest strategy that fits in memory and that
    `implementation` runs. `chip` defaults to the CHIPS entry of this platform's device kind."""
    strategy, reason, _ = _decide(base, axis_name, sizes, implementation, op, chip)
    return strategy, reason


def _decide(base, axis_name, sizes, implementation, op, chip):
    """(model's choice, reason, the strategies worth measuring)."""
    if axis_name is None:
        return Strategy("ring"), "axis_name=None: one device, nothing to distribute", []
    if isinstance(axis_name, tuple):
        hybrid = bind("hybrid", axis_name, sizes)
        return hybrid, "axis_name is a pair of axes: hybrid is the strategy over two", []
    n = sizes[axis_name]
    ring = bind("ring", axis_name, sizes)
    if n == 1:
        return ring, f"axis {axis_name!r} has one device", []
    runnable, refused = [], []
    for name in ("ring", "all_gather", "ulysses"):
        why = _refusal(bind(name, axis_name, sizes), base, implementation, op)
        if why is None:
            runnable.append(bind(name, axis_name, sizes))
        else:
            refused.append(f"{name}: {why}")
    calibration = costs.for_problem(base) if chip is None else None
    predicted = None if calibration is None or not runnable else predict.strategy_costs(
        base, runnable, calibration, implementation=implementation, op=op)
    if predicted is not None:
        return _best(predicted, runnable, refused, axis_name, sizes,
                     f"predicted on {n} x {calibration.device_kind}")
    if reach(base.opts) is not None:
        return ring, ("the mask bounds how far a query sees (sliding_window or chunk_size): the ring skips the "
                      "shards out of reach, which the cost model does not price"), runnable
    if chip is None:
        kind = base.device_kind or registry.current_device_kind(base.platform)
        chip = plan.chip_for(kind)
        if chip is None:
            return ring, (f"no cost figures for device kind {kind!r} (ringjax.strategies.plan.CHIPS): the default, "
                          "ring"), runnable
    if base.dtype not in ("bfloat16", "float16") or (base.dtype == "float16" and chip.kind == "tpu"):
        return ring, f"the cost model has no {base.dtype} rates for {chip.name}: the default, ring", runnable
    chip_costs = plan.strategy_costs(chip, devices=n, seq_len=base.seq * n, heads=base.heads,
                                     kv_heads=base.kv_heads, head_dim=base.head_dim, v_head_dim=base.v_head_dim,
                                     dtype=base.dtype, causal=base.opts.causal, layout=base.opts.layout,
                                     batch=base.batch)
    return _best(chip_costs, runnable, refused, axis_name, sizes, f"cost model on {n} x {chip.name}")


def _best(costs_, runnable, refused, axis_name, sizes, source):
    """(fastest runnable strategy that fits, reason, runnable) from predicted costs."""
    names = {s.name for s in runnable}
    for cost in costs_:
        if cost.strategy in names and not (cost.fits and math.isfinite(cost.total_s)):
            refused.append(f"{cost.strategy}: {cost.note}")
            names.discard(cost.strategy)
    runnable = [s for s in runnable if s.name in names]
    ok = [c for c in costs_ if c.strategy in names]
    if not ok:
        return bind("ring", axis_name, sizes), "no strategy can run: " + "; ".join(refused), []
    best = plan.best_strategy(ok)
    others = ", ".join(f"{c.strategy} {c.total_s * 1e3:.3g} ms" for c in costs_
                       if c is not best and math.isfinite(c.total_s))
    tie = min(ok, key=lambda c: c.total_s) is not best
    reason = (f"{source}: {best.total_s * 1e3:.3g} ms forward + backward"
              + (f" against {others}" if others else "")
              + (f" (within {plan.TIE_TOLERANCE:.0%}: the ring is kept)" if tie else "")
              + (f"; ruled out: {'; '.join(refused)}" if refused else ""))
    return bind(best.strategy, axis_name, sizes), reason, runnable


def _refusal(strategy: Strategy, base: registry.Problem, implementation: str, op: str) -> str | None:
    if base.opts.invariant and (why := invariant.strategy_refusal(strategy.name)):
        return why
    try:
        registry.choose(op, implementation, strategy.problem(base))
    except ValueError as e:
        return " ".join(str(e).split())
    return None

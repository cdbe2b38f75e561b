"""The strategy cost model calibrated per device kind: the predicted kernel time of the implementation each
strategy will run (`dispatch/costs.py`) plus its collectives at measured rates.

Per device, N devices on the axis, t local tokens, s bytes per element:
- ring: the kernels of every visited step, and at each step after the first the chip's ring-step cost
  (`plan.Chip.ring_step_s`); each step's K/V shift (and backward's K/V + float32 dK/dV) shows only where it
  outlasts that step's compute; the backward's dK/dV trip home shows whole; a fused ring (`fused` in the
  config its implementation picks) pays no step cost, and its copies (K/V; backward K/V and float32 dK/dV)
  show in part (`FUSED_COPY_SHOWN`, fitted);
- all_gather: gather (N - 1) K/V shards forward, again backward, reduce-scatter float32 dK/dV; none hidden;
  where the fused ring's kernel does the gather (Mosaic GPU), priced as a fused ring over every device;
- ulysses: q, k, v to whole sequences of H/N heads and out, lse back (one all-to-all each; backward the
  transposes), (N - 1)/N of each array moving, none hidden; where the layout leaves a device's tokens out of
  order, sorting them is a copy of q, k, v, out and lse each way (read and written at the chip's HBM
  bandwidth: `plan.token_sort_s`), and with `Strategy.sort_tokens` off its kernel walks the subshards'
  hidden pairs instead (`costs.visited_pairs`).
Collectives are priced by the device kind's calibration where it measured them, else by the chip's measured
figures (`plan.CHIPS`), else at the calibration's ring-shift rate, else at the chip's nominal link rate; the
costs say which stand-in they used.
"""

from __future__ import annotations

import math

from ringjax.dispatch import costs, registry
from ringjax.strategies import plan


def _collective(calibration: costs.Calibration, kind: str, notes: list[str]) -> costs.Collective:
    if kind in calibration.collectives:
        return calibration.collectives[kind]
    chip = plan.chip_for(calibration.device_kind)
    if chip is not None and chip.collective(kind) is not None:
        return chip.collective(kind)
    found = calibration.collective(kind)  # the ring shift's rate standing in
    if found is not None:
        if found[1] not in notes:
            notes.append(found[1])
        return found[0]
    link = chip.link_bandwidth if chip is not None else 50e9
    note = f"collectives priced at {'the nominal' if chip else 'an assumed'} {link / 1e9:.0f} GB/s (none measured)"
    if note not in notes:
        notes.append(note)
    return costs.Collective(0.0, link)


def strategy_costs(base: registry.Problem, strategies, calibration: costs.Calibration, *,
                   implementation: str = "auto", op: str = "ring_attention",
                   memory_fraction: float = plan.DEFAULT_MEMORY_FRACTION,
                   fused: bool | None = None) -> tuple[plan.StrategyCost, ...] | None:
    """Predicted cost of each of `strategies` (bound `spread.Strategy`s over one axis) for the local problem
    `base`, or None if the calibration cannot predict the kernel one of them would run. `fused`: whether the
    ring runs fused (None: as the implementation's heuristic config says here)."""
    out = []
    for strategy in strategies:
        problem = strategy.problem(base)
        reg, impl = registry.choose(op, implementation, problem)
        # a config with `fused` (Mosaic GPU, TPU) set moves K/V from inside its kernels (the all-gather
        # strategy's gather too: `Problem.as_ring`) where the heuristic's says so; for a device kind this host
        # lacks, it judges one process holding every GPU of the ring
        in_kernel = strategy.name in ("ring", "all_gather") and (
            fused if fused is not None else bool(getattr(impl.default_config(problem), "fused", False)))
        if in_kernel:  # the all-gather's kernel is the ring's: priced as the ring's, to the same figure
            problem = problem.as_ring()
        # a fused pass is one launch over every step: the per-call overhead once, not once per step
        kernel = costs.predict(calibration, reg.name, problem, launches=1 if in_kernel else None)
        if kernel is None:
            return None
        fused_note = " (fused ring)" if strategy.name == "ring" else " (gathered by the fused ring's kernel)"
        notes = [n for n in (f"runs {reg.name}" + (fused_note if in_kernel else ""), kernel.note) if n]
        fwd, bwd, memory = _communication(strategy, base, problem, kernel, calibration, notes, in_kernel)
        sort = _token_sort_s(strategy, base, calibration, notes)
        hbm = calibration.hbm_bytes or (getattr(plan.chip_for(calibration.device_kind), "hbm_bytes", 0.0))
        budget = memory_fraction * hbm if hbm else math.inf
        out.append(plan._cost(strategy.name, kernel.fwd_s + fwd + sort, kernel.fwd_bwd_s - kernel.fwd_s + bwd + sort,
                              fwd + bwd, memory, budget, "; ".join(notes), in_kernel))
    return tuple(out)


# the share of a fused pass's copies (at the ppermute rate) its time shows beyond its kernel's: the copies run
# beside the compute, but their CTAs hold SMs and their bytes share HBM. Fitted to the 21 fused rows of 2 H100 and
# 2 H200 (jax 0.11.2, 2026-11-26 to 28; 4K-32K tokens per GPU, 8 and 32 KV heads; ring and all-gather): priced
# whole they read up to 15.5% high (2 H100 at 4K, 2 H200 MHA at 8K), priced hidden up to 13.2% low (MHA at 8K),
# at half within 6.4% (the per-row shares 0.29-0.69 where the kernel's own prediction is not the larger miss)
FUSED_COPY_SHOWN = 0.5


def _communication(strategy, base, problem, kernel: costs.Prediction, calibration, notes, fused: bool = False):
    """(exposed forward collective seconds, exposed backward seconds, extra memory bytes) of one strategy;
    `fused`: the ring's kernels copy K/V (backward: and the float32 dK/dV partials) themselves."""
    s = base.itemsize
    f32 = 4.0 / s
    n = strategy.num_shards
    q_loc = base.batch * base.seq * base.heads * base.head_dim * s
    o_loc = base.batch * base.seq * base.heads * base.v_head_dim * s  # out, dout
    kv_loc = 1.0 * base.batch * base.seq * base.kv_heads * (base.head_dim + base.v_head_dim) * s
    if fused:  # a ring, or an all-gather, by the fused ring's kernels
        # no step pays a launch or a merge, and the copies show in part (FUSED_COPY_SHOWN)
        shift = _collective(calibration, "ppermute", notes)
        others = costs.calls(problem) - 1
        return (FUSED_COPY_SHOWN * shift.seconds(others * kv_loc),
                FUSED_COPY_SHOWN * shift.seconds(others * kv_loc * (1 + f32)), others * kv_loc * (1 + f32))
    if strategy.name == "ring":
        shift = _collective(calibration, "ppermute", notes)
        chip = plan.chip_for(calibration.device_kind)
        paid_fwd, paid_bwd = chip.ring_step_s if chip is not None else (0.0, 0.0)
        steps = costs.calls(problem)
        fwd_step, bwd_step = kernel.fwd_s / steps, (kernel.fwd_bwd_s - kernel.fwd_s) / steps
        fwd = (steps - 1) * (paid_fwd + max(0.0, shift.seconds(kv_loc) - fwd_step))
        bwd = (steps - 1) * (paid_bwd + max(0.0, shift.seconds(kv_loc * (1 + f32)) - bwd_step)) \
            + shift.seconds(kv_loc * f32)
        return fwd, bwd, 2 * kv_loc * (1 + f32)
    if strategy.name == "all_gather":
        gather = _collective(calibration, "all_gather", notes).seconds((n - 1) * kv_loc)
        scatter = _collective(calibration, "reduce_scatter", notes).seconds((n - 1) * kv_loc * f32)
        return gather, gather + scatter, n * kv_loc * (1 + f32)
    # ulysses: every array an all-to-all of its own
    a2a = _collective(calibration, "all_to_all", notes)
    share = (n - 1) / n
    q_loc, k_rep, v_rep, o_loc, lse = _ulysses_arrays(base, n)
    fwd = sum(a2a.seconds(share * b) for b in (q_loc, k_rep, v_rep, o_loc, lse))  # q, k, v in; out, lse back
    bwd = sum(a2a.seconds(share * b) for b in (o_loc, lse, q_loc, k_rep, v_rep))  # dout, dlse in; dq, dk, dv back
    return fwd, bwd, q_loc + 2 * o_loc + k_rep + v_rep + (q_loc + k_rep + v_rep) * f32


def _ulysses_arrays(base, n: int) -> tuple[float, ...]:
    """Bytes per device of the arrays a Ulysses all-to-all over n devices moves: q, k and v (K/V heads repeated to
    divide over n), out, lse."""
    s = base.itemsize
    repeat = math.lcm(base.kv_heads, n) / base.kv_heads
    k_rep, v_rep = (base.batch * base.seq * base.kv_heads * d * s * repeat for d in base.head_dims)
    return (base.batch * base.seq * base.heads * base.head_dim * s, k_rep, v_rep,
            base.batch * base.seq * base.heads * base.v_head_dim * s, base.batch * base.heads * base.seq * 4.0)


def _token_sort_s(strategy, base, calibration: costs.Calibration, notes) -> float:
    """Seconds, each way, of sorting a device's tokens after the Ulysses all-to-all (0 where none are moved)."""
    if strategy.head_axis is None or strategy.placement(base)[1] is None:
        return 0.0
    chip = plan.chip_for(calibration.device_kind)
    if chip is None:
        notes.append("the token sort is not priced: no HBM bandwidth known for this device kind")
        return 0.0
    return plan.token_sort_s(chip, sum(_ulysses_arrays(base, strategy.head_size)))

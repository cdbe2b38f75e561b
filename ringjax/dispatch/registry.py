"""Which implementations of an op exist, where they run, and which one a call gets.

Each backend package under ringjax/backends registers its implementations by name with
their platforms, priority and feature table when the registry first looks (this module
names none of them). The module that holds an implementation's code is imported only
when it is selected or inspected, so importing ringjax never imports an optional backend.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import warnings
from typing import Any

from ringjax.core import invariant
from ringjax.core.features import Support
from ringjax.core.problem import (  # noqa: F401  (re-exported: the dispatch vocabulary)
    Implementation,
    KernelConfig,
    Problem,
    check_interpret,
    config_from_json,
    config_to_json,
    current_device_kind,
    current_platform,
    unknown_options,
)
from ringjax.dispatch import costs


def run_per_device(impl: Implementation, problem: Problem, config, q, k, v, seg, sinks, extras):
    """Run `impl` on one device's shards, inside shard_map or on one device."""
    from ringjax import _compat

    axis = problem.opts.axis_name
    if axis is not None:
        # parameters replicated over the ring get one gradient per device; the cast's
        # transpose sums them
        if sinks is not None:
            sinks = _compat.to_varying(sinks, axis)
        if extras.alibi_slopes is not None:
            extras = extras._replace(alibi_slopes=_compat.to_varying(extras.alibi_slopes, axis))
    return impl.run(problem, config, q, k, v, seg, seg, sinks, extras)


@dataclasses.dataclass(frozen=True)
class Registration:
    op: str
    name: str
    platforms: tuple[str, ...]
    priority: int
    target: str  # "module:attribute" of the Implementation, imported lazily
    auto: bool = True  # False: only runs when named explicitly (e.g. CPU simulations of kernels)
    support: Support | None = None  # its row of the feature table (None: not declared)

    def load(self) -> Implementation:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[tuple[str, str], Registration] = {}
_ALIASES: dict[tuple[str, str], str] = {}
_BACKENDS = "ringjax.backends"
_discovered = False


def register(op: str, name: str, *, platforms, priority: int, target: str, auto: bool = True,
             support: Support | None = None) -> Registration:
    """Register (or replace) an implementation of `op`; `target` is imported on first use.

    `auto=False` keeps it out of "auto" selection: it runs only when named. `support` is the
    implementation's feature table (what `python -m ringjax implementations` shows).
    """
    reg = Registration(op, name, tuple(platforms), int(priority), target, bool(auto), support)
    _REGISTRY[(op, name)] = reg
    return reg


def register_alias(op: str, old: str, new: str) -> None:
    """Keep a former implementation name working, with a DeprecationWarning naming `new`."""
    _ALIASES[(op, old)] = new


def unregister(op: str, name: str) -> None:
    """Remove an implementation (KeyError if it is not registered)."""
    del _REGISTRY[(op, name)]


def _discover() -> None:
    """Import every backend package under ringjax/backends once: each registers itself."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module(_BACKENDS)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{_BACKENDS}.{info.name}")


def registrations(op: str) -> list[Registration]:
    _discover()
    return sorted((r for r in _REGISTRY.values() if r.op == op), key=lambda r: -r.priority)


def canonical_name(op: str, implementation: str) -> str:
    """`implementation` with a deprecated alias replaced by its current name (and a warning)."""
    _discover()
    new = _ALIASES.get((op, implementation))
    if new is None:
        return implementation
    warnings.warn(f"implementation={implementation!r} is deprecated: it is now called {new!r}",
                  DeprecationWarning, stacklevel=4)
    return new


@functools.lru_cache(maxsize=None)
def _host_device_kind(platform: str) -> str | None:
    try:
        return current_device_kind(platform)
    except RuntimeError:  # no such platform on this host
        return None


def described(problem: Problem) -> bool:
    """Whether `problem` names a device kind this host does not have, or a ring over more of its devices than
    this process sees (`python -m ringjax explain --devices 8` on a host of one such GPU)."""
    if not problem.device_kind:
        return False
    if _host_device_kind(problem.platform) != problem.device_kind:
        return True
    import jax

    return problem.opts.axis_size > len(jax.devices(problem.platform))


def refusal(reg: Registration, problem: Problem) -> str | None:
    """Why `reg` cannot run `problem` here, or None.

    For a device this host does not have (`described`), only the feature table can say: limits an
    implementation checks on the device itself (GPU generation, shared memory) are assumed met.
    """
    if problem.platform not in reg.platforms:
        return f"runs on {', '.join(reg.platforms)}, not {problem.platform}"
    why = _refusal_of(reg, problem)
    if why is None and problem.opts.invariant:
        # every kernel call is one granule pair: that problem, too, must be one the implementation runs
        pair = invariant.pair_problem(problem)
        why = _refusal_of(reg, pair)
        if why is not None:
            why = f"deterministic='invariant' calls it on pairs of {pair.seq}-token granules: {why}"
    return why


def _refusal_of(reg: Registration, problem: Problem) -> str | None:
    if described(problem):
        return None if reg.support is None else reg.support.refusal(reg.name, problem)
    try:
        impl = reg.load()
    except ImportError as e:  # an optional dependency is missing
        return f"cannot be imported: {e}"
    return impl.supports(problem)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation considered for a call: why it cannot run it, or its predicted time."""

    registration: Registration
    refusal: str | None
    prediction: costs.Prediction | None

    @property
    def name(self) -> str:
        return self.registration.name


def check_name(op: str, implementation: str) -> str:
    """`implementation`'s current name (`canonical_name`); ValueError unless it is "auto" or registered."""
    implementation = canonical_name(op, implementation)
    if implementation != "auto" and (op, implementation) not in _REGISTRY:
        known = ", ".join(r.name for r in registrations(op))
        raise ValueError(f"implementation must be 'auto' or one of: {known}; got {implementation!r}")
    return implementation


# predictions closer than this do not tell implementations apart (the calibrations hold the measured cases within
# 15%): the higher priority runs. The Triton kernels' all-gather at 32K tokens per GPU with 32 KV heads was
# predicted 2% faster than the Mosaic GPU kernels' and ran 1.33x slower (2 H100, jax 0.11.2, 2026-11-28)
TIE_TOLERANCE = 0.05


def candidates(op: str, implementation: str, problem: Problem) -> list[Candidate]:
    """The implementations `implementation` may resolve to for `problem`, in the order "auto" prefers them:
    those predicted (from the device kind's calibration, `dispatch/costs.py`) fastest forward + backward
    first (by priority among those within TIE_TOLERANCE of the fastest), then the unpredicted ones by priority;
    refused ones last. A name gives just that one."""
    implementation = check_name(op, implementation)
    regs = registrations(op)
    regs = [r for r in regs if r.auto] if implementation == "auto" else [r for r in regs if r.name == implementation]
    # the calibrations price ring_attention's kernels; other ops go by priority
    calibration = costs.for_problem(problem) if op == "ring_attention" else None
    found = []
    for reg in regs:
        why = refusal(reg, problem)
        found.append(Candidate(reg, why, None if why else costs.predict(calibration, reg.name, *_priced(reg, problem))))
    # sorted is stable: registrations() is in priority order already, which decides among the predictions within
    # TIE_TOLERANCE of the fastest
    fastest = min((c.prediction.fwd_bwd_s for c in found if c.prediction and c.refusal is None), default=0.0)
    return sorted(found, key=lambda c: (c.refusal is not None, c.prediction is None,
                                        0.0 if not c.prediction or c.prediction.fwd_bwd_s <= (1 + TIE_TOLERANCE)
                                        * fastest else c.prediction.fwd_bwd_s))


def _priced(reg: Registration, problem: Problem) -> tuple[Problem, int | None]:
    """The problem `reg` runs `problem` as, and its kernel launches (None: one per ring step): an implementation
    may say otherwise (`priced_as`), e.g. the Mosaic GPU kernels' all-gather by the fused ring's kernel."""
    priced_as = getattr(reg.load(), "priced_as", None)
    return priced_as(problem) if priced_as is not None else (problem, None)


def choose(op: str, implementation: str, problem: Problem) -> tuple[Registration, Implementation]:
    """Resolve "auto" or a name to a runnable implementation (see `candidates`), or explain every refusal."""
    found = candidates(op, canonical_name(op, implementation), problem)
    if found and found[0].refusal is None:
        return found[0].registration, found[0].registration.load()
    reasons = [f"  {c.name}: {c.refusal}" for c in found]
    raise ValueError(
        f"no implementation of {op} can run this call (implementation={implementation!r}):\n" + "\n".join(reasons)
    )


def list_implementations(op: str = "ring_attention") -> list[dict[str, Any]]:
    """Registered implementations of `op`, highest priority first, and whether each runs here."""
    _discover()
    ops = sorted({o for o, _ in _REGISTRY})
    if op not in ops:
        raise ValueError(f"op must be one of {ops}, got {op!r}")
    here = current_platform()
    return [
        {
            "name": r.name,
            "platforms": r.platforms,
            "priority": r.priority,
            "runs_here": here in r.platforms,
            "auto": r.auto,
        }
        for r in registrations(op)
    ]




def feature_table(op: str = "ring_attention") -> str:
    """The coverage table (markdown) of every implementation "auto" may pick, from their `Support`."""
    from ringjax.core.features import markdown_table

    columns = [(r.name, r.support) for r in sorted(registrations(op), key=lambda r: r.priority)
               if r.auto and r.support is not None]
    return markdown_table(columns)

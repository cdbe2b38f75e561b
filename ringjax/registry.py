"""Which implementations of an op exist, where they run, and which one a call gets.

Implementations are registered by name with their platforms and priority; the
module that holds one is imported only when it is selected or inspected, so
importing ringjax never imports an optional backend.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Protocol

import jax

from ringjax.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call as a device sees it: per-device shapes, dtype and options."""

    opts: AttentionOptions
    batch: int
    seq: int  # local (per-device) sequence length
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    platform: str

    @property
    def gqa_ratio(self) -> int:
        return self.heads // self.kv_heads


class Implementation(Protocol):
    """What a backend module exposes as `IMPLEMENTATION`."""

    name: str
    config_type: type

    def supports(self, problem: Problem) -> str | None:
        """None if the problem can run, else a reason a person can act on."""

    def default_config(self, problem: Problem) -> Any:
        """The heuristic config for this problem."""

    def candidate_configs(self, problem: Problem) -> list[Any]:
        """Configs worth timing when autotuning this problem."""

    def run(self, problem: Problem, config, q, k, v, q_seg, kv_seg, sinks) -> tuple[Any, Any]:
        """Per-device, differentiable: (out, lse)."""


@dataclasses.dataclass(frozen=True)
class Registration:
    op: str
    name: str
    platforms: tuple[str, ...]
    priority: int
    target: str  # "module:attribute" of the Implementation, imported lazily
    auto: bool = True  # False: only runs when named explicitly (e.g. CPU simulations of kernels)

    def load(self) -> Implementation:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[tuple[str, str], Registration] = {}


def register(op: str, name: str, *, platforms, priority: int, target: str, auto: bool = True) -> Registration:
    """Register (or replace) an implementation of `op`; `target` is imported on first use.

    `auto=False` keeps it out of "auto" selection: it runs only when named.
    """
    reg = Registration(op, name, tuple(platforms), int(priority), target, bool(auto))
    _REGISTRY[(op, name)] = reg
    return reg


def registrations(op: str) -> list[Registration]:
    return sorted((r for r in _REGISTRY.values() if r.op == op), key=lambda r: -r.priority)


def current_platform() -> str:
    return jax.default_backend()


def refusal(reg: Registration, problem: Problem) -> str | None:
    """Why `reg` cannot run `problem` here, or None."""
    if problem.platform not in reg.platforms:
        return f"runs on {', '.join(reg.platforms)}, not {problem.platform}"
    try:
        impl = reg.load()
    except ImportError as e:  # an optional dependency is missing
        return f"cannot be imported: {e}"
    return impl.supports(problem)


def choose(op: str, implementation: str, problem: Problem) -> tuple[Registration, Implementation]:
    """Resolve "auto" or a name to a runnable implementation, or explain every refusal."""
    regs = registrations(op)
    if implementation == "auto":
        regs = [r for r in regs if r.auto]
    else:
        regs = [r for r in regs if r.name == implementation]
        if not regs:
            known = ", ".join(r.name for r in registrations(op))
            raise ValueError(f"implementation must be 'auto' or one of: {known}; got {implementation!r}")
    reasons = []
    for reg in regs:
        why = refusal(reg, problem)
        if why is None:
            return reg, reg.load()
        reasons.append(f"  {reg.name}: {why}")
    raise ValueError(
        f"no implementation of {op} can run this call (implementation={implementation!r}):\n" + "\n".join(reasons)
    )


def list_implementations(op: str = "ring_attention") -> list[dict[str, Any]]:
    """Registered implementations of `op`, highest priority first, and whether each runs here."""
    here = current_platform()
    return [
        {
            "name": r.name,
            "platforms": r.platforms,
            "priority": r.priority,
            "runs_here": here in r.platforms,
        }
        for r in registrations(op)
    ]


register("ring_attention", "xla", platforms=("cpu", "gpu", "tpu"), priority=0, target="ringjax.xla:IMPLEMENTATION")
register("ring_attention", "pallas_tpu", platforms=("tpu",), priority=20, target="ringjax.pallas.tpu:IMPLEMENTATION")
# the same TPU kernels run by the Pallas TPU interpreter on CPU: for tests, never chosen by "auto"
register(
    "ring_attention",
    "pallas_tpu_interpret",
    platforms=("cpu",),
    priority=-20,
    target="ringjax.pallas.tpu:INTERPRET_IMPLEMENTATION",
    auto=False,
)

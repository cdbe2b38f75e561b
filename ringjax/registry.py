"""Which implementations of an op exist, where they run, and which one a call gets.

Implementations are registered by name with their platforms and priority; the
module that holds one is imported only when it is selected or inspected, so
importing ringjax never imports an optional backend.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
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
    device_kind: str = ""  # e.g. "NVIDIA H100 80GB HBM3"; "" = not resolved yet (see resolved())

    def resolved(self) -> Problem:
        """This problem with `device_kind` filled in from the first device of `platform`."""
        if self.device_kind:
            return self
        return dataclasses.replace(self, device_kind=current_device_kind(self.platform))

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

    def run(self, problem: Problem, config, q, k, v, q_seg, kv_seg, sinks, extras) -> tuple[Any, Any]:
        """Per-device, differentiable: (out, lse). `extras` is a masks.Extras."""


def unknown_options(opts: AttentionOptions, known: frozenset[str]) -> list[str]:
    """Options set away from their defaults that are not in `known`.

    Every implementation lists the options it implements, so a feature added to
    AttentionOptions later is refused by each implementation until it learns it.
    """
    out = []
    for field in dataclasses.fields(opts):
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.name not in known and getattr(opts, field.name) != default:
            out.append(field.name)
    return out


def check_interpret(name: str, interpret: bool, config) -> None:
    """A kernel implementation and its interpreter twin each run only configs that say which they are."""
    if config.interpret == interpret:
        return
    kind = type(config).__name__
    if interpret:
        raise ValueError(f"{name} runs the kernels in the Pallas interpreter: pass {kind}(interpret=True)")
    raise ValueError(f"{name} compiles the kernels: pass {kind}(interpret=False), or use {name}_interpret")


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


def unregister(op: str, name: str) -> None:
    """Remove an implementation (KeyError if it is not registered)."""
    del _REGISTRY[(op, name)]


def registrations(op: str) -> list[Registration]:
    return sorted((r for r in _REGISTRY.values() if r.op == op), key=lambda r: -r.priority)


def current_platform() -> str:
    return jax.default_backend()


@functools.cache
def current_device_kind(platform: str | None = None) -> str:
    """`device_kind` of the first device of `platform` (default backend if None)."""
    return str(jax.devices(platform)[0].device_kind)


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


def config_to_json(config) -> dict[str, Any]:
    """A frozen-dataclass config as a JSON-ready dict of its fields (tuples become lists)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config must be a dataclass instance, got {type(config).__name__}")
    return {f.name: _to_json(getattr(config, f.name), f"{type(config).__name__}.{f.name}")
            for f in dataclasses.fields(config)}


def config_from_json(config_type: type, data: Any):
    """Rebuild a `config_type` from `config_to_json` output; ValueError if it does not fit.

    Unknown or missing fields and values the config's own validation rejects all
    raise ValueError naming the config type, so a stale cache entry is detectable.
    """
    name = getattr(config_type, "__name__", repr(config_type))
    if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
        raise TypeError(f"config_type must be a dataclass type, got {config_type!r}")
    if not isinstance(data, dict):
        raise ValueError(f"{name} JSON must be an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_type) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{name} has no field(s) {unknown}; fields are {sorted(fields)}")
    missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{name} JSON lacks required field(s) {missing}")
    kwargs = {key: _from_json(value, f"{name}.{key}") for key, value in data.items()}
    try:
        return config_type(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid {name} JSON {data!r}: {e}") from e


class KernelConfig:
    """Base of the backends' frozen-dataclass configs: field checks and a JSON round trip."""

    def _check_ints(self, names, valid, expected: str) -> None:
        """ValueError naming `Type.field` unless each named field is an int (not a bool) with valid(value)."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not valid(value):
                raise ValueError(f"{type(self).__name__}.{name} must be {expected}, got {value!r}")

    def _check_bools(self, names) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{type(self).__name__}.{name} must be a bool, got {type(value).__name__}")

    def to_json(self) -> str:
        return json.dumps(config_to_json(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        return config_from_json(cls, json.loads(text))


def _to_json(value, where: str):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} = {value} is not representable in JSON")
        return value
    if isinstance(value, (tuple, list)):
        return [_to_json(v, where) for v in value]
    raise TypeError(f"{where} has type {type(value).__name__}; configs hold only None, bool, int, float, "
                    "str and tuples of those")


def _from_json(value, where: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return tuple(_from_json(v, where) for v in value)
    raise ValueError(f"{where}: unexpected JSON value {value!r}")


register("ring_attention", "xla", platforms=("cpu", "gpu", "tpu"), priority=0, target="ringjax.xla:IMPLEMENTATION")
register(
    "ring_attention", "pallas_gpu", platforms=("gpu",), priority=10, target="ringjax.pallas.gpu:IMPLEMENTATION"
)
# the GPU kernels run by the Pallas interpreter: for tests on any platform, never picked by "auto"
register(
    "ring_attention",
    "pallas_gpu_interpret",
    platforms=("cpu", "gpu"),
    priority=-10,
    target="ringjax.pallas.gpu:INTERPRET_IMPLEMENTATION",
    auto=False,
)
# Hopper (sm90+) kernels through Pallas Mosaic GPU; its supports() refuses older GPUs, which get pallas_gpu
register(
    "ring_attention", "pallas_mosaic_gpu", platforms=("gpu",), priority=15,
    target="ringjax.pallas.mosaic_gpu:IMPLEMENTATION",
)
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

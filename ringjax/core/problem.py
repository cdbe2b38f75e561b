"""What a backend sees of one call, and what a backend is: `Problem`, `Implementation`, `KernelConfig`.

The shared vocabulary of dispatch and the backends; it names no backend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax

from ringjax.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call as a device sees it: per-device shapes, dtype, matmul precision and options.

    `precision` is jax's matmul precision for float32 tiles when the call was traced
    (`core.precision.current`): "default" (TF32 on GPUs), "high", "highest" (full float32) or a
    `lax.DotAlgorithmPreset` name; always "default" for other dtypes. `head_dim` is q's and k's,
    `v_head_dim` v's and the output's (multi-head latent attention: 192 and 128); None means head_dim,
    and is replaced by it, so equal problems compare (and key caches) equal.
    """

    opts: AttentionOptions
    batch: int
    seq: int  # local (per-device) sequence length
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    platform: str
    device_kind: str = ""  # e.g. "NVIDIA H100 80GB HBM3"; "" = not resolved yet (see resolved())
    precision: str = "default"
    v_head_dim: int | None = None  # None: head_dim
    # queries per device when they are not `seq` (cache_attention: the t new tokens against `seq` cache slots)
    q_seq: int | None = None
    # the packed documents of each batch row, as the lengths of its runs of equal segment ids in natural order
    # (negative: a run of padding), where the ids were concrete when the call was traced
    # (`dispatch.costs.documents_of`); None: not known. It prices a call (how many blocks segments skip) and
    # changes no kernel: problems that differ only in it compare equal.
    documents: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    def resolved(self) -> Problem:
        """This problem with `device_kind` filled in from the first device of `platform`."""
        if self.device_kind:
            return self
        return dataclasses.replace(self, device_kind=current_device_kind(self.platform))

    def as_ring(self) -> Problem:
        """This problem with the all-gather strategy's K/V gather (`opts.gather_kv`) off: the ring over the same
        axis, as a fused ring's kernel runs the gather (its copies reach every peer, its partials go home)."""
        return dataclasses.replace(self, opts=dataclasses.replace(self.opts, gather_kv=False))

    @property
    def gqa_ratio(self) -> int:
        return self.heads // self.kv_heads

    @property
    def itemsize(self) -> int:
        """Bytes of one element of q, k and v."""
        return jax.numpy.dtype(self.dtype).itemsize

    @property
    def head_dims(self) -> tuple[int, int]:
        """(q/k head_dim, v head_dim)."""
        return self.head_dim, self.v_head_dim or self.head_dim  # __post_init__ filled v_head_dim in


def fused_backward_note(how: str, fallback: str | None) -> str:
    """`config_note` for a config that asks for the fused backward: the one kernel and `how` it adds dQ, or
    why (`fallback`, None where it runs) the dQ and dK/dV kernels run instead."""
    if fallback is None:
        return f"backward: one fused kernel ({how})"
    return f"backward: the dQ and dK/dV kernels, not the fused one asked for: {fallback}"


class Implementation(Protocol):
    """What a backend module exposes as `IMPLEMENTATION`. It may also define `config_note(problem, config) -> str`:
    what running `config` on `problem` does that the config does not say (e.g. an asked-for fused backward that
    falls back), for the "ringjax.implementation" report; "" for nothing."""

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


class CacheImplementation(Protocol):
    """What a backend module exposes for the `cache_attention` op (e.g. `CACHE_IMPLEMENTATION`)."""

    name: str
    config_type: type | tuple[type, ...]

    def supports(self, problem: Problem) -> str | None:
        """None if the problem (`seq`: the device's cache slots) can run, else a reason a person can act on."""

    def default_config(self, problem: Problem) -> Any:
        """The heuristic config for this problem."""

    def partials(self, q, k, v, q_pos, k_pos, k_len, opts: AttentionOptions, *, extras=None,
                 config=None) -> tuple[Any, Any]:
        """Queries against one device's cache slots: (out f32 [B, t, H, Dv], lse f32 [B, t, H]).

        q [B, t, H, D]; k [B, S, KVH, D], v [B, S, KVH, Dv]; q_pos [B, t] int32 global query positions;
        k_pos [S] int32 ascending global positions of the slots; k_len [B] int32: a slot is a real key of
        row b iff k_pos < k_len[b], and then `opts`' mask rules apply. Rows that see no key: out 0, lse -inf.
        `extras` (a masks.Extras) carries the ALiBi slopes when opts.has_alibi.
        """


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


def current_platform() -> str:
    return jax.default_backend()


@functools.cache
def current_device_kind(platform: str | None = None) -> str:
    """`device_kind` of the first device of `platform` (default backend if None)."""
    return str(jax.devices(platform)[0].device_kind)


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
    """Base of the backends' frozen-dataclass configs: field checks and a JSON round trip.

    `__post_init__` checks each field declared with its rule (`int_field` and the shorthands
    beside it) and that each field annotated `bool` holds a bool.
    """

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if "valid" in f.metadata:
                self._check_ints((f.name,), f.metadata["valid"], f.metadata["expected"])
            elif f.type in (bool, "bool"):
                self._check_bools((f.name,))

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


def int_field(valid: Callable[[int], bool], expected: str, *, default: int) -> Any:
    """A KernelConfig int field: ValueError naming it unless its value is an int (not a bool) with
    `valid(value)`; `expected` says which ints those are."""
    return dataclasses.field(default=default, metadata={"valid": valid, "expected": expected})


def one_of(choices: tuple[int, ...], *, default: int, expected: str | None = None) -> Any:
    return int_field(lambda v: v in choices, expected or f"one of {choices}", default=default)


def int_in(low: int, high: int, *, default: int) -> Any:
    return int_field(lambda v: low <= v <= high, f"an int in [{low}, {high}]", default=default)


def power_of_two(minimum: int, *, default: int) -> Any:
    return int_field(lambda v: v >= minimum and v & (v - 1) == 0, f"a power of two >= {minimum}", default=default)


def positive(*, default: int) -> Any:
    return int_field(lambda v: v >= 1, "a positive int", default=default)


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

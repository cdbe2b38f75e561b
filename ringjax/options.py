"""The frozen options object every backend reads, the keyword set that fills it, and validation of user input.

User arguments are checked once here, at the public boundary, while the op is
traced and before any device work; backends trust what they receive. `KEYWORDS`
declares the keyword arguments of `ring_attention` once: `make_options`, the
other entry points, the layers' config, `tune_shapes` and `python -m ringjax tune`
take theirs from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")
INVARIANT = "invariant"  # deterministic's strongest level: the same bits on any ring size and layout


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Everything that changes which function is computed, independent of block sizes.

    `window` is (left, right): query i sees key j iff i - left <= j <= i + right,
    in global token positions. `axis_size` is 1 when there is no ring.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    softmax_scale: float = 1.0
    logits_soft_cap: float | None = None
    layout: str = "contiguous"
    axis_name: str | None = None
    axis_size: int = 1
    has_segments: bool = False
    has_sinks: bool = False
    chunk_size: int | None = None
    has_alibi: bool = False
    dropout_rate: float = 0.0
    num_sink_tokens: int = 0
    # K/V of the whole axis gathered once (the all_gather strategy) instead of travelling the ring
    gather_kv: bool = False
    # a device holds `subshards` layout shards of axis_size * subshards: shards i * axis_size + r
    # (i < subshards), concatenated; what a Ulysses all-to-all over a major axis leaves (strategies.py)
    subshards: int = 1
    # True: the backward sums in a fixed order, bitwise-identical gradients run to run (at one ring size); the
    # backends' opt-in fused backwards (bwd_fused, dQ by atomic/TMA adds) then run split. "invariant": also the
    # same bits on any ring size and layout (`core.invariant`)
    deterministic: bool | str = False

    def __post_init__(self):
        self._check_types()
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.window is not None:
            left, right = self.window
            if left < 0 or right < 0:
                raise ValueError(f"sliding_window must be non-negative, got {self.window}")
            if self.causal and right != 0:
                raise ValueError("window right extent must be 0 when causal")
        if not (self.softmax_scale > 0 and math.isfinite(self.softmax_scale)):
            raise ValueError(f"softmax_scale must be a positive finite float, got {self.softmax_scale}")
        if self.logits_soft_cap is not None and not (
            self.logits_soft_cap > 0 and math.isfinite(self.logits_soft_cap)
        ):
            raise ValueError(
                f"logits_soft_cap must be a positive finite float or None, got {self.logits_soft_cap}"
            )
        if self.axis_size < 1:
            raise ValueError(f"axis_size must be >= 1, got {self.axis_size}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be >= 0, got {self.num_sink_tokens}")
        if self.subshards < 1:
            raise ValueError(f"subshards must be >= 1, got {self.subshards}")
        if not isinstance(self.deterministic, bool) and self.deterministic != INVARIANT:
            raise ValueError(f"deterministic must be a bool or {INVARIANT!r}, got {self.deterministic!r}")

    def _check_types(self) -> None:
        """TypeError naming the field, for options built directly rather than by `make_options` (which converts
        the public keywords first): the value checks after compare numbers and unpack the window."""
        def fail(name, expected):
            raise TypeError(f"AttentionOptions.{name} must be {expected}, got {getattr(self, name)!r}")

        def number(x, kind):
            return _is_number(x, integral=kind is int)

        for name in ("causal", "has_segments", "has_sinks", "has_alibi", "gather_kv"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        for name, kind, optional in (("softmax_scale", float, False), ("logits_soft_cap", float, True),
                                     ("dropout_rate", float, False), ("axis_size", int, False),
                                     ("chunk_size", int, True), ("num_sink_tokens", int, False),
                                     ("subshards", int, False)):
            value = getattr(self, name)
            if not (number(value, kind) or optional and value is None):
                fail(name, f"{'None or ' if optional else ''}a{'n int' if kind is int else ' number'}")
        if self.window is not None and not (isinstance(self.window, tuple) and len(self.window) == 2
                                            and all(number(x, int) for x in self.window)):
            fail("window", "None or a (left, right) tuple of ints")

    @property
    def invariant(self) -> bool:
        """`deterministic="invariant"`: granule pairs summed in fixed point (`core.invariant`)."""
        return self.deterministic == INVARIANT

    @property
    def shards_per_device(self) -> int:
        """How many separately placed runs (zigzag chunks, subshards) a device's tokens form; blocks never
        straddle two."""
        return chunks_per_shard(self.layout) * self.subshards


def chunks_per_shard(layout: str) -> int:
    """How many contiguous chunks of the global sequence one layout shard holds (zigzag: 2)."""
    return 2 if layout == "zigzag" else 1


def sequence_chunks(layout: str, axis_size: int) -> int:
    """How many equal chunks `layout` cuts a global sequence into on `axis_size` devices:
    its length must be a multiple of this."""
    return axis_size * chunks_per_shard(layout)


# the largest static length (window side, chunk, sink tokens) a call takes: kernels add them to int32 positions
MAX_STATIC_INT = 2**30


def _is_number(value: Any, integral: bool = False) -> bool:
    """A Python or numpy number (an integer one where `integral`), not a bool."""
    kinds = (int, np.integer) if integral else (int, float, np.integer, np.floating)
    return isinstance(value, kinds) and not isinstance(value, bool)


def _static_number(value: Any, name: str, kind: type) -> Any:
    if not _is_number(value):
        raise TypeError(f"{name} must be a Python {kind.__name__} (static), got {type(value).__name__}")
    if kind is int and not float(value).is_integer():
        raise TypeError(f"{name} must be an integer, got {value}")
    if kind is int and abs(int(value)) > MAX_STATIC_INT:
        raise ValueError(f"{name} must be at most 2**30 (kernels add it to int32 positions), got {value}")
    return kind(value)


def normalize_window(sliding_window, causal: bool) -> tuple[int, int] | None:
    """`int w` means (w, w); with causal the right extent is 0."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (tuple, list)):
        if len(sliding_window) != 2:
            raise ValueError(f"sliding_window must be an int or (left, right), got {sliding_window!r}")
        left = _static_number(sliding_window[0], "sliding_window[0]", int)
        right = _static_number(sliding_window[1], "sliding_window[1]", int)
    else:
        left = right = _static_number(sliding_window, "sliding_window", int)
    if causal:
        right = 0
    return (left, right)  # AttentionOptions checks the values


def _is_float(dtype) -> bool:
    try:
        return dtype is not None and jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # not a dtype at all ("foo")
        return False


def check_float_dtype(name: str, dtype, optional: bool = False):
    """`dtype`, or TypeError naming the argument unless it is a floating-point dtype (or None where `optional`)."""
    if not (_is_float(dtype) or optional and dtype is None):
        raise TypeError(f"{name} must be a floating-point dtype{' or None' if optional else ''}, got {dtype!r}")
    return dtype


def check_inputs(q, k, v, segment_ids, sinks, *, axis_size: int, layout: str, local: bool,
                 alibi_slopes=None, dropout_rate=0.0, dropout_rng=None) -> None:
    """Raise ValueError/TypeError naming the argument for every misuse.

    `local` means q, k, v are per-device shards (inside shard_map); otherwise they
    are global arrays that will be split `axis_size` ways along the sequence.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim], got {x.shape}")
        if not _is_float(x.dtype):
            raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seq, heads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k batch {k.shape[0]} must equal q batch {batch}")
    if k.shape[1] != seq:
        raise ValueError(
            f"k sequence length {k.shape[1]} must equal q's {seq} (ring attention is self-attention "
            "over one sharded sequence)"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim {k.shape[3]} must equal q head_dim {head_dim} (QK^T contracts over it)")
    kv_heads = k.shape[2]
    if v.shape[:3] != k.shape[:3]:
        # v may have its own head_dim (multi-head latent attention), nothing else of its own
        raise ValueError(f"v must have shape [batch, seq, kv_heads, v_head_dim] = [{batch}, {k.shape[1]}, {kv_heads}, "
                         f"v_head_dim] (k's batch, sequence and kv_heads; any v_head_dim), got {v.shape}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim < 1 or v.shape[3] < 1:
        raise ValueError(f"head_dim must be positive, got q/k {head_dim} and v {v.shape[3]}")
    chunks = sequence_chunks(layout, axis_size)
    if local:
        if seq % chunks_per_shard(layout):
            raise ValueError(f"zigzag layout needs an even local sequence length, got {seq}")
    elif seq % chunks:
        what = "2 x the axis size" if layout == "zigzag" else "the axis size"
        raise ValueError(f"sequence length {seq} must be divisible by {what} ({chunks})")
    if seq == 0:
        raise ValueError("sequence length must be positive")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape"):
            raise TypeError(f"segment_ids must be an int32 array, got {type(segment_ids).__name__}")
        if segment_ids.shape != (batch, seq):
            raise ValueError(f"segment_ids must have shape [batch, seq] = {(batch, seq)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"segment_ids must be an integer array (int32), got {segment_ids.dtype}")
        if isinstance(segment_ids, np.ndarray) and np.dtype(segment_ids.dtype).itemsize > 4 and segment_ids.size:
            # wider host ids are cast to int32, where ids that differ by 2**32 would become one document
            low, high = int(segment_ids.min()), int(segment_ids.max())
            if low < -2**31 or high >= 2**31:
                raise ValueError(f"segment_ids must fit int32, got values in [{low}, {high}]")
    if sinks is not None:
        if not hasattr(sinks, "shape"):
            raise TypeError(f"sinks must be a float array of shape [heads], got {type(sinks).__name__}")
        if sinks.shape != (heads,):
            raise ValueError(f"sinks must have shape [heads] = ({heads},), got {sinks.shape}")
        if not _is_float(sinks.dtype):
            raise TypeError(f"sinks must be a floating-point array, got {sinks.dtype}")
    if alibi_slopes is not None:
        if not hasattr(alibi_slopes, "shape"):
            raise TypeError(f"alibi_slopes must be a float array of shape [heads], got {type(alibi_slopes).__name__}")
        if alibi_slopes.shape != (heads,):
            raise ValueError(f"alibi_slopes must have shape [heads] = ({heads},), got {alibi_slopes.shape}")
        if not _is_float(alibi_slopes.dtype):
            raise TypeError(f"alibi_slopes must be a floating-point array, got {alibi_slopes.dtype}")
    if dropout_rate and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng (a jax.random key)")
    if dropout_rng is not None and not dropout_rate:
        raise ValueError("dropout_rng was given but dropout_rate is 0: pass dropout_rate > 0 or drop dropout_rng")
    if dropout_rng is not None:
        check_key(dropout_rng, "dropout_rng")


def described(x) -> str:
    """How an error names what it got: "int32 array" for arrays, else the type."""
    dtype = getattr(x, "dtype", None)
    return f"{dtype} array" if dtype is not None and hasattr(x, "shape") else type(x).__name__


def check_key(key, name: str) -> None:
    """TypeError naming `name` unless `key` is one jax.random key: a typed key (jax.random.key) or the raw
    uint32 data of jax.random.PRNGKey ([2] with the default threefry, [4] with rbg)."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    shape = getattr(key, "shape", None)
    if not (typed and shape == () or not typed and dtype == jnp.uint32 and shape in ((2,), (4,))):
        what = f"{dtype}{list(shape)}" if dtype is not None and shape is not None else type(key).__name__
        raise TypeError(f"{name} must be one jax.random key (jax.random.key(seed), or jax.random.PRNGKey(seed)), "
                        f"got {what}")


# ---------------------------------------------------------------------------- the keyword set, declared once

FEATURE = "feature"  # a static value: sets an AttentionOptions field
ARRAY = "array"  # a per-call array: its AttentionOptions field (if any) records whether it was given
CALL = "call"  # how the call runs (axes, backend, outputs): not part of AttentionOptions


@dataclasses.dataclass(frozen=True)
class Keyword:
    """One keyword argument of `ring_attention`, shared by the other entry points, layers and tuner."""

    name: str
    default: Any
    type: Any  # FEATURE: the Python type of its value (None allowed where the default is None)
    help: str
    role: str = FEATURE
    field: str | None = None  # the AttentionOptions field it sets; FEATURE: default `name`
    flag: str | None = None  # ARRAY: the bool that stands for it where there are no arrays (tune_shapes, CLI)
    choices: tuple[str, ...] | None = None
    pair: bool = False  # also takes a (left, right) pair of `type`
    also: tuple[str, ...] = ()  # strings it takes besides values of `type`

    @property
    def option_name(self) -> str | None:
        """How `make_options` takes it: a feature by its name, an array by the field recording its presence."""
        return self.name if self.role == FEATURE else self.field

    def convert(self, value):
        """`value` as this keyword's type for AttentionOptions: TypeError naming it, else unchecked values."""
        if value is None and self.default is None:
            return None
        if self.pair:
            return value  # normalize_window converts it, knowing causal
        if self.type in (int, float):
            return _static_number(value, self.name, self.type)
        if isinstance(value, str) and value in self.also:
            return value
        if self.type is bool and isinstance(value, np.bool_):  # a numpy comparison's result, as from a config
            return bool(value)
        if not isinstance(value, self.type):
            among = f", one of {self.choices}" if self.choices else ""
            among += "".join(f" or {a!r}" for a in self.also)
            raise TypeError(f"{self.name} must be a {self.type.__name__}{among}, got {type(value).__name__}")
        return value


# In the order of ring_attention's signature; tests/test_options.py checks it, dilated_attention's and the layers'.
KEYWORDS: tuple[Keyword, ...] = (
    Keyword("axis_name", "sp", str, "mesh axis the sequence is sharded over; None: one device, no ring", CALL),
    Keyword("causal", False, bool, "query i sees key j only if j <= i"),
    Keyword("sliding_window", None, int, "W or LEFT RIGHT: i sees j iff i-LEFT <= j <= i+RIGHT (RIGHT is 0 if causal)",
            field="window", pair=True),
    Keyword("segment_ids", None, jax.Array, "packed documents: attend within equal ids; negative ids are padding",
            ARRAY, field="has_segments", flag="segments"),
    Keyword("softmax_scale", None, float, "logit scale (default 1/sqrt(head_dim))"),
    Keyword("logits_soft_cap", None, float, "logits become cap * tanh(logits / cap)"),
    Keyword("sinks", None, jax.Array, "learnable per-head logits that join every softmax denominator",
            ARRAY, field="has_sinks", flag="sinks"),
    Keyword("layout", "contiguous", str, "which global positions each shard holds", choices=LAYOUTS),
    Keyword("chunk_size", None, int, "chunked attention: i sees j only within the same chunk of this many tokens"),
    Keyword("alibi_slopes", None, jax.Array, "ALiBi: logits get -slope[h] * |i - j|",
            ARRAY, field="has_alibi", flag="alibi"),
    Keyword("dropout_rate", 0.0, float, "dropout on the attention probabilities (with dropout_rng)"),
    Keyword("dropout_rng", None, jax.Array, "the jax.random key of the dropout mask (follows dropout_rate)", ARRAY),
    Keyword("num_sink_tokens", 0, int, "every query also sees the first this many tokens of its segment"),
    Keyword("deterministic", False, bool,
            "bitwise-identical gradients run to run at one ring size (opt-in fused backwards run split); "
            "'invariant': the same bits on any ring size and layout", also=(INVARIANT,)),
    Keyword("return_lse", False, bool, "also return lse [batch, heads, seq] float32", CALL),
    Keyword("mesh", None, object, "the mesh of global arrays (default: the one set by jax.set_mesh)", CALL),
    Keyword("implementation", "auto", str, "'auto' or a registered implementation", CALL),
    Keyword("config", None, object, "that implementation's config, fixed", CALL),
    Keyword("autotune", None, str, "'off' | 'cached' | 'on' (default $RINGJAX_AUTOTUNE or 'cached')", CALL),
    Keyword("strategy", "ring", str, "ring | all_gather | ulysses | hybrid | auto", CALL),
)
KEYWORDS_BY_NAME = {kw.name: kw for kw in KEYWORDS}
# what make_options takes; the arrays by the field recording their presence (has_segments, ...)
OPTION_INPUTS = {name: kw for kw in KEYWORDS if (name := kw.option_name) is not None}
# what describes a problem without its arrays (tune_shapes, `python -m ringjax tune`): the static
# features, and a bool per array that changes the kernel (dropout's key follows dropout_rate)
TUNABLE = {kw.flag or kw.name: kw for kw in OPTION_INPUTS.values()}


def option_inputs(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """make_options' keywords from an entry point's arguments by name: features as given, arrays as their presence.

    Names that are not features or arrays of KEYWORDS (calling keywords, an entry point's own) are skipped.
    """
    return {name: arguments[kw.name] if kw.role == FEATURE else arguments[kw.name] is not None
            for name, kw in OPTION_INPUTS.items() if kw.name in arguments}


def make_options(q, *, axis_name, axis_size, **keywords) -> AttentionOptions:
    """AttentionOptions from the feature keywords of KEYWORDS by name (absent ones take their default) and, for
    the arrays, whether they are given (has_segments=..., see `option_inputs`). `q` (the query, or its head_dim)
    gives the default softmax_scale. Types are converted here, values checked by AttentionOptions."""
    unknown = sorted(set(keywords) - set(OPTION_INPUTS))
    if unknown:
        raise TypeError(f"make_options got unknown keyword(s) {unknown}; it takes {sorted(OPTION_INPUTS)}")
    values = {}
    for name, kw in OPTION_INPUTS.items():
        if kw.role == FEATURE:
            values[kw.field or name] = kw.convert(keywords.get(name, kw.default))
        elif isinstance(present := keywords.get(name, False), bool):  # an array: whether it is given
            values[name] = present
        else:
            raise TypeError(f"{name} must be a bool, got {type(present).__name__}")
    if values["softmax_scale"] is None:
        values["softmax_scale"] = 1.0 / math.sqrt(q.shape[-1] if hasattr(q, "shape") else q)
    values["window"] = normalize_window(values["window"], values["causal"])
    return AttentionOptions(axis_name=axis_name, axis_size=axis_size, **values)


# ---------------------------------------------------------------------------- keywords of other APIs

# Names other attention APIs use, by source, and what to pass to ringjax instead (check_keywords says so).
_DENSE = "a dense [seq, seq] array is not supported (it would not stay sharded with the sequence); "
_LENGTHS = "use segment_ids: give padding tokens a negative id (they see nothing and nothing sees them)"
FOREIGN_KEYWORDS: dict[str, tuple[str, str]] = {
    "is_causal": ("jax.nn.dot_product_attention", "use causal=True"),
    "scale": ("jax.nn.dot_product_attention", "use softmax_scale= (default 1/sqrt(head_dim), as in jax.nn)"),
    "local_window_size": ("jax.nn.dot_product_attention",
                          "use sliding_window=(left, right) (an int w is (w, w); with causal=True right is 0)"),
    "bias": ("jax.nn.dot_product_attention",
             _DENSE + "biases computed blockwise are alibi_slopes (ALiBi), segment_ids (packed documents), "
             "sliding_window, chunk_size (chunked attention) and logits_soft_cap"),
    "mask": ("jax.nn.dot_product_attention",
             _DENSE + "use segment_ids (attend within equal ids; negative ids are padding), causal or sliding_window"),
    "query_seq_lengths": ("jax.nn.dot_product_attention", _LENGTHS),
    "key_value_seq_lengths": ("jax.nn.dot_product_attention", _LENGTHS),
    "return_residual": ("jax.nn.dot_product_attention", "use return_lse=True (lse [batch, heads, seq] float32)"),
    "dropout_p": ("flash-attn", "use dropout_rate with dropout_rng (a jax.random key)"),
    "softcap": ("flash-attn", "use logits_soft_cap"),
    "window_size": ("flash-attn", "use sliding_window=(left, right); flash-attn's (-1, -1) is sliding_window=None"),
    "return_attn_probs": ("flash-attn", "use return_lse=True (probabilities are never materialised)"),
}


def check_keywords(fn: str, given: Iterable[str], accepted: Collection[str],
                   hints: Mapping[str, str] | None = None) -> None:
    """TypeError for the keywords in `given` that `fn` does not accept, saying what to pass instead.

    A keyword of KEYWORDS that `fn` lacks is unsupported there; one of FOREIGN_KEYWORDS (or `hints`) gets its
    advice; anything else its closest accepted spelling. Checked before any array is looked at.
    """
    unknown = [name for name in given if name not in accepted]
    if not unknown:
        return
    unsupported = sorted(name for name in unknown if name in KEYWORDS_BY_NAME and name not in (hints or {}))
    reasons = [f"{fn} does not support {unsupported}"] if unsupported else []
    for name in unknown:
        if name in unsupported:
            continue
        if hints and name in hints:
            advice = hints[name]
        elif name in FOREIGN_KEYWORDS:
            source, advice = FOREIGN_KEYWORDS[name]
            advice = f"that is {source}'s keyword; {advice}"
        else:
            close = difflib.get_close_matches(name, list(accepted), n=1)
            advice = f"did you mean {close[0]!r}?" if close else f"it takes {sorted(accepted)}"
        reasons.append(f"{fn}() got an unexpected keyword argument {name!r}: {advice}")
    raise TypeError("; ".join(reasons))


P = ParamSpec("P")
R = TypeVar("R")


def checked_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: a keyword `fn`'s signature lacks raises `check_keywords`' TypeError, not Python's bare one.

    The signature stays `fn`'s own, for users, IDEs and type checkers.
    """
    return _checked(fn, inspect.signature(fn))


def keywords_of(source: Callable, *, omit: Collection[str]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorator: `fn(..., **options)` takes the keyword-only arguments of `source` but `omit`, as `source`
    declares them; `options` holds each of them, absent ones at their default.

    A keyword `fn` declares itself keeps its own declaration. `fn`'s signature (for users and `help`) lists
    them all; a keyword it lacks raises `check_keywords`' TypeError.
    """
    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        own = inspect.signature(fn)
        taken = [p for name, p in inspect.signature(source).parameters.items()
                 if p.kind == p.KEYWORD_ONLY and name not in omit and name not in own.parameters]
        return _checked(fn, own.replace(parameters=[p for p in own.parameters.values() if p.kind != p.VAR_KEYWORD]
                                        + taken))

    return decorate


def _checked(fn: Callable[..., R], signature: inspect.Signature) -> Callable[..., R]:
    """`fn` called as `signature` says: keywords checked against it, absent ones at its defaults."""
    accepted = frozenset(name for name, p in signature.parameters.items()
                         if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        check_keywords(fn.__name__, kwargs, accepted)
        bound = signature.bind(*args, **kwargs)  # TypeError for a missing argument, as the signature shows it
        bound.apply_defaults()
        return fn(*bound.args, **bound.kwargs)

    checked.__signature__ = signature  # type: ignore[attr-defined]
    return checked

"""The feature table: what each implementation computes, declared once as data.

Every backend registers a `Support` beside its name. Refusals of unsupported features,
dtypes and head_dims, the `python -m ringjax implementations` table and the README's
coverage table are all generated from it, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ringjax.core import precision
from ringjax.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class Feature:
    """One thing a call can ask for: its argument, what it means, and the options it sets."""

    name: str
    label: str  # in words, for refusals
    argument: str  # as the README's table shows it
    meaning: str
    used: Callable[[AttentionOptions], bool]
    # the AttentionOptions fields this feature sets: an implementation that does not declare the
    # feature refuses any of them set away from its default
    fields: tuple[str, ...] = ()


FEATURES: tuple[Feature, ...] = (
    Feature("causal", "causal masking", "`causal`", "query i sees key j only if j <= i",
            lambda o: o.causal, ("causal",)),
    Feature("sliding_window", "sliding windows", "`sliding_window`",
            "`w` or `(left, right)`: i sees j iff i-left <= j <= i+right (right is 0 with causal)",
            lambda o: o.window is not None, ("window",)),
    Feature("segment_ids", "packed sequences", "`segment_ids`",
            "`[batch, seq]` int32, sharded like q: attend only within equal ids (packed sequences); negative ids "
            "are padding and see nothing",
            lambda o: o.has_segments, ("has_segments",)),
    Feature("logits_soft_cap", "the logit soft cap", "`logits_soft_cap`", "`s -> cap * tanh(s / cap)` after scaling",
            lambda o: o.logits_soft_cap is not None, ("logits_soft_cap",)),
    Feature("sinks", "learnable sinks", "`sinks`",
            "`[heads]` learnable logits: `exp(sinks[h])` joins every softmax denominator of head h (gpt-oss); "
            "differentiable",
            lambda o: o.has_sinks, ("has_sinks",)),
    Feature("chunk_size", "chunked attention", "`chunk_size`",
            "chunked attention (Llama 4): i sees j only if both lie in the same chunk of c tokens; with `causal`, "
            "chunked causal; chunks start at position 0",
            lambda o: o.chunk_size is not None and not o.has_segments, ("chunk_size",)),
    Feature("chunk_size_segments", "per-document chunks", "`chunk_size` with `segment_ids`",
            "chunks start at the first token of every packed document",
            lambda o: o.chunk_size is not None and o.has_segments, ("chunk_size",)),
    Feature("alibi_slopes", "ALiBi", "`alibi_slopes`",
            "`[heads]`: logits get `-slope[h] * abs(i - j)` (after the soft cap); differentiable",
            lambda o: o.has_alibi, ("has_alibi",)),
    Feature("dropout", "dropout", "`dropout_rate`, `dropout_rng`",
            "dropout on probabilities; the mask is a counter-based hash of (key, batch, head, i, j), identical for "
            "any ring size and layout, regenerated in backward",
            lambda o: o.dropout_rate > 0, ("dropout_rate",)),
    Feature("num_sink_tokens", "sink tokens", "`num_sink_tokens`",
            "StreamingLLM: every query also sees the first s tokens of the sequence (with windows: sinks reach far "
            "shards by one small all-reduce, not the whole ring)",
            lambda o: o.num_sink_tokens > 0 and not o.has_segments, ("num_sink_tokens",)),
    Feature("num_sink_tokens_segments", "sink tokens of packed documents", "`num_sink_tokens` with `segment_ids`",
            "every query sees the first s tokens of its own document",
            lambda o: o.num_sink_tokens > 0 and o.has_segments, ("num_sink_tokens",)),
    Feature("invariant", "results the same on any ring size", '`deterministic="invariant"`',
            "out, lse and every gradient bitwise the same on any ring size, contiguous or zigzag, ring or all-gather: "
            "kernels run on fixed granules of the sequence (which their tiles must fit) and partials add in fixed "
            "point",
            lambda o: o.invariant),
    Feature("all_gather", "the all-gather K/V schedule", '`strategy="all_gather"`',
            "K/V of the whole axis gathered once instead of travelling the ring (keys in natural order)",
            lambda o: o.gather_kv, ("gather_kv",)),
    Feature("ulysses", "the Ulysses/hybrid subshards", '`strategy="ulysses"` / `"hybrid"`',
            "an all-to-all to whole sequences of a slice of the heads; hybrid over contiguous or zigzag leaves a "
            "device interleaved subshards (ulysses sorts them into one plain sequence)",
            lambda o: o.subshards > 1, ("subshards",)),
)
BY_NAME = {f.name: f for f in FEATURES}
# options every implementation honours, whatever it supports: scale, layout, ring geometry, and deterministic
# (every backward sums in a fixed order but the opt-in fused ones, which then run split)
COMMON_FIELDS = frozenset({"softmax_scale", "layout", "axis_name", "axis_size", "deterministic"})


@dataclasses.dataclass(frozen=True)
class Support:
    """What one implementation computes: features by name, dtypes, head_dims.

    `head_dims` is a predicate with `head_dims_text` saying it in words; None means any. It holds
    for q/k's head_dim and for v's, which may differ (multi-head latent attention) unless
    `v_head_dim_refusal` says why not. Limits that depend on the machine (shared memory, GPU
    generation) stay in the implementation's own `supports()`.
    """

    features: frozenset[str]
    dtypes: tuple[str, ...]
    head_dims: Callable[[int], bool] | None = None
    head_dims_text: str = "any"
    min_seq_multiple: int = 1  # each contiguous run of a device's tokens is a multiple of this
    # jax's matmul precisions (core.precision names) float32 inputs may run at, None: every one; and in
    # words, what float32 tiles are multiplied in (the README's table)
    float32_precisions: frozenset[str] | None = None
    float32_text: str = "as jax's matmul precision says"
    # why v's head_dim may not differ from q/k's here; None: it may
    v_head_dim_refusal: str | None = None

    def __post_init__(self):
        unknown = sorted(set(self.features) - set(BY_NAME))
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; features are {sorted(BY_NAME)}")

    def known_fields(self) -> frozenset[str]:
        fields = set(COMMON_FIELDS)
        for name in self.features:
            fields.update(BY_NAME[name].fields)
        return frozenset(fields)

    def refusal(self, name: str, problem) -> str | None:
        """Why implementation `name` cannot run `problem` (a core.problem.Problem) by this table, or None."""
        opts = problem.opts
        missing = [f"{f.label} ({f.argument})" for f in FEATURES if f.name not in self.features and f.used(opts)]
        # an option no feature of this implementation covers (one added later) is refused too
        missing += [field for field in _set_fields(opts) if field not in self.known_fields()
                    and not any(field in f.fields for f in FEATURES if f.used(opts))]
        if missing:
            return f"{', '.join(dict.fromkeys(missing))} is not implemented in {name}"
        if problem.dtype not in self.dtypes:
            return f"dtype {problem.dtype} is not supported: needs one of {', '.join(self.dtypes)}"
        allowed = self.float32_precisions
        if problem.dtype == "float32" and allowed is not None and problem.precision not in allowed:
            return (f"float32 at jax's matmul precision {problem.precision!r} ({precision.describe(problem.precision)}"
                    f") is not implemented in {name}, which multiplies float32 in {self.float32_text}; "
                    "implementation='auto' picks one that computes it")
        d, dv = problem.head_dims
        if dv != d and self.v_head_dim_refusal is not None:
            return (f"v head_dim {dv} other than q/k's head_dim {d} is not implemented in {name}: "
                    f"{self.v_head_dim_refusal}")
        for what, dim in (("head_dim", d), ("v head_dim", dv)):
            if self.head_dims is not None and not self.head_dims(dim):
                return f"{what} {dim} is not supported: needs {self.head_dims_text}"
        unit = problem.seq // opts.shards_per_device
        if unit % self.min_seq_multiple:
            what = ("half the per-device sequence (zigzag)" if opts.shards_per_device == 2
                    else "the per-device sequence")
            if opts.subshards > 1:
                what = f"each of the {opts.shards_per_device} runs of a device's tokens"
            return f"{what} is {unit}: must be a multiple of {self.min_seq_multiple}"
        return None


def _set_fields(opts: AttentionOptions) -> list[str]:
    """Options fields set away from their defaults."""
    out = []
    for field in dataclasses.fields(opts):
        default = field.default if field.default is not dataclasses.MISSING else None
        if getattr(opts, field.name) != default:
            out.append(field.name)
    return out


_DTYPE_NAMES = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def markdown_table(columns: list[tuple[str, Support]]) -> str:
    """The README's coverage table: one row per feature (yes / refused), then dtypes, float32 precision,
    head_dims and whether v's head_dim may differ."""
    header = "| argument | meaning | " + " | ".join(f"`{name}`" for name, _ in columns) + " |"
    lines = [header, "|" + "---|" * (2 + len(columns))]
    for f in FEATURES:
        cells = ["yes" if f.name in s.features else "refused" for _, s in columns]
        lines.append(f"| {f.argument} | {f.meaning} | " + " | ".join(cells) + " |")
    dtypes = [", ".join(_DTYPE_NAMES.get(d, d) for d in s.dtypes) for _, s in columns]
    lines.append("| dtype | of q, k, v | " + " | ".join(dtypes) + " |")
    float32 = [s.float32_text if "float32" in s.dtypes else "—" for _, s in columns]
    lines.append("| float32 matmuls | what float32 q, k, v are multiplied in (`jax.default_matmul_precision`) | "
                 + " | ".join(float32) + " |")
    lines.append("| head_dim | of q and k, and of v | " + " | ".join(s.head_dims_text for _, s in columns) + " |")
    v_dims = ["yes" if s.v_head_dim_refusal is None else "refused" for _, s in columns]
    lines.append("| v head_dim differs | v with a head_dim of its own (multi-head latent attention: q/k 192, v 128); "
                 "out takes v's | " + " | ".join(v_dims) + " |")
    return "\n".join(lines)

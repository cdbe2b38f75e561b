"""The keyword set declared once in ringjax.options.KEYWORDS, and everything that takes its keywords from it."""

import dataclasses
import inspect
import math

import pytest

import ringjax
from ringjax.dispatch import autotuning
from ringjax.layers.core import AttentionLayerConfig
from ringjax.options import (
    ARRAY,
    FEATURE,
    KEYWORDS,
    KEYWORDS_BY_NAME,
    TUNABLE,
    AttentionOptions,
    make_options,
)


def _keyword_defaults(fn) -> list[tuple[str, object]]:
    return [(name, p.default) for name, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY]


def test_ring_attention_signature_is_the_declaration():
    assert _keyword_defaults(ringjax.ring_attention) == [(kw.name, kw.default) for kw in KEYWORDS]


def test_dilated_attention_keywords_are_declared_ones():
    own = {"segment_lengths", "dilation_rates"}
    shared = {name: default for name, default in _keyword_defaults(ringjax.dilated_attention) if name not in own}
    assert shared == {name: KEYWORDS_BY_NAME[name].default for name in shared}
    lacking = sorted(set(KEYWORDS_BY_NAME) - set(shared))
    assert lacking == sorted({"chunk_size", "alibi_slopes", "dropout_rate", "dropout_rng", "num_sink_tokens",
                              "strategy"})  # as its docstring says
    for name in lacking:
        with pytest.raises(TypeError, match=f"dilated_attention does not support \\['{name}'\\]"):
            ringjax.dilated_attention("q", "k", "v", segment_lengths=8, dilation_rates=1,
                                      **{name: KEYWORDS_BY_NAME[name].default})


def test_layer_config_fields_are_declared_keywords():
    fields = {f.name: f.default for f in dataclasses.fields(AttentionLayerConfig) if f.name in KEYWORDS_BY_NAME}
    assert set(fields) >= {"causal", "sliding_window", "logits_soft_cap", "softmax_scale", "layout", "axis_name"}
    assert fields == {name: KEYWORDS_BY_NAME[name].default for name in fields}


@pytest.mark.parametrize("error, match, field", [
    (TypeError, "causal must be a bool", dict(causal=1)),
    (TypeError, "softmax_scale must be a Python float", dict(softmax_scale="0.5")),
    (ValueError, "logits_soft_cap must be a positive", dict(logits_soft_cap=-1.0)),
    (TypeError, "layout must be a str", dict(layout=3)),
    (ValueError, "layout must be one of", dict(layout="spiral")),
    (ValueError, "sliding_window must be non-negative", dict(sliding_window=(-1, 0))),
])
def test_layer_config_is_checked_by_the_declaration(error, match, field):
    with pytest.raises(error, match=match):
        AttentionLayerConfig(in_features=16, num_heads=4, **field)


def test_make_options_defaults_come_from_the_declaration():
    assert make_options(16, axis_name=None, axis_size=1) == AttentionOptions(softmax_scale=0.25)
    opts = make_options(16, axis_name="sp", axis_size=2, causal=True, sliding_window=(8, 3), has_alibi=True,
                        chunk_size=4, softmax_scale=2)
    assert (opts.window, opts.has_alibi, opts.chunk_size, opts.softmax_scale) == ((8, 0), True, 4, 2.0)
    with pytest.raises(TypeError, match="unknown keyword.*'segment_ids'"):
        make_options(16, axis_name=None, axis_size=1, segment_ids=None)
    with pytest.raises(TypeError, match="has_sinks must be a bool"):
        make_options(16, axis_name=None, axis_size=1, has_sinks=None)


@pytest.mark.parametrize("field, value, match", [
    ("window", (1,), "window must be None or a .left, right. tuple of ints"),
    ("window", [1, 2], "window must be None or a"),
    ("logits_soft_cap", "x", "logits_soft_cap must be None or a number"),
    ("softmax_scale", None, "softmax_scale must be a number"),
    ("causal", "yes", "causal must be a bool"),
    ("has_alibi", 1, "has_alibi must be a bool"),
    ("chunk_size", 2.0, "chunk_size must be None or an int"),
    ("num_sink_tokens", True, "num_sink_tokens must be an int"),
])
def test_attention_options_built_directly_name_the_field(field, value, match):
    with pytest.raises(TypeError, match=f"AttentionOptions.{match}"):
        AttentionOptions(**{field: value})


def test_numpy_bools_are_bools():
    import numpy as np

    assert make_options(16, axis_name=None, axis_size=1, causal=np.bool_(True)).causal is True


class _Tuned(Exception):
    pass


def _capture(monkeypatch, target, name):
    """Replace `target.name` by a function that raises _Tuned carrying what it was called with."""
    def capture(*args, **kwargs):
        raise _Tuned(args, kwargs)

    monkeypatch.setattr(target, name, capture)


# a value away from the default for everything tune_shapes can tune
NON_DEFAULT = dict(causal=True, sliding_window=(8, 0), segments=True, softmax_scale=0.5, logits_soft_cap=30.0,
                   sinks=True, layout="zigzag", chunk_size=16, alibi=True, dropout_rate=0.1, num_sink_tokens=2,
                   deterministic=True)


def test_tune_shapes_takes_every_feature(monkeypatch):
    assert set(NON_DEFAULT) == set(TUNABLE)
    _capture(monkeypatch, autotuning, "tune_problem")
    with pytest.raises(_Tuned) as tuned:
        autotuning.tune_shapes(batch=1, seq=64, heads=2, head_dim=8, dtype="float32", axis_size=2,
                               implementation="xla", **NON_DEFAULT)
    opts = tuned.value.args[0][3].opts
    for name, kw in TUNABLE.items():
        got = getattr(opts, kw.field or kw.name)
        assert got == NON_DEFAULT[name], (name, got)
    assert (opts.axis_name, opts.axis_size) == ("sp", 2)


@pytest.mark.parametrize("features, match", [
    (dict(bogus=1), "tune_shapes\\(\\) got an unexpected keyword argument 'bogus'"),
    (dict(segment_ids=True), "pass segments=True"),
    (dict(alibi_slopes=True), "pass alibi=True"),
    (dict(is_causal=True), "use causal=True"),
    (dict(strategy="ring"), "tune_shapes does not support \\['strategy'\\]"),
])
def test_tune_shapes_names_unknown_keywords(monkeypatch, features, match):
    _capture(monkeypatch, autotuning, "tune_problem")
    with pytest.raises(TypeError, match=match):
        autotuning.tune_shapes(batch=1, seq=64, heads=2, head_dim=8, **features)


def test_tune_shapes_measures_every_feature(tmp_path, monkeypatch):
    """Chunks, ALiBi, dropout and sink tokens (with everything else) are tuned on real stand-ins."""
    monkeypatch.setenv("RINGJAX_CACHE_DIR", str(tmp_path))
    autotuning.clear_memory_cache()
    quick = autotuning.TuneSettings(warmup=0, repeats=1, progress=False)
    try:
        result = autotuning.tune_shapes(batch=1, seq=64, heads=2, kv_heads=1, head_dim=8, dtype="float32",
                                        implementation="xla", settings=quick, **NON_DEFAULT)
    finally:
        autotuning.clear_memory_cache()
    assert result.config is not None and all(err is None for _, _, err in result.timings), result.timings
    assert result.problem.opts.dropout_rate == 0.1 and result.problem.opts.num_sink_tokens == 2


def _cli_tune(monkeypatch, *flags):
    from ringjax.__main__ import main

    _capture(monkeypatch, autotuning, "tune_shapes")
    with pytest.raises(_Tuned) as tuned:
        main(["tune", "--batch", "1", "--seq", "64", "--heads", "2", "--head-dim", "8", *flags])
    return {name: value for name, value in tuned.value.args[1].items() if name in TUNABLE}


def test_cli_tune_has_a_flag_per_feature(monkeypatch):
    flags = []
    for name, value in NON_DEFAULT.items():
        flag = "--" + name.replace("_", "-")
        kw = TUNABLE[name]
        if kw.role == ARRAY or kw.type is bool:
            flags.append(flag)
        else:
            flags += [flag, *map(str, value if isinstance(value, tuple) else (value,))]
    assert _cli_tune(monkeypatch, *flags) == NON_DEFAULT
    defaults = {name: False if kw.role == ARRAY else kw.default for name, kw in TUNABLE.items()}
    assert _cli_tune(monkeypatch) == defaults


def test_cli_tune_old_flags_and_window_forms(monkeypatch):
    got = _cli_tune(monkeypatch, "--window", "16", "--softcap", "5")
    assert (got["sliding_window"], got["logits_soft_cap"]) == (16, 5.0)
    with pytest.raises(SystemExit):
        _cli_tune(monkeypatch, "--sliding-window", "1", "2", "3")


@pytest.mark.parametrize("flag, values, keyword", [
    ("--softmax-scale", ["0"], {"softmax_scale": 0.0}),
    ("--logits-soft-cap", ["0"], {"logits_soft_cap": 0.0}),
    ("--softcap", ["nan"], {"logits_soft_cap": math.nan}),
    ("--chunk-size", ["0"], {"chunk_size": 0}),
    ("--sliding-window", ["4", "-1"], {"sliding_window": (4, -1)}),
    ("--num-sink-tokens", ["-1"], {"num_sink_tokens": -1}),
])
def test_cli_feature_flags_are_refused_as_the_library_refuses_them(capsys, flag, values, keyword):
    """`tune` and `explain` refuse a feature value the library refuses, at the parse (exit code 2), naming the
    flag, in the library's words; 0 is a value, not an absent flag."""
    from ringjax.__main__ import main

    with pytest.raises(ValueError) as library:
        make_options(64, axis_name=None, axis_size=1, **keyword)
    for command in (["tune", "--batch", "1", "--seq", "64", "--heads", "2", "--head-dim", "8"],
                    ["explain", "--shape", "1,1024,8,64", "--device-kind", "NVIDIA H100 80GB HBM3"]):
        with pytest.raises(SystemExit) as exit:
            main(command + [flag, *values])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and f"{command[0]}: error: argument " in err and flag in err, err
        assert str(library.value) in err, err


def test_feature_keywords_fill_attention_options():
    """Every static feature and every array that changes the kernel sets one AttentionOptions field."""
    fields = {f.name for f in dataclasses.fields(AttentionOptions)}
    for kw in KEYWORDS:
        if kw.role == FEATURE:
            assert (kw.field or kw.name) in fields, kw.name
        elif kw.role == ARRAY and kw.field is not None:
            assert kw.field in fields and kw.flag, kw.name
    assert math.isclose(make_options(64, axis_name=None, axis_size=1).softmax_scale, 0.125)

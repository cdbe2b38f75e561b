"""The examples run end to end at tiny sizes on the simulated CPU devices."""

from __future__ import annotations

import csv
import importlib.util
import math
import pathlib
import sys

import pytest

from harness import need_devices

pytest.importorskip("equinox", reason="examples/train_lm.py needs equinox (pip install ringjax[equinox])")
pytest.importorskip("optax", reason="examples/train_lm.py needs optax (pip install ringjax[test])")
pytest.importorskip("matplotlib", reason="examples/long_context.py needs matplotlib (pip install ringjax[test])")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    if str(EXAMPLES) not in sys.path:  # as when a script in examples/ runs: its shared _model module imports
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (equinox modules) look their module up here
    spec.loader.exec_module(module)
    return module


def test_train_lm_loss_goes_down(capsys):
    need_devices(8)  # a 2 x 4 data x sequence mesh
    train_lm = _load("train_lm")
    vocab = 64
    result = train_lm.main(["--steps", "12", "--layers", "1", "--seq-len", "64", "--batch", "4", "--d-model", "32",
                            "--vocab", str(vocab), "--min-doc", "4", "--max-doc", "16", "--lr", "1e-2",
                            "--no-progress"])
    losses = result["losses"]
    assert result["mesh"] == {"data": 2, "sp": 4}
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    # well below chance (log vocab): the model learned the stride, not just the unigram
    assert sum(losses[-3:]) / 3 < min(losses[0], math.log(vocab)) - 0.5, losses
    assert result["tokens_per_s"] > 0
    assert "tokens/s" in capsys.readouterr().out


def test_train_lm_packs_documents_with_shifted_targets():
    import numpy as np

    train_lm = _load("train_lm")
    tokens, targets, mask, seg = train_lm.make_batch(np.random.default_rng(0), 2, 40, 16, min_doc=3, max_doc=9)
    same_doc = seg[:, 1:] == seg[:, :-1]
    np.testing.assert_array_equal(mask[:, :-1], same_doc)
    assert not mask[:, -1].any()
    np.testing.assert_array_equal(targets[:, :-1][same_doc], tokens[:, 1:][same_doc])
    assert seg.max() >= 4  # several documents per row


def test_long_context_sweep_writes_table_and_plot(tmp_path):
    need_devices(4)
    long_context = _load("long_context")
    result = long_context.main(["--start", "64", "--max-seq", "128", "--devices", "4", "--heads", "2",
                                "--kv-heads", "1", "--head-dim", "16", "--out-dir", str(tmp_path)])
    rows = result["rows"]
    assert [(r["method"], r["devices"], r["seq_len"], r["status"]) for r in rows] == [
        ("ring", 4, 64, "ok"), ("ring", 4, 128, "ok"), ("dense", 1, 64, "ok"), ("dense", 1, 128, "ok")]
    assert all(r["peak_bytes_per_device"] > 0 for r in rows)
    dense = [r["peak_bytes_per_device"] for r in rows if r["method"] == "dense"]
    assert dense[1] > 2 * dense[0]  # the [seq, seq] scores: quadratic
    with open(tmp_path / "long_context.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "long_context.md").read_text().count("| ring |") == 2
    assert (tmp_path / "long_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_context_stops_at_out_of_memory(tmp_path, monkeypatch):
    long_context = _load("long_context")
    monkeypatch.setattr(long_context, "device_limit", lambda: 1)  # every plan is over the limit
    result = long_context.main(["--start", "64", "--max-seq", "256", "--methods", "dense", "--heads", "2",
                                "--kv-heads", "2", "--head-dim", "16", "--out-dir", str(tmp_path)])
    assert [(r["seq_len"], r["status"]) for r in result["rows"]] == [(64, "OOM")]


def test_generate_decodes_with_a_sharded_cache(capsys):
    need_devices(8)
    generate = _load("generate")
    result = generate.main(["--steps", "5", "--prompt-len", "16", "--layers", "2", "--d-model", "32", "--heads", "4",
                            "--kv-heads", "2", "--vocab", "64"])
    assert result["devices"] == 8 and result["tokens"].shape == (2, 5)
    # the cached logits are those of one call on the whole sequence
    assert result["max_rel_err"] < 1e-5
    assert result["lengths"].tolist() == [21, 21]  # the prompt and every generated token but the last
    assert result["tokens_per_s"] > 0
    assert "tokens/s" in capsys.readouterr().out

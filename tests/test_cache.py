"""Persistent config cache: keys, atomic merged writes, concurrency, corruption, versions, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import pytest

import ringjax
from ringjax.__main__ import main as cli
from ringjax.backends.xla import XlaConfig
from ringjax.dispatch import cache, registry
from ringjax.options import AttentionOptions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("RINGJAX_CACHE_DIR", str(directory))
    monkeypatch.setattr(cache, "_warned", set())
    return directory


def _problem(**opts):
    return registry.Problem(opts=AttentionOptions(softmax_scale=0.25, **opts), batch=1, seq=32, heads=4, kv_heads=2,
                            head_dim=8, dtype="float32", platform="cpu", device_kind="cpu")


def _entry(problem, cfg=XlaConfig(16, 32), portable=False):
    key = (cache.portable_key if portable else cache.cache_key)("ring_attention", "xla", problem)
    return cache.make_entry(key, "XlaConfig", registry.config_to_json(cfg), median_s=1e-3)


def test_key_holds_everything_that_changes_the_kernel():
    p = _problem(causal=True, window=(8, 0), layout="zigzag", axis_name="sp", axis_size=4)
    key = cache.cache_key("ring_attention", "xla", p)
    assert key["op"] == "ring_attention" and key["implementation"] == "xla"
    assert key["shape"] == {"batch": 1, "seq": 32, "heads": 4, "kv_heads": 2, "head_dim": 8}
    assert key["dtype"] == "float32" and key["axis_size"] == 4 and key["device_kind"] == "cpu"
    assert key["features"] == {"causal": True, "window": [8, 0], "has_segments": False, "logits_soft_cap": False,
                               "has_sinks": False, "layout": "zigzag", "gqa_ratio": 2, "chunk_size": None,
                               "has_alibi": False, "dropout_rate": 0.0, "num_sink_tokens": 0,
                               "gather_kv": False, "subshards": 1}
    assert key["versions"] == {"jax": jax.__version__, "jaxlib": key["versions"]["jaxlib"],
                               "ringjax": ringjax.__version__, "schema": cache.SCHEMA_VERSION}
    base = _problem()
    variants = [
        _problem(causal=True), _problem(window=(4, 4)), _problem(has_segments=True), _problem(logits_soft_cap=30.0),
        _problem(has_sinks=True), _problem(layout="striped"), _problem(axis_size=2, axis_name="sp"),
        _problem(chunk_size=16), _problem(has_alibi=True), _problem(dropout_rate=0.1), _problem(num_sink_tokens=4),
        _problem(gather_kv=True), _problem(subshards=2),
        dataclasses.replace(base, kv_heads=4), dataclasses.replace(base, seq=64),
        dataclasses.replace(base, dtype="bfloat16"),
        dataclasses.replace(base, device_kind="TPU v5 lite"),
    ]
    ids = {cache.key_id(cache.cache_key("ring_attention", "xla", p)) for p in [base, *variants]}
    assert len(ids) == len(variants) + 1
    assert cache.cache_key("ring_attention", "other", base) != cache.cache_key("ring_attention", "xla", base)
    # values that do not change the kernel share an entry
    same = dataclasses.replace(base, opts=dataclasses.replace(base.opts, softmax_scale=0.5, axis_name="seq"))
    assert cache.cache_key("ring_attention", "xla", same) == cache.cache_key("ring_attention", "xla", base)
    capped = [_problem(logits_soft_cap=c) for c in (20.0, 50.0)]
    assert len({cache.key_id(cache.cache_key("ring_attention", "xla", p)) for p in capped}) == 1


def test_put_get_merge_atomic(cache_dir):
    store = cache.user_store("cpu")
    a, b = _problem(), _problem(causal=True)
    assert store.put(_entry(a, XlaConfig(8, 8))) and store.put(_entry(b, XlaConfig(16, 8)))
    assert cache.lookup("ring_attention", "xla", a)[1]["config"] == {"block_q": 8, "block_kv": 8}
    stored = store.get(cache.cache_key("ring_attention", "xla", b))
    assert cache.lookup("ring_attention", "xla", b) == ("persistent", stored)
    assert sorted(p.name for p in cache_dir.iterdir()) == ["cpu.json", "cpu.json.lock"]  # no temporary files left
    doc = json.loads((cache_dir / "cpu.json").read_text())
    assert doc["schema"] == cache.SCHEMA_VERSION and len(doc["entries"]) == 2
    assert store.remove([cache.key_id(cache.cache_key("ring_attention", "xla", a))])
    assert cache.lookup("ring_attention", "xla", a) is None and cache.lookup("ring_attention", "xla", b) is not None


WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ringjax.dispatch import cache
    worker, count, directory = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    (directory / f"ready-{worker}").touch()
    while not (directory / "go").exists():
        time.sleep(0.005)
    store = cache.user_store("cpu")
    for i in range(count):
        key = {"op": "test", "worker": worker, "i": i}
        assert store.put(cache.make_entry(key, "XlaConfig", {"block_q": i + 1, "block_kv": worker + 1}))
""")


def test_concurrent_writers_lose_nothing(cache_dir, tmp_path):
    """4 processes merge 20 entries each into one file at the same time; all 80 survive."""
    workers, count = 4, 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(count), str(tmp_path)], env=env)
             for w in range(workers)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{w}").exists() for w in range(workers)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a writer died while starting"
        time.sleep(0.01)
    (tmp_path / "go").touch()  # release them together so their writes interleave
    assert [p.wait(timeout=120) for p in procs] == [0] * workers
    entries = json.loads((cache_dir / "cpu.json").read_text())["entries"]
    got = {(e["key"]["worker"], e["key"]["i"]) for e in entries.values()}
    assert got == {(w, i) for w in range(workers) for i in range(count)}


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        b"\xff\xfe\x00garbage",
        json.dumps({"format": cache.FORMAT, "schema": cache.SCHEMA_VERSION + 1, "device_kind": "cpu", "entries": {}}),
        json.dumps({"format": "something-else", "entries": {}}),
        json.dumps({"format": cache.FORMAT, "schema": cache.SCHEMA_VERSION, "entries": {"x": {"key": {}}}}),
    ],
    ids=["truncated", "binary", "foreign-schema", "foreign-format", "bad-entry"],
)
def test_bad_file_warns_once_is_set_aside_and_work_continues(cache_dir, content):
    cache_dir.mkdir()
    path = cache_dir / "cpu.json"
    raw = content if isinstance(content, bytes) else content.encode()
    path.write_bytes(raw)
    with pytest.warns(RuntimeWarning, match="moved it to cpu.json.bad-") as record:
        assert cache.lookup("ring_attention", "xla", _problem()) is None
    assert len(record) == 1
    aside = list(cache_dir.glob("cpu.json.bad-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == raw  # kept for inspection, unchanged
    assert not path.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert cache.lookup("ring_attention", "xla", _problem()) is None
        assert cache.user_store("cpu").put(_entry(_problem()))
    assert cache.lookup("ring_attention", "xla", _problem())[0] == "persistent"


def test_bad_file_found_by_a_writer_is_replaced(cache_dir):
    cache_dir.mkdir()
    (cache_dir / "cpu.json").write_text("[1, 2")
    with pytest.warns(RuntimeWarning, match="starting a new file"):
        assert cache.user_store("cpu").put(_entry(_problem()))
    assert len(list(cache_dir.glob("cpu.json.bad-*"))) == 1
    assert cache.lookup("ring_attention", "xla", _problem()) is not None


@pytest.mark.parametrize("module", [ringjax._version, jax])
def test_version_bump_invalidates(monkeypatch, module):
    p = _problem()
    cache.user_store("cpu").put(_entry(p))
    assert cache.lookup("ring_attention", "xla", p) is not None
    monkeypatch.setattr(module, "__version__", "99.0.0")
    assert cache.lookup("ring_attention", "xla", p) is None
    entry = next(iter(cache.user_store("cpu").entries().values()))
    assert not cache.is_current(entry)
    assert cli(["cache", "clear", "--stale"]) == 0
    assert cache.user_store("cpu").entries() == {}


def test_unwritable_cache_dir_warns_once(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("RINGJAX_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="in memory only") as record:
        assert not cache.user_store("cpu").put(_entry(_problem()))
        assert not cache.user_store("cpu").put(_entry(_problem(causal=True)))
    assert len(record) == 1
    assert cache.lookup("ring_attention", "xla", _problem()) is None


def test_export_import_and_shipped(cache_dir, tmp_path, monkeypatch, capsys):
    p, q = _problem(), _problem(causal=True)
    cache.user_store("cpu").put(_entry(p, XlaConfig(8, 16)))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(cache, "shipped_dir", lambda: shipped)
    assert cli(["cache", "export", str(shipped / "cpu.json"), "--device-kind", "cpu", "--portable"]) == 0
    doc = json.loads((shipped / "cpu.json").read_text())
    assert all("versions" not in e["key"] for e in doc["entries"].values())
    assert cli(["cache", "clear"]) == 0
    found = cache.lookup("ring_attention", "xla", p)
    assert found[0] == "shipped" and found[1]["config"] == {"block_q": 8, "block_kv": 16}
    # a shipped config survives a version bump; user entries do not
    monkeypatch.setattr(ringjax._version, "__version__", "99.0.0")
    assert cache.lookup("ring_attention", "xla", p)[0] == "shipped"
    # importing a portable file adopts it for the installed versions, ahead of shipped ones
    assert cli(["cache", "import", str(shipped / "cpu.json")]) == 0
    assert cache.lookup("ring_attention", "xla", p)[0] == "persistent"
    assert cache.lookup("ring_attention", "xla", q) is None
    capsys.readouterr()
    assert cli(["cache", "list"]) == 0 and cli(["cache", "show", "--shipped"]) == 0
    out = capsys.readouterr().out
    assert "user     cpu.json: 'cpu', 1 entry" in out and "shipped  cpu.json" in out
    assert '-> {"block_kv": 16, "block_q": 8}' in out
    assert cli(["cache", "import", str(tmp_path / "missing.json")]) == 1


def test_cli_export_to_a_missing_folder(tmp_path, capsys):
    """As `cache import` of a missing file: a message naming the file, exit code 1, no traceback."""
    cache.user_store("cpu").put(_entry(_problem()))
    target = tmp_path / "missing" / "cpu.json"
    assert cli(["cache", "export", str(target), "--device-kind", "cpu"]) == 1
    assert capsys.readouterr().err.startswith(f"cannot export to {target}: ")
    assert not target.parent.exists()


def test_cli_tune_arguments_are_checked(capsys):
    assert cli(["tune", "--batch", "1", "--seq", "30", "--heads", "2", "--head-dim", "8", "--axis-size", "4"]) == 2
    assert "seq (30) must be divisible by 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["tune", "--batch", "0", "--seq", "32", "--heads", "2", "--head-dim", "8"])


def test_main_module_has_no_import_side_effects():
    result = subprocess.run(
        [sys.executable, "-c", "import ringjax.__main__ as m; assert callable(m.main)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result.stderr


def _problem_from_key(key):
    """The Problem a portable key was made from (TypeError if the key names an option that no longer exists)."""
    features = dict(key["features"])
    features.pop("gqa_ratio")
    features["logits_soft_cap"] = 1.0 if features["logits_soft_cap"] else None
    if isinstance(features.get("window"), list):
        features["window"] = tuple(features["window"])
    axis_size = key["axis_size"]
    opts = AttentionOptions(**features, axis_size=axis_size, axis_name="sp" if axis_size > 1 else None)
    return registry.Problem(opts=opts, **key["shape"], dtype=key["dtype"], platform=key["platform"],
                            device_kind=key["device_kind"])


def test_shipped_files_are_valid():
    """Every shipped entry is found by the key today's code builds for its problem, and its config loads."""
    files = cache.shipped_files()
    if not files:
        pytest.skip("ringjax ships no measured configs yet (ringjax/configs/ has no .json file)")
    for path in files:
        doc = cache.read_document(path)
        assert path.stem == cache.file_stem(doc["device_kind"])
        for kid, entry in doc["entries"].items():
            key = entry["key"]
            assert "versions" not in key, f"{path.name}: shipped keys must be portable"
            problem = _problem_from_key(key)
            assert cache.portable_key(key["op"], key["implementation"], problem) == key, f"{path.name}: stale key"
            assert kid == cache.key_id(key)
            found = cache.lookup(key["op"], key["implementation"], problem)
            assert found is not None and found[0] == "shipped" and found[1] == entry, path.name
            reg = next(r for r in registry.registrations(key["op"]) if r.name == key["implementation"])
            config = registry.config_from_json(reg.load().config_type, entry["config"])
            assert type(config).__name__ == entry["config_type"]


def test_cli_list_clear_and_implementations_tell_the_truth(cache_dir, capsys):
    assert not cache_dir.exists()
    assert cli(["cache", "list"]) == 0
    assert "does not exist yet" in capsys.readouterr().out
    cache.user_store("cpu").put(_entry(_problem()))
    assert sorted(p.name for p in cache_dir.iterdir()) == ["cpu.json", "cpu.json.lock"]
    assert cli(["cache", "list"]) == 0
    assert "does not exist" not in capsys.readouterr().out
    assert cli(["cache", "clear"]) == 0
    assert list(cache_dir.iterdir()) == [], "clear leaves no file behind, lock included"
    cache.user_store("cpu").put(_entry(_problem()))  # the store still works after its lock was removed
    assert cache.lookup("ring_attention", "xla", _problem())[0] == "persistent"
    capsys.readouterr()
    assert cli(["implementations"]) == 0
    listing, _, table = capsys.readouterr().out.partition("\n\n")
    lines = listing.splitlines()
    assert table.startswith("| argument | meaning |")  # then the feature table
    columns = {line.index(line.split()[1]) for line in lines}  # the priority column starts at one offset
    assert len(lines) >= 4 and len(columns) == 1

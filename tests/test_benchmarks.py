"""benchmarks/bench.py: every suite runs on CPU at --tiny sizes and records sane rows; `report` renders them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import child_env

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"
SUITES = ("step", "ring", "strategies", "coverage", "precision", "million", "decode", "prefill")
DEVICES = 4
BF16_ERR = 2e-2  # bf16 outputs against a float32 or another bf16 computation of the same attention


def _script(name: str):
    """benchmarks/<name>.py imported (the scripts import common.py beside them)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


@pytest.fixture(scope="module")
def bench():
    return _script("bench")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every suite run once with --tiny on 4 simulated CPU devices, side by side: (out dir, {suite: (rc, log)})."""
    out = tmp_path_factory.mktemp("bench")
    env = child_env(DEVICES, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", RINGJAX_CACHE_DIR=str(out / "cache"))
    procs = {}
    for suite in SUITES:
        log = (out / f"{suite}.log").open("w")
        procs[suite] = (subprocess.Popen([sys.executable, str(BENCH), suite, "--tiny", "--out", str(out),
                                          "--tag", "test"], stdout=log, stderr=subprocess.STDOUT, env=env), log)
    runs = {}
    for suite, (proc, log) in procs.items():
        rc = proc.wait(timeout=300)
        log.close()
        runs[suite] = (rc, (out / f"{suite}.log").read_text())
    return out, runs


def run_bench(tmp_path: Path, *args: str, devices: int = 1) -> subprocess.CompletedProcess:
    """bench.py `args` with --out tmp_path in a child on `devices` simulated CPU devices (its own config cache)."""
    env = child_env(devices, PYTHONPATH=str(ROOT), RINGJAX_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, str(BENCH), *args, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)


def rows_of(out: Path, suite: str) -> list[dict]:
    (path,) = out.glob(f"*_{suite}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_step(rows):
    ours = [r for r in rows if r["case"]["library"] == "ringjax"]
    assert sorted(r["case"]["causal"] for r in ours) == [False, True]
    for r in ours:
        assert r["implementation"] == "xla" and r["reference"] == "xla float32"
        assert r["config"] == {"block_q": 512, "block_kv": 512} and r["config_source"] == "heuristic"  # what ran
        assert r["fwd_tflops"] > 0 and r["fwd_bwd_tflops"] > 0 and "bwd_ms" in r
        assert r["rel_err"] < BF16_ERR
    for r in rows:
        if r["case"]["library"] != "ringjax":  # cuDNN and tokamax need a GPU: skipped, with the reason
            assert "GPU" in r["skipped"] or "not importable" in r["skipped"]


def check_ring(rows):
    assert [r["case"]["tokens_per_device"] for r in rows] == [64, 128]
    for r in rows:
        tp, c = r["case"]["tokens_per_device"], r["case"]
        assert r["ring"]["fwd_tflops"] > 0 and r["one_device"]["fwd_bwd_tflops"] > 0
        assert r["ring_over_one_device"]["fwd"] > 0 and r["ring_over_cudnn"]["fwd"] is None
        # the one-device baseline ran on every device of the ring; the slowest is the one ratios also use
        assert [g["device"] for g in r["one_device_by_gpu"]] == list(range(c["devices"]))  # CPU devices 0..N-1
        worst = min(g["fwd_bwd_tflops"] for g in r["one_device_by_gpu"])
        assert r["slowest_one_device"]["fwd_bwd_tflops"] == worst <= r["one_device"]["fwd_bwd_tflops"]
        assert r["ring_over_slowest_one_device"]["fwd_bwd"] >= r["ring_over_one_device"]["fwd_bwd"]
        assert r["kv_bytes_per_step"] == 2 * c["batch"] * tp * c["kv_heads"] * c["head_dim"] * 2
        assert r["rel_err"] < BF16_ERR  # the ring's output, back in token order, against one device's
        assert "skipped" in r["cudnn"]


def check_strategies(rows):
    by = {r["case"]["strategy"]: r for r in rows}
    assert set(by) == {"ring", "all_gather", "ulysses", "hybrid", "auto"}
    for r in rows:
        assert r["fwd_tflops"] > 0 and r["fwd_bwd_tflops"] > 0
        assert r["rel_err_vs_ring"] < 1e-2  # every strategy computes the ring's attention
        # what the predictions replay (`spread.Strategy.sort_tokens`): recorded where there is an all-to-all
        assert r.get("sort_tokens") is (True if r["case"]["strategy"] in ("ulysses", "hybrid") else None)
        # against the same work on one device, timed on each device of the run
        assert len(r["one_device_by_gpu"]) == r["case"]["devices"]
        assert r["over_one_device"]["fwd_bwd"] == pytest.approx(
            r["fwd_bwd_tflops"] / r["one_device"]["fwd_bwd_tflops"], rel=1e-2)
        assert r["over_slowest_one_device"]["fwd"] >= r["over_one_device"]["fwd"]
    assert by["auto"]["chosen"] in by and "chose" in by["auto"]["reason"]


def check_coverage(rows):
    features = [r["case"]["feature"] for r in rows]
    assert features == ["plain", "head_dim=16", "head_dim=24", "head_dim=48", "head_dim=64", "mla", "float32", "alibi",
                        "dropout", "sink_tokens", "chunked", "segments", "chunked_documents", "sink_tokens_documents",
                        "soft_cap", "window",
                        "learnable_sinks"]
    for r in rows:
        assert r["implementation"] == "xla" and r["finite"]
        assert r["fwd_tflops"] > 0 and r["fwd_bwd_tflops"] > 0 and r["vs_plain"]["fwd"] > 0
        assert "skipped" in r["cudnn"]


def check_precision(rows):
    cases = [(r["case"]["precision"], r["case"]["asked"]) for r in rows]
    assert cases == [(p, a) for p in ("default", "highest") for a in ("jax.nn", "xla", "pallas_triton", "auto")]
    for r in rows:
        assert r["case"]["dtype"] == "float32"
        if r["case"]["asked"] == "pallas_triton":  # a GPU backend: skipped on CPU, with the reason
            assert "runs on gpu" in r["skipped"]
            continue
        assert r["implementation"] == ("jax.nn" if r["case"]["library"] == "jax.nn" else "xla")
        assert r["fwd_tflops"] > 0 and r["fwd_bwd_tflops"] > 0
        assert r["rel_err"] < 1e-5  # CPUs multiply float32 exactly under every setting
        assert r["case"]["library"] == "jax.nn" or r["vs_jax_nn"]["fwd"] > 0


def check_million(rows):
    (r,) = rows
    assert r["case"]["tokens"] == 2048 and r["case"]["devices"] == DEVICES
    assert r["seconds"] > 0 and r["tflops_per_device"] > 0
    assert r["rel_err"] < BF16_ERR
    assert r["peak_gib_per_device"] is None and "memory_stats" in r["memory_note"]  # CPU reports no peak


def check_decode(rows):
    cases = [(r["case"]["cache"], r["case"]["batch"], r["case"]["t"], r["case"]["library"], r["case"]["implementation"])
             for r in rows]
    assert cases == [(c, b, t, lib, impl) for c in (256, 512) for b in (1, 2) for t in (1, 4)
                     for lib, impl in (("ringjax", "auto"), ("ringjax", "xla-reduce"), ("jax.nn", "xla"),
                                       ("jax.nn", "cudnn"))]
    for r in rows:
        c = r["case"]
        if c["implementation"] == "cudnn":  # needs a GPU: skipped, with the reason
            assert "GPU" in r["skipped"]
            continue
        assert c["devices"] == (DEVICES if c["library"] == "ringjax" else 1)
        assert r["ms"] > 0 and r["copy_gbps"] > 0 and r["of_copy"] > 0
        kv_bytes = c["batch"] * c["cache"] * c["kv_heads"] * 2 * c["head_dim"] * 2
        assert abs(r["gbps"] - kv_bytes / r["ms"] / 1e6) <= 1e-3 * r["gbps"]
        if c["library"] == "jax.nn" and c["t"] == 1:
            assert r["rel_err"] < BF16_ERR  # ringjax's output against jax.nn's on the same data


def check_prefill(rows):
    cases = [(r["case"]["t"], r["case"]["implementation"], r["case"]["strategy"]) for r in rows]
    assert cases == [(64, impl, s) for impl in ("xla", "auto") for s in ("pass_q", "pass_kv")]
    for r in rows:
        c = r["case"]
        assert c["cached"] == 64 and c["devices"] == DEVICES and r["ms"] > 0 and r["tflops_per_device"] > 0
        pairs = 64 * 64 + 64 * 65 / 2
        flops = 4 * c["batch"] * c["heads"] * c["head_dim"] * pairs
        assert abs(r["tflops_per_device"] - flops / (r["ms"] / 1e3) / 1e12 / DEVICES) <= 1e-3 * r["tflops_per_device"]
        assert r["implementation"] == "xla"  # what ran: on a CPU the XLA partials
        if (c["implementation"], c["strategy"]) != ("xla", "pass_q"):
            assert r["rel_err_vs_xla"] < BF16_ERR


CHECKS = {"step": check_step, "ring": check_ring, "strategies": check_strategies, "coverage": check_coverage,
          "precision": check_precision, "million": check_million, "decode": check_decode, "prefill": check_prefill}


@pytest.mark.xdist_group("bench_suites")  # one worker runs the suites (the `results` fixture) once
@pytest.mark.parametrize("suite", SUITES)
def test_suite_runs_on_cpu(results, suite):
    out, runs = results
    rc, log = runs[suite]
    assert rc == 0, log[-3000:]
    rows = rows_of(out, suite)
    assert rows, log[-3000:]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["suite"] == suite and r["device_kind"] and r["platform"] == "cpu" and r["jax"] and r["ringjax"]
        assert r["time"].endswith("+00:00") and r["tag"] == "test" and r["options"]["tiny"]
        assert "bench.py" in r["command"] and suite in r["command"]
        expected = 1 if suite in ("step", "coverage", "precision") else DEVICES
        assert r["device_count"] == expected
    CHECKS[suite](rows)
    assert "|---|" in log  # the run ends with its markdown table


def test_coverage_candidates_judge_auto(tmp_path):
    """--candidates times what auto could have run beside its prediction (on a CPU: xla alone, unpredicted)."""
    child = run_bench(tmp_path, "coverage", "--tiny", "--candidates", "--features", "plain,alibi")
    assert child.returncode == 0, child.stderr[-3000:]
    rows = rows_of(tmp_path, "coverage")
    assert [r["case"]["feature"] for r in rows] == ["plain", "alibi"]
    for r in rows:
        assert set(r["candidates"]) == {"xla"} and r["candidates"]["xla"]["fwd_bwd_ms"] == r["fwd_bwd_ms"]
        assert r["auto_vs_fastest"] == 1.0 and r["predicted_error"] is None  # no calibration for a CPU
    assert "| auto / fastest | predicted err |" in child.stdout


def test_step_variants_time_configs_side_by_side(tmp_path):
    """--variant: the implementation's own config and each variant of it, in interleaved rounds; the rows say
    which config ran, compare the variant's output with the default's, and stay out of calibrations."""
    from ringjax.dispatch import calibrate

    child = run_bench(tmp_path, "step", "--tiny", "--implementation", "xla", "--variant", "block_q=64,block_kv=32",
                      "--rounds", "2")
    assert child.returncode == 0, child.stderr[-3000:]
    rows = [r for r in rows_of(tmp_path, "step") if r["case"]["library"] == "ringjax"]
    got = [(r["case"]["causal"], r["case"]["variant"], r["case"]["round"]) for r in rows]
    assert got == [(c, v, n) for c in (True, False) for n in (0, 1) for v in ("default", "block_q=64,block_kv=32")]
    for r in rows:
        varied = r["case"]["variant"] != "default"
        assert r["config"] == ({"block_q": 64, "block_kv": 32} if varied else {"block_q": 512, "block_kv": 512})
        assert r["rel_err"] < 2e-2 and ("vs_default" in r) == varied
        assert ("grads_vs_default" in r) == (varied and r["case"]["round"] == 0)
        if "grads_vs_default" in r:  # other blocks sum in another order: close, not equal
            assert set(r["grads_vs_default"]) == {"dq", "dk", "dv"}
            assert all(0 <= x < 2e-2 for x in r["grads_vs_default"].values())
        assert calibrate.kernel_row(r, "x") is None
    assert "ringjax [block_q=64,block_kv=32]" in child.stdout
    bad = run_bench(tmp_path, "step", "--tiny", "--variant", "block_q=64")
    assert bad.returncode != 0 and "--variant needs --implementation" in bad.stderr


def test_step_masks_picks_the_cases(tmp_path):
    """--masks full: only the cases without a causal mask run (an A/B of a config that matters there)."""
    child = run_bench(tmp_path, "step", "--tiny", "--implementation", "xla", "--masks", "full")
    assert child.returncode == 0, child.stderr[-3000:]
    assert {r["case"]["causal"] for r in rows_of(tmp_path, "step")} == {False}


def test_step_takes_a_v_head_dim_of_its_own(tmp_path, bench):
    """--v-head-dim (multi-head latent attention): v and the output take it, the reference pads v as cuDNN's runs
    do, FLOPs count QK^T at q's head_dim and PV at v's, and no calibration reads the rows; other suites refuse it."""
    from ringjax.dispatch import calibrate

    child = run_bench(tmp_path, "step", "--tiny", "--implementation", "xla", "--masks", "full", "--head-dim", "48",
                      "--v-head-dim", "32")
    assert child.returncode == 0, child.stderr[-3000:]
    (row,) = [r for r in rows_of(tmp_path, "step") if r["case"]["library"] == "ringjax"]
    assert row["case"]["head_dim"] == 48 and row["case"]["v_head_dim"] == 32
    assert row["rel_err"] < 2e-2 and row["reference"] == "xla float32"
    t = row["case"]["T"]
    assert bench.Shape.of_row(row["case"]).flops(t, False) == 2 * 4 * t * t * (48 + 32)
    assert calibrate.kernel_row(row, "x") is None
    plain = bench.Shape(1, 4, 2, 48, "bfloat16")
    assert plain.flops(t, True) == 4 * 4 * t * t * 48 / 2 and "v_head_dim" not in plain.fields()
    bad = run_bench(tmp_path, "coverage", "--tiny", "--v-head-dim", "32")
    assert bad.returncode != 0 and "--v-head-dim: only the step suite" in bad.stderr


def test_coverage_variants_follow_each_feature(tmp_path):
    """coverage --variant: each feature's own row, then each variant's with the config that ran and its ratio to
    the default (`vs_default`), out of calibrations; a variant the config cannot take is a row, not a crash."""
    from ringjax.dispatch import calibrate

    child = run_bench(tmp_path, "coverage", "--tiny", "--implementation", "xla", "--features", "plain,window",
                      "--variant", "block_q=64,block_kv=32", "--variant", "no_such_field=1")
    assert child.returncode == 0, child.stderr[-3000:]
    rows = rows_of(tmp_path, "coverage")
    names = ("default", "block_q=64,block_kv=32", "no_such_field=1")
    assert [(r["case"]["feature"], r["case"].get("variant", "default")) for r in rows] == [
        (f, v) for f in ("plain", "window") for v in names]
    for r in rows:
        variant = r["case"].get("variant")
        assert (calibrate.kernel_row(r, "x") is None) == (variant is not None)
        if variant == names[1]:
            assert r["config"] == {"block_q": 64, "block_kv": 32} and set(r["vs_default"]) >= {"fwd", "fwd_bwd"}
        elif variant == names[2]:
            assert "no_such_field" in r["error"]
    assert "| plain [block_q=64,block_kv=32] |" in child.stdout


def test_million_variants_time_each_config(tmp_path):
    """million --variant: the implementation's own config, then each variant's, each row saying which ran."""
    child = run_bench(tmp_path, "million", "--tiny", "--implementation", "xla", "--tokens", "1024", "--variant",
                      "block_q=64,block_kv=32", devices=2)
    assert child.returncode == 0, child.stderr[-3000:]
    rows = rows_of(tmp_path, "million")
    assert [r["case"]["variant"] for r in rows] == ["default", "block_q=64,block_kv=32"]
    assert rows[1]["config"] == {"block_q": 64, "block_kv": 32} and rows[0]["config"] != rows[1]["config"]
    for r in rows:
        assert r["implementation"] == "xla" and r["seconds"] > 0 and r["case"]["devices"] == 2
        assert r["rel_err"] < BF16_ERR  # each against one device


def test_report_writes_readme_tables_and_plots(results, tmp_path):
    out, runs = results
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\n<!-- bench:step:begin -->\nstale\n<!-- bench:step:end -->\n\n"
                      "<!-- bench:ring:begin -->\n<!-- bench:ring:end -->\ntail\n")
    child = subprocess.run([sys.executable, str(BENCH), "report", "--out", str(out), "--write-readme",
                            "--readme", str(readme)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# title\n") and text.endswith("<!-- bench:ring:end -->\ntail\n")
    assert "| T | causal | library |" in text and "| devices | tokens/device |" in text
    assert "**cpu x1**, jax " in text and "**cpu x4**, jax " in text  # device kind and count, jax version
    for suite in ("step", "ring", "strategies", "coverage"):
        (png,) = out.glob(f"*_{suite}.png")
        assert png.read_bytes().startswith(b"\x89PNG")

    printed = subprocess.run([sys.executable, str(BENCH), "report", "--out", str(out), "--no-plots"],
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    for suite in SUITES:  # without --write-readme: every suite's markdown to stdout, between its markers
        assert f"<!-- bench:{suite}:begin -->\n**cpu x" in printed.stdout


def test_replace_marked(bench):
    text = "intro\n<!-- bench:step:begin -->\nold\ntable\n  <!-- bench:step:end -->\n<!-- bench:ring:begin -->\nx\n" \
           "<!-- bench:ring:end -->\n"
    new = bench.replace_marked(text, "step", "\n| a |\n")
    assert new == ("intro\n<!-- bench:step:begin -->\n| a |\n  <!-- bench:step:end -->\n<!-- bench:ring:begin -->\n"
                   "x\n<!-- bench:ring:end -->\n")
    assert bench.replace_marked(new, "step", "| a |") == new  # idempotent
    with pytest.raises(ValueError):
        bench.replace_marked(text, "million", "x")  # no markers
    with pytest.raises(ValueError):
        bench.replace_marked("<!-- bench:step:begin --><!-- bench:step:end -->\n", "step", "x")  # one line
    with pytest.raises(ValueError):
        bench.replace_marked("<!-- bench:step:end -->\n<!-- bench:step:begin -->\n", "step", "x")  # reversed


def test_help_lists_every_suite(bench):
    text = bench.parser().format_help()
    for suite in (*SUITES, "report"):
        assert suite in text


def test_back_to_back_dispatches_calls_without_a_sync_between(bench, monkeypatch):
    """--back-to-back N: each timed sample dispatches N calls and waits once, and counts its time per call."""
    calls, waits = [], []
    real_wait = bench.jax.block_until_ready

    def wait(x):
        waits.append(len(calls))
        return real_wait(x)

    monkeypatch.setattr(bench.jax, "block_until_ready", wait)
    bench.timeit(lambda x: calls.append(x) or x + 1, bench.jax.numpy.ones(3), reps=2, warmup=1, back_to_back=5)
    assert len(calls) == 1 + 2 * 5 and waits == [1, 6, 11]  # one warm-up, then a wait after every 5
    args = bench.resolve(bench.parser().parse_args(["ring", "--back-to-back", "20", "--tiny"]))
    assert args.back_to_back == 20  # asked for, also with --tiny
    # by default 5 calls per sample (synced, the host's wait read as kernel time); one for the million-token call
    # and for --tiny's CPU smoke runs
    resolved = {(suite, tiny): bench.resolve(bench.parser().parse_args([suite, *tiny])).back_to_back
                for suite in ("step", "coverage", "million") for tiny in ((), ("--tiny",))}
    assert resolved == {("step", ()): 5, ("coverage", ()): 5, ("million", ()): 1, ("step", ("--tiny",)): 1,
                        ("coverage", ("--tiny",)): 1, ("million", ("--tiny",)): 1}
    floors = {(suite, tiny): bench.resolve(bench.parser().parse_args([suite, *tiny])).sample_ms
              for suite in ("step", "million") for tiny in ((), ("--tiny",))}
    assert floors == {("step", ()): 20.0, ("million", ()): 20.0, ("step", ("--tiny",)): 0.0,
                      ("million", ("--tiny",)): 0.0}


def test_short_calls_take_more_calls_per_sample(bench, monkeypatch):
    """min_sample_s: where a first sample of `back_to_back` calls lasts less, every sample takes as many calls as
    last that long (within MAX_CALLS_PER_SAMPLE), and the time per call is still what is kept."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    waits = []

    def wait(out):
        waits.append(len(out))
        return out

    monkeypatch.setattr(bench.jax, "block_until_ready", wait)

    def call(x):  # 1 ms of "device time" per call
        clock[0] += 1e-3
        return x

    per_call = bench.timeit(call, 1.0, reps=3, warmup=0, back_to_back=5, min_sample_s=0.02)
    assert waits == [5, 20, 20, 20] and per_call == pytest.approx(1e-3)  # the 5-call probe, then 20 a sample
    waits.clear()
    bench.timeit(call, 1.0, reps=2, warmup=0, back_to_back=5, min_sample_s=10.0)
    most = sys.modules[bench.timeit.__module__].MAX_CALLS_PER_SAMPLE
    assert waits == [5, most, most]
    waits.clear()
    bench.timeit(call, 1.0, reps=2, warmup=0, back_to_back=30, min_sample_s=0.02)  # long enough already
    assert waits == [30, 30]


def test_gpu_timeline_sums_device_kernels_per_call(tmp_path):
    """benchmarks/gpu_timeline.py: of a Perfetto trace, only the device's kernels count, per call of CALLS."""
    import gzip

    timeline = _script("gpu_timeline")
    n = timeline.CALLS
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 2, "name": "python", "ts": 0, "dur": 10_000}]
    for i in range(n):  # per call: a 100 us kernel, then a 5 us one, 20 us apart
        events += [{"ph": "X", "pid": 1, "name": "attention", "ts": 200 * i, "dur": 100},
                   {"ph": "X", "pid": 1, "name": "tables", "ts": 200 * i + 120, "dur": 5}]
    trace = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    span, busy, by_name = timeline.kernel_times(trace)
    assert busy == pytest.approx(105) and by_name["attention"] == pytest.approx(100) and "python" not in by_name
    assert span == pytest.approx((200 * (n - 1) + 125) / n)


def test_gpu_timeline_rows_carry_the_host_clock_and_sm_clock(tmp_path):
    """benchmarks/gpu_timeline.py on CPU (the XLA implementation): each row also has the host's time per call of
    the same calls, timed as bench.py times them after --settle-s seconds of calls, and the SM clock before and after
    (None without nvidia-smi)."""
    timeline = _script("gpu_timeline")
    out = tmp_path / "timeline.jsonl"
    assert timeline.main(["--implementation", "xla", "--seqs", "256", "--features", "plain", "--settle-s", "0.2",
                          "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["host_us_per_call"] > 0 and row["span_us_per_call"] > 0
    assert len(row["sm_mhz"]) == 2 and all(c is None or c > 0 for c in row["sm_mhz"])
    assert row["settle_s"] == 0.2


def test_measure_records_the_sm_clock_where_there_is_one(monkeypatch):
    """common.measure: its fields carry the SM clock after each mode's timing where nvidia-smi reads one, none
    without (and nvidia-smi is asked once)."""
    common = _script("common")
    import ringjax

    shape = common.Shape(1, 2, 1, 16, "float32")
    q, k, v, do = common.random_inputs(shape, 64)

    def attn(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name=None, causal=True, implementation="xla")

    for clocks, want in (([1980, 1755], [1980, 1755]), ([None], None)):
        monkeypatch.setattr(common, "sm_mhz", iter(clocks).__next__)
        fields, _ = common.measure(attn, q, k, v, do, 1.0, reps=1, warmup=1, budget_s=1.0)
        assert fields.get("sm_mhz") == want and fields["fwd_ms"] > 0 and fields["fwd_bwd_ms"] > 0


def test_ncu_summary_reads_segments_and_stalls(tmp_path, capsys):
    """benchmarks/ncu_kernel.py summary: details metrics, stall shares, and runs of equally executed instructions."""
    import csv
    import gzip

    ncu = _script("ncu_kernel")
    with open(tmp_path / "k_details.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        w.writerow(["Memory", "Local Memory Spilling Requests", "", "1,234"])
        w.writerow(["Memory", "L2 Hit Rate", "%", "98"])
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_wait", "stall_wait (Not Issued)"]
    body = [["0", "LDL R4, [R1]", "30", "100", "30", "0", "7"],  # a loop body of two, 40% of the samples
            ["1", "@P0 HGMMA.64x128x16 R8", "10", "100", "0", "10", "1"],
            ["2", "BRA 0x10", "60", "5", "0", "60", "2"]]
    with gzip.open(tmp_path / "k_sass.csv.gz", "wt", newline="") as f:
        f.write('"Kernel Name","k",\n')
        csv.writer(f).writerows([head, *body])
    assert ncu.main(["summary", str(tmp_path / "k"), "--min-share", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "Local Memory Spilling Requests: 1,234" in out and "L2 Hit Rate" not in out
    assert "wait 70.0%" in out and "long_sb 30.0%" in out
    assert "    2-    3  executed           5   60.0%  BRA 1" in out  # the 40% segment is under --min-share
    assert "LDL" not in out.split("segments")[1]
    assert ncu.config_fields("bwd_fused=TRUE,dkv_num_stages=2") == {"bwd_fused": True, "dkv_num_stages": 2}
    with pytest.raises(SystemExit, match="--config"):
        ncu.config_fields("bwd_fused")


@pytest.mark.parametrize("flag,value", [("--back-to-back", "0"), ("--sample-ms", "-1"), ("--reps", "0"),
                                        ("--warmup", "-1"), ("--budget", "-2"), ("--seqs", "0,8192"), ("--seqs", ",")])
def test_timing_options_refuse_values_that_cannot_time(bench, capsys, flag, value):
    """A count or duration that could not time anything is an argparse error naming the option, before any work."""
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["step", flag, value])
    assert flag in capsys.readouterr().err


def test_tokamax_rows_carry_its_version(monkeypatch):
    from importlib import metadata

    bench = _script("bench")
    assert bench.library_version("cudnn") == {}
    monkeypatch.setattr(metadata, "version", lambda name: {"tokamax": "0.0.17"}[name])
    assert bench.library_version("tokamax") == {"tokamax": "0.0.17"}

"""examples/tpu_pod/ring_benchmark.py runs end to end in one process at tiny sizes (8 simulated CPU devices
in CI, or 8 accelerators)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import jax
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "examples" / "tpu_pod" / "ring_benchmark.py"


def _load():
    spec = importlib.util.spec_from_file_location("example_tpu_pod_ring_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_ring_benchmark_single_process(tmp_path, capsys):
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, {jax.device_count()} {jax.default_backend()} devices here")
    bench = _load()
    out = tmp_path / "results.json"
    results = bench.main(["--seq-len", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                          "--dtype", "float32", "--data-parallel", "2", "--batch", "2", "--warmup", "1",
                          "--iters", "2", "--distributed", "off", "--check", "--output", str(out)])
    saved = json.loads(out.read_text())
    n = jax.device_count()
    assert saved["mesh"] == {"data": 2, "sp": n // 2} and saved["num_devices"] == n
    assert saved["check"]["ok"], saved["check"]
    assert saved["fwd_s"] > 0 and saved["fwd_bwd_s"] > 0 and len(saved["fwd_bwd_times_s"]) == 2
    assert saved["fwd_tflops_per_device"] > 0 and saved["distributed"] is False
    for key in ("date", "jax_version", "device_kind", "problem", "compile_s"):
        assert key in saved
    # the cost model's prediction sits beside the timings where it knows the chip (a GPU or TPU), never for a CPU
    assert ("plan" in saved) == (bench.chip_of(saved["device_kind"]) is not None)
    assert results["fwd_s"] == saved["fwd_s"]
    assert "check ok" in capsys.readouterr().out


def test_ring_benchmark_rejects_bad_mesh_and_flags():
    bench = _load()
    import pytest

    with pytest.raises(ValueError, match="must divide the device count"):
        bench.main(["--data-parallel", "3", "--distributed", "off", "--seq-len", "48"])
    with pytest.raises(ValueError, match="need --implementation"):
        bench.make_config(bench.parse_args(["--block-q", "128"]))


def test_chip_names():
    bench = _load()
    assert bench.chip_of("TPU v5 lite") == "tpu_v5e" and bench.chip_of("TPU v5p") == "tpu_v5p"
    assert bench.chip_of("NVIDIA H100 80GB HBM3") == "h100" and bench.chip_of("NVIDIA H200") == "h200"
    assert bench.chip_of("cpu") is None

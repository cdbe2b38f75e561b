"""The benchmark scripts: each compiles, and the strategies benchmark runs end to end on CPU at tiny sizes."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_strategies_benchmark_runs_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4", RINGJAX_CACHE_DIR=str(tmp_path / "cache"))
    child = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_strategies.py"), "--tokens", "64", "--kv-heads", "8",
         "--reps", "1", "--modes", "fwd", "--out", str(tmp_path), "--tag", "smoke"],
        capture_output=True, text=True, timeout=600, env=env)
    assert child.returncode == 0, child.stderr[-3000:]
    errors = {m[0]: float(m[1]) for m in re.findall(r"strategy=(\w+) mode=fwd .*rel_err_vs_ring=([\d.e-]+)",
                                                     child.stdout)}
    assert set(errors) == {"ring", "all_gather", "ulysses", "hybrid"}, child.stdout[-3000:]
    assert max(errors.values()) < 1e-2  # bf16: every strategy computes the ring's attention
    assert "| 64 | 32/8 | ring |" in child.stdout
    assert (tmp_path / "strategies_smoke.json").stat().st_size > 0

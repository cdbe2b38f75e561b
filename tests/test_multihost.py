"""Ring attention across 2 processes x 4 CPU devices on localhost, checked against the reference.

Runs examples/multihost.py twice (process 0 and 1) with jax.distributed over
127.0.0.1; the ring spans both processes, so half of its K/V transfers cross
between them (gloo TCP).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import ON_HOPPER, check_against_reference, child_env, reference_for, run_ring

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(out, env, extra, extra_per_process=lambda i: [], expect_ok: bool = True):
    """examples/multihost.py as processes 0 and 1 over localhost; returns their logs (each asserted to exit 0,
    or with `expect_ok=False` to fail)."""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "multihost.py"), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i), "--timeout", str(TIMEOUT_S // 2), "--out", str(out),
             *extra, *extra_per_process(i)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    logs = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert (p.returncode == 0) == expect_ok, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    return logs


def _check(out, devices: int, dtype: str):
    got = dict(np.load(out))
    assert int(got["num_devices"]) == devices and int(got["num_processes"]) == 2
    x = {name: got[name] for name in ("q", "k", "v", "dout", "dlse", "segment_ids", "sinks")}
    for name in ("q", "k", "v", "dout"):  # what the processes fed the op, rounded to its dtype
        x[name] = np.asarray(jnp.asarray(x[name], dtype).astype(jnp.float32))
    ref = reference_for(x, causal=True)
    check_against_reference({name: got[name].astype(np.float64) for name in ref if name in got}, ref, dtype)


def test_two_processes_four_devices_each(tmp_path):
    out = tmp_path / "multihost.npz"
    env = child_env(None)  # each process gets 4 devices from --cpu-devices, not the 8 that conftest asks for
    logs = _run_two(out, env, ["--cpu-devices", "4", "--seq-len", "64"])
    for i, log in enumerate(logs):
        assert f"process {i}/2: 4 local of 8 devices" in log
    _check(out, 8, "float32")


def test_invariant_on_two_processes_is_bitwise_one_devices(tmp_path):
    """deterministic="invariant" over 2 processes x 4 devices (zigzag, packed documents, learnable sinks) gives
    the bits this process computes on one device: outputs, lse and every gradient."""
    out = tmp_path / "multihost.npz"
    _run_two(out, child_env(None), ["--cpu-devices", "4", "--seq-len", "128", "--deterministic", "invariant"])
    got = dict(np.load(out))
    x = {name: got[name] for name in ("q", "k", "v", "dout", "dlse", "segment_ids", "sinks")}
    x["dtype"] = "float32"
    one = run_ring(x, 1, causal=True, deterministic="invariant")
    for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
        assert np.array_equal(got[name].astype(np.float64), one[name]), name


@pytest.mark.skipif(not ON_HOPPER or len(jax.devices()) < 2, reason="needs 2 Hopper GPUs (one per process)")
@pytest.mark.parametrize("fused", [False, True])
def test_two_processes_one_gpu_each(tmp_path, fused):
    """One process per GPU (jax.distributed, `local_device_ids` per process), the Mosaic GPU kernels: the ring of
    step kernels matches the float64 reference (outputs, lse, gradients; packed documents, learnable sinks,
    bf16); the fused ring, which failed in NCCL this way, is refused with its reason before any device work."""
    out = tmp_path / "multihost.npz"
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # each child allocates on demand: this process holds its GPU memory already
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    args = ["--implementation", "pallas_mosaic_gpu", "--dtype", "bfloat16", "--seq-len", "2048", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "128", "--batch", "1"] + (["--fused"] if fused else [])
    logs = _run_two(out, env, args, extra_per_process=lambda i: ["--local-device-ids", str(i)], expect_ok=not fused)
    if fused:
        for log in logs:
            assert "fused=True runs with one process for all GPUs" in log, log[-3000:]
        return
    for i, log in enumerate(logs):
        assert f"process {i}/2: 1 local of 2 devices" in log
    _check(out, 2, "bfloat16")

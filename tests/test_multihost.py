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

from harness import ON_HOPPER, check_against_reference, reference_for

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(out, env, extra, per_process_env=lambda i: {}):
    """examples/multihost.py as processes 0 and 1 over localhost; returns their logs (each asserted to exit 0)."""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "multihost.py"), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i), "--timeout", str(TIMEOUT_S // 2), "--out", str(out),
             *extra],
            env={**env, **per_process_env(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    return logs


def _check(out, devices: int, dtype: str):
    got = dict(np.load(out))
    assert int(got["num_devices"]) == devices and int(got["num_processes"]) == 2
    x = {name: got[name] for name in ("q", "k", "v", "dout", "dlse", "segment_ids", "sinks")}
    for name in ("q", "k", "v", "dout"):  # what the processes fed the op, rounded to its dtype
        x[name] = np.asarray(jnp.asarray(x[name], dtype).astype(jnp.float32))
    ref = reference_for(x, causal=True)
    check_against_reference({name: got[name].astype(np.float64) for name in ref}, ref, dtype)


def test_two_processes_four_devices_each(tmp_path):
    out = tmp_path / "multihost.npz"
    env = dict(os.environ)
    # each process gets 4 devices from --cpu-devices; drop the 8 that conftest asks for
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    logs = _run_two(out, env, ["--cpu-devices", "4", "--seq-len", "64"])
    for i, log in enumerate(logs):
        assert f"process {i}/2: 4 local of 8 devices" in log
    _check(out, 8, "float32")


@pytest.mark.skipif(not ON_HOPPER or len(jax.devices()) < 2, reason="needs 2 Hopper GPUs (one per process)")
def test_two_processes_one_gpu_each_fused_ring(tmp_path):
    """The Mosaic GPU fused ring with one process per GPU (jax.distributed, CUDA_VISIBLE_DEVICES per process):
    its kernels copy K/V and the dK/dV partials between the processes' GPUs. Outputs, lse and gradients
    (packed documents, learnable sinks, bf16) against the float64 reference."""
    out = tmp_path / "multihost.npz"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    logs = _run_two(out, env, ["--fused", "--dtype", "bfloat16", "--seq-len", "2048", "--heads", "4",
                               "--kv-heads", "2", "--head-dim", "128", "--batch", "1"],
                    # this process holds its GPU memory already: the children allocate theirs on demand
                    per_process_env=lambda i: {"CUDA_VISIBLE_DEVICES": str(i),
                                               "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    for i, log in enumerate(logs):
        assert f"process {i}/2: 1 local of 2 devices" in log
    _check(out, 2, "bfloat16")

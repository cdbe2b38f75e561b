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

import numpy as np

from harness import check_against_reference, reference_for

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_four_devices_each(tmp_path):
    out = tmp_path / "multihost.npz"
    env = dict(os.environ)
    # each process gets 4 devices from --cpu-devices; drop the 8 that conftest asks for
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "multihost.py"), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i), "--cpu-devices", "4", "--seq-len", "64",
             "--timeout", str(TIMEOUT_S // 2), "--out", str(out)],
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
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
        assert f"process {i}/2: 4 local of 8 devices" in log

    got = dict(np.load(out))
    assert int(got["num_devices"]) == 8 and int(got["num_processes"]) == 2
    x = {name: got[name] for name in ("q", "k", "v", "dout", "dlse", "segment_ids", "sinks")}
    ref = reference_for(x, causal=True)
    check_against_reference({name: got[name].astype(np.float64) for name in ref}, ref, "float32")

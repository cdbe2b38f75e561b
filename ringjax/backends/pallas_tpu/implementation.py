"""Pallas TPU backend: flash-attention block kernels in the ppermute ring, or fused ring kernels.

Registered as "pallas_tpu" (TPU) and "pallas_tpu_interpret" (the same kernels in the
Pallas TPU interpreter on CPU; only when named explicitly, for tests).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from ringjax import _compat
from ringjax.backends.pallas_tpu import SUPPORT
from ringjax.backends.pallas_tpu.config import VMEM_BUDGET, TpuConfig, block_size, fit, refusal, sublanes, vmem_bytes
from ringjax.backends.pallas_tpu.kernels import block_bwd, block_fwd
from ringjax.core.problem import Problem, check_interpret
from ringjax.core.ring import BlockKernel, ring_attention_shard

KERNEL = BlockKernel("pallas_tpu", block_fwd, block_bwd)
# The interpreter holds every device at a barrier in each kernel, so no kernel may sit
# inside lax.cond: the ring runs every step and the kernel skips empty tiles itself.
INTERPRETED_KERNEL = dataclasses.replace(KERNEL, name="pallas_tpu_interpret", skips_empty_steps=True)


def _fused_forward(q, k, v, q_seg, kv_seg, extras, opts, config):
    from ringjax.backends.pallas_tpu.fused_ring import fused_forward

    return fused_forward(q, k, v, q_seg, kv_seg, opts, config)


def _fused_backward(q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config):
    from ringjax.backends.pallas_tpu.fused_ring import fused_backward

    return (*fused_backward(q, k, v, dout, lse, delta, q_seg, kv_seg, opts, config), None)


# forward and backward rings each one kernel that moves K/V (and dK/dV) by remote DMA
FUSED_KERNEL = dataclasses.replace(KERNEL, name="pallas_tpu_fused", ring_fwd=_fused_forward, ring_bwd=_fused_backward)
INTERPRETED_FUSED_KERNEL = dataclasses.replace(FUSED_KERNEL, name="pallas_tpu_fused_interpret")

# XLA's CPU client sizes its thread pools as max(the first of these variables that is set, else
# the cores, and the number of CPU devices) when jax creates the CPU backend (xla::DefaultThreadPoolSize)
_THREAD_VARIABLES = ("PJRT_NPROC", "NPROC")


def host_cores() -> int:
    """Cores this process may run on, as XLA's CPU client counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def xla_cpu_threads(cpu_devices: int) -> tuple[int, str]:
    """(threads, where the number comes from) of the pool that runs XLA's CPU computations.

    The client reads the environment when jax creates the CPU backend; this reads it now.
    """
    for name in _THREAD_VARIABLES:
        try:
            value = int(os.environ[name])
        except (KeyError, ValueError):
            continue
        return max(value, cpu_devices), f"the larger of {name}={value} and {cpu_devices} CPU devices"
    cores = host_cores()
    return max(cores, cpu_devices), f"the larger of {cores} cores and {cpu_devices} CPU devices"


def _devices_in_program(problem: Problem) -> int:
    """How many of this process's CPU devices run the computation the problem belongs to (an upper bound)."""
    mesh = _compat.context_mesh()  # inside shard_map or under jax.set_mesh: every device of the mesh
    n = max(problem.opts.axis_size, mesh.size if mesh is not None else 1)
    if n <= 1:
        return 1
    try:
        local = len(jax.local_devices(backend="cpu"))
    except RuntimeError:  # no CPU backend: nothing runs in the interpreter anyway
        return 1
    return local if mesh is None else min(n, local)  # mesh= given to ring_attention: not in context yet


def interpreter_refusal(problem: Problem) -> str | None:
    """Why the Pallas TPU interpreter could deadlock XLA's CPU runtime on this call, or None.

    Every device's computation runs on threads of one pool. The interpreter holds each
    device at a barrier (a Python threading.Barrier in a host callback) at the start and
    end of every kernel until all devices reach it, and XLA's CPU collectives hold each
    device's thread in a rendezvous until all devices reach it. A device can wait in both at
    once (the ring sends the next K/V while the current step's kernel runs), so with N
    devices up to 2N threads wait together; with fewer, the waiting threads can take the whole
    pool while the devices they wait for are queued behind them, and XLA aborts the process
    when a collective's rendezvous times out. With at least 2N threads that cannot happen:
    each device waits in at most one collective (XLA orders a device's collectives) and one
    kernel (the interpreter orders its kernels).
    """
    n = _devices_in_program(problem)
    if n <= 1:
        return None  # neither barrier waits for anyone
    threads, source = xla_cpu_threads(len(jax.local_devices(backend="cpu")))
    if threads >= 2 * n:
        return None
    fewer = max(1, threads // 2)
    return (f"on {n} devices the Pallas TPU interpreter needs {2 * n} threads in XLA's CPU runtime (each device "
            f"may wait in a collective and at the interpreter's kernel barrier at once) and has {threads}, "
            f"{source}: with fewer, the waiting threads can fill the pool while the devices they wait for are "
            f"queued behind them, and XLA aborts the process. Set the environment variable PJRT_NPROC={2 * n} "
            f"before jax starts, or run on at most {fewer} device{'s' if fewer > 1 else ''}")


@dataclasses.dataclass(frozen=True)
class TpuImplementation:
    name: str = "pallas_tpu"
    config_type: type = TpuConfig
    interpret: bool = False  # the CPU-interpreter registration

    def supports(self, problem: Problem) -> str | None:
        why = SUPPORT.refusal(self.name, problem) or refusal(problem)
        if why is None and self.interpret:
            why = interpreter_refusal(problem)
        return why

    def default_config(self, problem: Problem) -> TpuConfig:
        # about 1024 query rows (all heads of one KV head) per tile keeps the score tile in VMEM
        block_q = max(sublanes(problem.dtype), 1024 // problem.gqa_ratio)
        config = TpuConfig(block_q=block_q, block_kv=512, interpret=self.interpret)
        fitted = fit(config, problem.gqa_ratio, problem.head_dim, problem.dtype, v_head_dim=problem.v_head_dim)
        assert fitted is not None, "supports() refuses problems whose smallest tiles do not fit"
        return fitted

    def candidate_configs(self, problem: Problem) -> list[TpuConfig]:
        align, opts, seq = sublanes(problem.dtype), problem.opts, problem.seq

        def sizes(wants):
            return sorted({block_size(seq, w, opts, align) for w in wants})

        configs = (
            TpuConfig(block_q=bq, block_kv=bk, fused=fused, interpret=self.interpret)
            for bq in sizes((128, 256, 512, 1024))
            for bk in sizes((256, 512, 1024, 2048))
            for fused in ((False,) if _fused_refusal(problem) else (False, True))
            if bq * problem.gqa_ratio <= 4096
        )
        return [c for c in configs
                if vmem_bytes(c, problem.gqa_ratio, problem.head_dim, problem.dtype, problem.v_head_dim) <= VMEM_BUDGET]

    def run(self, problem: Problem, config: TpuConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        check_interpret(self.name, self.interpret, config)
        align = sublanes(problem.dtype)
        used = dataclasses.replace(config, block_q=block_size(problem.seq, config.block_q, problem.opts, align),
                                   block_kv=block_size(problem.seq, config.block_kv, problem.opts, align))
        need = vmem_bytes(used, problem.gqa_ratio, problem.head_dim, problem.dtype, problem.v_head_dim)
        if need > VMEM_BUDGET:
            raise ValueError(f"{self.name}: {config} needs about {need} bytes of VMEM with blocks {used.block_q} x "
                             f"{used.block_kv}, more than the {VMEM_BUDGET} a kernel gets; use smaller blocks or "
                             "leave config=None")
        if config.fused and _fused_refusal(problem):
            raise ValueError(f"{self.name}: fused=True cannot run this call: {_fused_refusal(problem)}; use "
                             "fused=False or leave config=None")
        # a device with no ring axis (axis_name=None, e.g. after a Ulysses all-to-all) has nothing to move
        if config.fused and problem.opts.axis_name is not None:
            kernel = INTERPRETED_FUSED_KERNEL if config.interpret else FUSED_KERNEL
        else:
            kernel = INTERPRETED_KERNEL if config.interpret else KERNEL
        return ring_attention_shard(problem.opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras)


def _fused_refusal(problem: Problem) -> str | None:
    """Why the fused ring (`TpuConfig(fused=True)`) cannot run this call, or None."""
    opts = problem.opts
    if opts.axis_name is None:
        return None  # no ring: the step kernels run
    if opts.chunk_size is not None and not opts.has_segments:
        return "chunk_size without segment_ids runs on the step ring's kernels only"
    if opts.has_alibi or opts.dropout_rate > 0 or opts.num_sink_tokens:
        return "ALiBi, dropout and sink tokens run on the step ring's kernels only"
    return None


IMPLEMENTATION = TpuImplementation()
INTERPRET_IMPLEMENTATION = TpuImplementation(name="pallas_tpu_interpret", interpret=True)

__all__ = ["IMPLEMENTATION", "INTERPRET_IMPLEMENTATION", "KERNEL", "TpuConfig", "block_bwd", "block_fwd"]

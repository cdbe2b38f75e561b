"""Pallas TPU backend: flash-attention block kernels in the ppermute ring, or fused ring kernels.

Registered as "pallas_tpu" (TPU) and "pallas_tpu_interpret" (the same kernels in the
Pallas TPU interpreter on CPU; only when named explicitly, for tests).
"""

from __future__ import annotations

import dataclasses

from ringjax.backends.pallas_tpu import SUPPORT
from ringjax.backends.pallas_tpu.config import VMEM_BUDGET, TpuConfig, block_size, fit, refusal, sublanes, vmem_bytes
from ringjax.backends.pallas_tpu.kernels import block_bwd, block_fwd
from ringjax.core.problem import Problem, check_interpret
from ringjax.core.ring import BlockKernel, ring_attention_shard

KERNEL = BlockKernel.without_extras("pallas_tpu", block_fwd, block_bwd)
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


@dataclasses.dataclass(frozen=True)
class TpuImplementation:
    name: str = "pallas_tpu"
    config_type: type = TpuConfig
    interpret: bool = False  # the CPU-interpreter registration

    def supports(self, problem: Problem) -> str | None:
        return SUPPORT.refusal(self.name, problem) or refusal(problem)

    def default_config(self, problem: Problem) -> TpuConfig:
        # about 1024 query rows (all heads of one KV head) per tile keeps the score tile in VMEM
        block_q = max(sublanes(problem.dtype), 1024 // problem.gqa_ratio)
        config = TpuConfig(block_q=block_q, block_kv=512, interpret=self.interpret)
        fitted = fit(config, problem.gqa_ratio, problem.head_dim, problem.dtype)
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
            for fused in (False, True)
            if bq * problem.gqa_ratio <= 4096
        )
        return [c for c in configs if vmem_bytes(c, problem.gqa_ratio, problem.head_dim, problem.dtype) <= VMEM_BUDGET]

    def run(self, problem: Problem, config: TpuConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        check_interpret(self.name, self.interpret, config)
        align = sublanes(problem.dtype)
        used = dataclasses.replace(config, block_q=block_size(problem.seq, config.block_q, problem.opts, align),
                                   block_kv=block_size(problem.seq, config.block_kv, problem.opts, align))
        need = vmem_bytes(used, problem.gqa_ratio, problem.head_dim, problem.dtype)
        if need > VMEM_BUDGET:
            raise ValueError(f"{self.name}: {config} needs about {need} bytes of VMEM with blocks {used.block_q} x "
                             f"{used.block_kv}, more than the {VMEM_BUDGET} a kernel gets; use smaller blocks or "
                             "leave config=None")
        # a device with no ring axis (axis_name=None, e.g. after a Ulysses all-to-all) has nothing to move
        if config.fused and problem.opts.axis_name is not None:
            kernel = INTERPRETED_FUSED_KERNEL if config.interpret else FUSED_KERNEL
        else:
            kernel = INTERPRETED_KERNEL if config.interpret else KERNEL
        return ring_attention_shard(problem.opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras)


IMPLEMENTATION = TpuImplementation()
INTERPRET_IMPLEMENTATION = TpuImplementation(name="pallas_tpu_interpret", interpret=True)

__all__ = ["IMPLEMENTATION", "INTERPRET_IMPLEMENTATION", "KERNEL", "TpuConfig", "block_bwd", "block_fwd"]

"""Pallas GPU backend: ring steps as Pallas kernels lowered through Triton.

Registered as "pallas_gpu" (GPUs only) and "pallas_gpu_interpret" (the same kernels
run by the Pallas interpreter on any platform, for tests; never chosen by "auto").
"""

from __future__ import annotations

import dataclasses

from ringjax.pallas.gpu.config import MIN_BLOCK, GpuConfig
from ringjax.registry import Problem
from ringjax.ring import BlockKernel, ring_attention_shard

_DTYPES = ("bfloat16", "float16", "float32")


def _fwd(q, k, v, q_info, k_info, extras, opts, config):
    from ringjax.pallas.gpu.triton_block import block_fwd

    del extras  # supports() refuses ALiBi and dropout, the only users of extras
    return block_fwd(q, k, v, q_info, k_info, opts, config)


def _bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts, config):
    from ringjax.pallas.gpu.triton_block import block_bwd

    del extras
    return (*block_bwd(q, k, v, dout, lse, delta, q_info, k_info, opts, config), None)


KERNEL = BlockKernel(name="pallas_gpu", fwd=_fwd, bwd=_bwd, skips_empty_steps=True)


def _refusal(problem: Problem) -> str | None:
    opts = problem.opts
    for flag, what in ((opts.has_alibi, "ALiBi"), (opts.dropout_rate > 0, "dropout"),
                       (opts.num_sink_tokens > 0, "sink tokens (num_sink_tokens)")):
        if flag:
            return f"{what} is not implemented in the Pallas GPU kernels yet (use implementation='xla')"
    if opts.chunk_size is not None and opts.has_segments:
        return ("chunk_size with segment_ids (per-document chunks) is not implemented in the Pallas GPU kernels "
                "yet (use implementation='xla')")
    d = problem.head_dim
    if d < MIN_BLOCK or d > 256 or d & (d - 1):
        return f"head_dim {d} is not supported: needs a power of two in [16, 256] (pad q/k/v or use 'xla')"
    if problem.dtype not in _DTYPES:
        return f"dtype {problem.dtype} is not supported: needs one of {', '.join(_DTYPES)}"
    unit = problem.seq // problem.opts.shards_per_device
    if unit % MIN_BLOCK:
        what = "half the per-device sequence (zigzag)" if problem.opts.shards_per_device == 2 else (
            "the per-device sequence")
        return f"{what} is {unit}: must be a multiple of {MIN_BLOCK}"
    return None


@dataclasses.dataclass(frozen=True)
class PallasGpuImplementation:
    name: str = "pallas_gpu"
    config_type: type = GpuConfig
    interpret: bool = False

    def supports(self, problem: Problem) -> str | None:
        return _refusal(problem)

    def default_config(self, problem: Problem) -> GpuConfig:
        if problem.head_dim <= 64:
            return GpuConfig(num_warps=4, interpret=self.interpret)
        return GpuConfig(interpret=self.interpret)

    def candidate_configs(self, problem: Problem) -> list[GpuConfig]:
        # measured on H200 (benchmarks/NOTES.md, v4/v5): forward 128x128 tiles with 8 warps and
        # 3 stages lead; the split backward with 64x64 tiles and 4 warps leads by far (the fused
        # backward's atomics cost more than the two matmuls it saves, so it is not a candidate)
        out = []
        for bq, bk, warps, stages in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            for bbq, bbk, bwarps in ((64, 64, 4), (32, 64, 4), (64, 128, 8)):
                out.append(GpuConfig(block_q=bq, block_kv=bk, num_warps=warps, num_stages=stages,
                                     bwd_block_q=bbq, bwd_block_kv=bbk, bwd_num_warps=bwarps,
                                     interpret=self.interpret))
        return out

    def run(self, problem: Problem, config: GpuConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        if self.interpret and not config.interpret:
            config = dataclasses.replace(config, interpret=True)
        return ring_attention_shard(problem.opts, KERNEL, config, q, k, v, q_seg, kv_seg, sinks, extras)


IMPLEMENTATION = PallasGpuImplementation()
INTERPRET_IMPLEMENTATION = PallasGpuImplementation(name="pallas_gpu_interpret", interpret=True)

__all__ = ["IMPLEMENTATION", "INTERPRET_IMPLEMENTATION", "KERNEL", "GpuConfig"]

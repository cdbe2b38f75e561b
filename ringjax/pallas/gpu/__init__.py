"""Pallas GPU backend: ring steps as Pallas kernels lowered through Triton.

Registered as "pallas_gpu" (GPUs only) and "pallas_gpu_interpret" (the same kernels
run by the Pallas interpreter on any platform, for tests; never chosen by "auto").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ringjax.pallas.gpu import config as cfg
from ringjax.pallas.gpu.config import MIN_BLOCK, GpuConfig
from ringjax.pallas.gpu.triton_block import block_bwd, block_fwd
from ringjax.registry import Problem, check_interpret, unknown_options
from ringjax.ring import BlockKernel, ring_attention_shard

DTYPES = ("bfloat16", "float16", "float32")
# AttentionOptions fields these kernels implement; any other set away from its default is refused
KNOWN_OPTIONS = frozenset({"causal", "window", "softmax_scale", "logits_soft_cap", "layout", "axis_name",
                           "axis_size", "has_segments", "has_sinks", "chunk_size", "gather_kv", "subshards"})

KERNEL = BlockKernel.without_extras("pallas_gpu", block_fwd, block_bwd, skips_empty_steps=True)


def _shared_memory(problem: Problem) -> tuple[tuple[int, int], int]:
    """(compute capability, shared memory per block) the kernels must fit.

    The GPU's own where one is present; else (the interpreter on a CPU, or a problem
    described for a GPU elsewhere) an H100 / H200, so that runs here use the tiles a GPU would.
    """
    capability = cfg.device_capability(problem.platform) if problem.platform == "gpu" else None
    if capability is None:
        capability = cfg.ASSUMED_CAPABILITY
    return capability, cfg.shared_memory_limit(capability)


def refusal(problem: Problem, capability: tuple[int, int], limit: int) -> str | None:
    """Why the kernels cannot run `problem` on a GPU of `capability` with `limit` bytes of shared memory."""
    opts = problem.opts
    unknown = unknown_options(opts, KNOWN_OPTIONS)
    if unknown:
        return f"{', '.join(unknown)} not implemented in the Pallas GPU kernels yet (use implementation='xla')"
    if opts.chunk_size is not None and opts.has_segments:
        return ("chunk_size with segment_ids (per-document chunks) is not implemented in the Pallas GPU kernels "
                "yet (use implementation='xla')")
    d = problem.head_dim
    if d < MIN_BLOCK or d > 256 or d & (d - 1):
        return f"head_dim {d} is not supported: needs a power of two in [16, 256] (pad q/k/v or use 'xla')"
    if problem.dtype not in DTYPES:
        return f"dtype {problem.dtype} is not supported: needs one of {', '.join(DTYPES)}"
    if capability < cfg.MIN_CAPABILITY:
        need = ".".join(map(str, cfg.MIN_CAPABILITY))
        return f"needs an NVIDIA GPU of compute capability >= {need}, this one has {'.'.join(map(str, capability))}"
    unit = problem.seq // opts.shards_per_device
    if unit % MIN_BLOCK:
        what = "half the per-device sequence (zigzag)" if opts.shards_per_device == 2 else "the per-device sequence"
        return f"{what} is {unit}: must be a multiple of {MIN_BLOCK}"
    smallest = GpuConfig(block_q=MIN_BLOCK, block_kv=MIN_BLOCK, num_stages=1, bwd_block_q=MIN_BLOCK,
                         bwd_block_kv=MIN_BLOCK, bwd_num_stages=1)
    too_big = cfg.over_limit(smallest, d, _itemsize(problem), limit)
    if too_big:
        return f"even the smallest tiles do not fit: {too_big}"
    return None


def _itemsize(problem: Problem) -> int:
    return jnp.dtype(problem.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PallasGpuImplementation:
    name: str = "pallas_gpu"
    config_type: type = GpuConfig
    interpret: bool = False

    def supports(self, problem: Problem) -> str | None:
        return refusal(problem, *_shared_memory(problem))

    def _fit(self, problem: Problem, config: GpuConfig) -> GpuConfig | None:
        return cfg.fit(config, problem.head_dim, _itemsize(problem), _shared_memory(problem)[1])

    def default_config(self, problem: Problem) -> GpuConfig:
        warps = 4 if problem.head_dim <= 64 else 8
        config = self._fit(problem, GpuConfig(num_warps=warps, interpret=self.interpret))
        assert config is not None, "supports() refuses problems whose smallest tiles do not fit"
        return config

    def candidate_configs(self, problem: Problem) -> list[GpuConfig]:
        # measured on H200 (benchmarks/NOTES.md, v4/v5): forward 128x128 tiles with 8 warps and
        # 3 stages lead; the split backward with 64x64 tiles and 4 warps leads by far (the fused
        # backward's atomics cost more than the two matmuls it saves, so it is not a candidate);
        # each is shrunk to the GPU's shared memory, and duplicates dropped
        out = []
        for bq, bk, warps, stages in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            for bbq, bbk, bwarps in ((64, 64, 4), (32, 64, 4), (64, 128, 8)):
                config = self._fit(problem, GpuConfig(block_q=bq, block_kv=bk, num_warps=warps, num_stages=stages,
                                                      bwd_block_q=bbq, bwd_block_kv=bbk, bwd_num_warps=bwarps,
                                                      interpret=self.interpret))
                if config is not None and config not in out:
                    out.append(config)
        return out

    def run(self, problem: Problem, config: GpuConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        check_interpret(self.name, self.interpret, config)
        capability, limit = _shared_memory(problem)
        used = cfg.used_blocks(config, problem.opts, problem.seq)
        too_big = cfg.over_limit(used, problem.head_dim, _itemsize(problem), limit)
        if too_big:
            raise ValueError(f"{self.name}: {config} does not fit this GPU (compute capability "
                             f"{'.'.join(map(str, capability))}): {too_big}; use smaller blocks or fewer stages, "
                             "or leave config=None")
        return ring_attention_shard(problem.opts, KERNEL, config, q, k, v, q_seg, kv_seg, sinks, extras)


IMPLEMENTATION = PallasGpuImplementation()
INTERPRET_IMPLEMENTATION = PallasGpuImplementation(name="pallas_gpu_interpret", interpret=True)

__all__ = ["IMPLEMENTATION", "INTERPRET_IMPLEMENTATION", "KERNEL", "GpuConfig"]

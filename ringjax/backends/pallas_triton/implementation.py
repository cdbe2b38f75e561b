"""The Triton backend's implementation: shared-memory fit, configs, and the ring over its kernels."""

from __future__ import annotations

import dataclasses
import functools

from ringjax import _compat
from ringjax.backends.pallas_triton import SUPPORT
from ringjax.backends.pallas_triton import config as cfg
from ringjax.backends.pallas_triton.config import MIN_BLOCK, GpuConfig
from ringjax.backends.pallas_triton.kernels import block_bwd, block_fwd, fuses_backward
from ringjax.core import blockwise
from ringjax.core.precision import DEFAULT
from ringjax.core.problem import Problem, check_interpret, fused_backward_note
from ringjax.core.ring import BlockKernel, ring_attention_shard


@functools.cache
def kernel(precision: str) -> BlockKernel:
    """The ring step whose float32 tiles multiply at `precision` (a `core.precision` name); one object per
    precision, so traces and compiled calls are shared."""

    def fwd(q, k, v, q_info, k_info, extras, opts, config):
        return block_fwd(q, k, v, q_info, k_info, opts, config, precision=precision)

    def bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts, config):
        if config.bwd_xla:  # the XLA step's backward (core.blockwise); it skips the pairs the mask hides, as ours do
            return blockwise.block_bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts,
                                       blockwise.gpu_blocks(q.shape[0], q.shape[2]), precision=precision)
        return (*block_bwd(q, k, v, dout, lse, delta, q_info, k_info, opts, config, precision=precision), None)

    return BlockKernel("pallas_triton", fwd, bwd, skips_empty_steps=True)


KERNEL = kernel(DEFAULT)


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
    why = SUPPORT.refusal("pallas_triton", problem)
    if why:
        return why
    if capability < cfg.MIN_CAPABILITY:
        need = ".".join(map(str, cfg.MIN_CAPABILITY))
        return f"needs an NVIDIA GPU of compute capability >= {need}, this one has {'.'.join(map(str, capability))}"
    smallest = GpuConfig(block_q=MIN_BLOCK, block_kv=MIN_BLOCK, num_stages=1, bwd_block_q=MIN_BLOCK,
                         bwd_block_kv=MIN_BLOCK, bwd_num_stages=1)
    too_big = cfg.over_limit(smallest, problem.head_dim, problem.itemsize, limit, problem.v_head_dim)
    if too_big:
        return f"even the smallest tiles do not fit: {too_big}"
    return None


@dataclasses.dataclass(frozen=True)
class PallasTritonImplementation:
    name: str = "pallas_triton"
    config_type: type = GpuConfig
    interpret: bool = False

    def supports(self, problem: Problem) -> str | None:
        withdrawn = None if self.interpret else _compat.pallas_triton_withdrawn()  # the interpreter lowers no Triton
        return withdrawn or refusal(problem, *_shared_memory(problem))

    def _fit(self, problem: Problem, config: GpuConfig) -> GpuConfig | None:
        return cfg.fit(config, problem.head_dim, problem.itemsize, _shared_memory(problem)[1], problem.v_head_dim)

    def default_config(self, problem: Problem) -> GpuConfig:
        warps = 4 if max(problem.head_dims) <= 64 else 8
        # float32 dK/dV accumulators of 64 x 64 tiles spill 4 warps' registers: 32 keys per block took the
        # float32 8K causal backward from 40.4 to 28.2 ms on one H200 (jax 0.11.2, 2026-12-03)
        bwd_kv = 32 if problem.itemsize == 4 else GpuConfig.bwd_block_kv
        # and XLA's float32 backward beats both: 8K causal fwd+bwd 26.0 ms against 36.6 (split) and 34.4 (fused)
        config = self._fit(problem, GpuConfig(num_warps=warps, bwd_block_kv=bwd_kv, bwd_xla=problem.itemsize == 4,
                                              interpret=self.interpret))
        assert config is not None, "supports() refuses problems whose smallest tiles do not fit"
        return config

    def candidate_configs(self, problem: Problem) -> list[GpuConfig]:
        # measured on H200 (docs/performance.md): forward 128x128 tiles with 8 warps and
        # 3 stages lead; the split backward with 64x64 tiles and 4 warps leads by far (the fused
        # backward's atomics cost more than the two matmuls it saves, so it is not a candidate);
        # each is shrunk to the GPU's shared memory, and duplicates dropped
        out = []
        for bq, bk, warps, stages in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            for bbq, bbk, bwarps in ((64, 64, 4), (32, 64, 4), (64, 128, 8), (64, 32, 4)):
                config = self._fit(problem, GpuConfig(block_q=bq, block_kv=bk, num_warps=warps, num_stages=stages,
                                                      bwd_block_q=bbq, bwd_block_kv=bbk, bwd_num_warps=bwarps,
                                                      interpret=self.interpret))
                if config is not None and config not in out:
                    out.append(config)
        if problem.itemsize == 4:  # each forward also before XLA's backward, the float32 default (its tiles unused)
            base = self.default_config(problem)
            bwd = {f: getattr(base, f) for f in ("bwd_block_q", "bwd_block_kv", "bwd_num_warps", "bwd_num_stages")}
            out = list(dict.fromkeys(dataclasses.replace(c, bwd_xla=True, **bwd) for c in out)) + out
        return out

    def config_note(self, problem: Problem, config: GpuConfig) -> str:
        """Which backward runs where `config` asks for the fused one (`kernels.fuses_backward`); "" where it
        does not ask."""
        if config.bwd_xla:
            blocks = blockwise.gpu_blocks(problem.batch, problem.heads)
            return f"backward by the XLA step ({blocks.block_q} x {blocks.block_kv} blocks)"
        if not config.bwd_fused:
            return ""
        return fused_backward_note("dQ added by float32 atomics", None if fuses_backward(problem.opts, config)
                                   else "deterministic=True (atomics sum dQ in no fixed order)")

    def run(self, problem: Problem, config: GpuConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        check_interpret(self.name, self.interpret, config)
        capability, limit = _shared_memory(problem)
        used = cfg.used_blocks(config, problem.opts, problem.seq)
        too_big = cfg.over_limit(used, problem.head_dim, problem.itemsize, limit, problem.v_head_dim)
        if too_big:
            raise ValueError(f"{self.name}: {config} does not fit this GPU (compute capability "
                             f"{'.'.join(map(str, capability))}): {too_big}; use smaller blocks or fewer stages, "
                             "or leave config=None")
        return ring_attention_shard(problem.opts, kernel(problem.precision), config, q, k, v, q_seg, kv_seg, sinks,
                                    extras)


IMPLEMENTATION = PallasTritonImplementation()
INTERPRET_IMPLEMENTATION = PallasTritonImplementation(name="pallas_triton_interpret", interpret=True)

__all__ = ["IMPLEMENTATION", "INTERPRET_IMPLEMENTATION", "KERNEL", "GpuConfig"]

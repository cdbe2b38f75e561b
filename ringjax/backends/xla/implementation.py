"""Pure-XLA backend: the reference ring implementation that runs on every platform."""

from __future__ import annotations

import dataclasses
import functools

from ringjax.backends.xla import CACHE_SUPPORT, SUPPORT
from ringjax.backends.xla.config import XlaCacheConfig, XlaConfig
from ringjax.backends.xla.kernels import block_bwd, block_fwd, cache_partials
from ringjax.core import precision
from ringjax.core.precision import DEFAULT
from ringjax.core.problem import Problem
from ringjax.core.ring import BlockKernel, ring_attention_shard


@functools.cache
def kernel(precision: str) -> BlockKernel:
    """The ring step whose float32 tiles multiply at `precision` (a `core.precision` name); one object per
    precision, so traces and compiled calls are shared."""
    return BlockKernel(name="xla", fwd=functools.partial(block_fwd, precision=precision),
                       bwd=functools.partial(block_bwd, precision=precision))


KERNEL = kernel(DEFAULT)


GPU_SCORES = 1 << 27  # float32 scores of one block pair on a GPU (512 MiB): 32 heads of 2048 x 2048


@dataclasses.dataclass(frozen=True)
class XlaImplementation:
    name: str = "xla"
    config_type: type = XlaConfig

    def supports(self, problem: Problem) -> str | None:
        return SUPPORT.refusal(self.name, problem)

    def default_config(self, problem: Problem) -> XlaConfig:
        if problem.platform != "gpu" or problem.itemsize != 4:
            return XlaConfig()
        # On a GPU every block pair is a few kernel launches, so larger blocks win until the scores crowd memory:
        # float32 8K causal on one H200 (jax 0.11.2, 2026-12-03) ran fwd+bwd at 38.1 TFLOP/s with 512 x 512
        # blocks, 57.0 with 1024 and 60.8 with 2048 (26.8 against 21.6 at "highest"). The side is the largest
        # power of two up to 2048 whose float32 scores of all batch rows and heads stay within GPU_SCORES.
        # (bf16 keeps 512 until measured.)
        side = 2048
        while side > XlaConfig.block_q and problem.batch * problem.heads * side * side > GPU_SCORES:
            side //= 2
        return XlaConfig(block_q=side, block_kv=side)

    def candidate_configs(self, problem: Problem) -> list[XlaConfig]:
        sizes = sorted({min(s, problem.seq) for s in (128, 256, 512, 1024, 2048)})
        return [XlaConfig(block_q=bq, block_kv=bk) for bq in sizes for bk in sizes]

    def run(self, problem: Problem, config: XlaConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        return ring_attention_shard(problem.opts, kernel(problem.precision), config, q, k, v, q_seg, kv_seg, sinks,
                                    extras)


IMPLEMENTATION = XlaImplementation()


@dataclasses.dataclass(frozen=True)
class XlaCacheImplementation:
    """`cache_attention`'s per-device partials in XLA (split-K over the slots the mask reaches)."""

    name: str = "xla"
    config_type: type = XlaCacheConfig

    def supports(self, problem: Problem) -> str | None:
        return CACHE_SUPPORT.refusal(self.name, problem)

    def default_config(self, problem: Problem) -> XlaCacheConfig:
        return XlaCacheConfig()

    def partials(self, q, k, v, q_pos, k_pos, k_len, opts, *, extras=None, config=None):
        """See `kernels.cache_partials`; float32 tiles multiply at jax's matmul precision now (trace time)."""
        return cache_partials(q, k, v, q_pos, k_pos, k_len, opts, extras=extras, config=config,
                              precision=precision.current(q.dtype))


CACHE_IMPLEMENTATION = XlaCacheImplementation()

__all__ = ["CACHE_IMPLEMENTATION", "IMPLEMENTATION", "KERNEL", "XlaCacheConfig", "XlaConfig", "block_bwd",
           "block_fwd", "cache_partials"]

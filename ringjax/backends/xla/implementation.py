"""Pure-XLA backend: the reference ring implementation that runs on every platform."""

from __future__ import annotations

import dataclasses
import functools

from ringjax.backends.xla import CACHE_SUPPORT, SUPPORT
from ringjax.backends.xla.config import XlaCacheConfig, XlaConfig, gpu_blocks
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


@dataclasses.dataclass(frozen=True)
class XlaImplementation:
    name: str = "xla"
    config_type: type = XlaConfig

    def supports(self, problem: Problem) -> str | None:
        return SUPPORT.refusal(self.name, problem)

    def default_config(self, problem: Problem) -> XlaConfig:
        if problem.platform != "gpu":
            return XlaConfig()
        return gpu_blocks(problem.batch, problem.heads)

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

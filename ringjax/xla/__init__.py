"""Pure-XLA backend: the reference ring implementation that runs on every platform."""

from __future__ import annotations

import dataclasses

from ringjax.registry import Problem, unknown_options
from ringjax.ring import BlockKernel, ring_attention_shard
from ringjax.xla.block import XlaConfig, block_bwd, block_fwd

KERNEL = BlockKernel(name="xla", fwd=block_fwd, bwd=block_bwd)
# every AttentionOptions field; one added later is refused until the XLA step implements it
KNOWN_OPTIONS = frozenset({"causal", "window", "softmax_scale", "logits_soft_cap", "layout", "axis_name", "axis_size",
                           "has_segments", "has_sinks", "chunk_size", "has_alibi", "dropout_rate", "num_sink_tokens",
                           "gather_kv", "subshards"})


@dataclasses.dataclass(frozen=True)
class XlaImplementation:
    name: str = "xla"
    config_type: type = XlaConfig

    def supports(self, problem: Problem) -> str | None:
        unknown = unknown_options(problem.opts, KNOWN_OPTIONS)
        if unknown:
            return f"{', '.join(unknown)} not implemented in the XLA ring step"
        return None  # every float dtype and shape

    def default_config(self, problem: Problem) -> XlaConfig:
        return XlaConfig()

    def candidate_configs(self, problem: Problem) -> list[XlaConfig]:
        sizes = sorted({min(s, problem.seq) for s in (128, 256, 512, 1024)})
        return [XlaConfig(block_q=bq, block_kv=bk) for bq in sizes for bk in sizes]

    def run(self, problem: Problem, config: XlaConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        return ring_attention_shard(problem.opts, KERNEL, config, q, k, v, q_seg, kv_seg, sinks, extras)


IMPLEMENTATION = XlaImplementation()

__all__ = ["IMPLEMENTATION", "KERNEL", "XlaConfig", "block_bwd", "block_fwd"]

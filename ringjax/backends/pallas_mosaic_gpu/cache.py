"""`cache_attention`'s per-device partials on Hopper: the split-K decode kernel (`decode.py`) for up to 128
query rows per KV head, the ring's forward kernel (`prefill.py`) for longer chunks."""

from __future__ import annotations

import dataclasses

from ringjax.backends.pallas_mosaic_gpu import decode, prefill
from ringjax.backends.pallas_mosaic_gpu.config import DecodeConfig, MosaicGpuConfig
from ringjax.core.problem import Problem


def _prefills(t: int, heads: int, kv_heads: int) -> bool:
    """Whether t new tokens per row are more query rows per KV head than one decode CTA holds."""
    return t * (heads // max(kv_heads, 1)) > decode.MAX_ROWS


def _cache_shapes(problem: Problem):
    """q, k, v shapes of one device's `cache_attention` partials: q_seq new tokens against seq cache slots."""
    b, h, kvh = problem.batch, problem.heads, problem.kv_heads
    d, dv = problem.head_dims
    return (b, problem.q_seq or 1, h, d), (b, problem.seq, kvh, d), (b, problem.seq, kvh, dv)


@dataclasses.dataclass(frozen=True)
class MosaicGpuCacheImplementation:
    """Decode (`DecodeConfig`) or prefill (`MosaicGpuConfig`), chosen by the query rows per KV head."""

    name: str = "pallas_mosaic_gpu"
    config_type: tuple = (DecodeConfig, MosaicGpuConfig)

    def supports(self, problem: Problem) -> str | None:
        if _prefills(problem.q_seq or 1, problem.heads, problem.kv_heads):
            return prefill.refusal(problem)
        return decode.supports(*_cache_shapes(problem), problem.dtype, problem.opts)

    def default_config(self, problem: Problem) -> DecodeConfig | MosaicGpuConfig:
        from ringjax.backends.pallas_mosaic_gpu import implementation

        if _prefills(problem.q_seq or 1, problem.heads, problem.kv_heads):
            return implementation.default_config(problem)
        return decode.default_config(*_cache_shapes(problem), problem.dtype)

    def partials(self, q, k, v, q_pos, k_pos, k_len, opts, *, extras=None, config=None):
        """`prefill.partials` or `decode.partials` (which takes no `extras`: supports() refused ALiBi)."""
        _, t, h, _ = q.shape
        if not _prefills(t, h, k.shape[2]):
            return decode.partials(q, k, v, q_pos, k_pos, k_len, opts, config)
        if config is not None and not isinstance(config, MosaicGpuConfig):
            raise TypeError(f"config: {t} new tokens x {h // k.shape[2]} heads per KV head = {t * (h // k.shape[2])} "
                            f"rows, more than a decode CTA's {decode.MAX_ROWS}, run the forward kernel: pass a "
                            f"MosaicGpuConfig, got {type(config).__name__}")
        return prefill.partials(q, k, v, q_pos, k_pos, k_len, opts, extras, config)


CACHE_IMPLEMENTATION = MosaicGpuCacheImplementation()

__all__ = ["CACHE_IMPLEMENTATION", "MosaicGpuCacheImplementation"]

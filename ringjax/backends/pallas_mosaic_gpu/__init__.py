"""Pallas Mosaic GPU backend: warp-specialised TMA + wgmma ring steps for Hopper (sm90+).

Registered above "pallas_triton", so "auto" prefers it on Hopper for every call it supports.
"""

from ringjax.backends.pallas_mosaic_gpu.config import HEAD_DIMS, ROWS, MosaicGpuConfig
from ringjax.core.features import Support
from ringjax.dispatch.registry import register

SUPPORT = Support(
    features=frozenset({"causal", "sliding_window", "segment_ids", "logits_soft_cap", "sinks", "chunk_size",
                        "chunk_size_segments", "alibi_slopes", "dropout", "num_sink_tokens",
                        "num_sink_tokens_segments", "invariant", "all_gather", "ulysses"}),
    dtypes=("bfloat16", "float16"),
    head_dims=lambda d: d in HEAD_DIMS,
    head_dims_text=", ".join(map(str, HEAD_DIMS[:-1])) + f" or {HEAD_DIMS[-1]}",
    min_seq_multiple=ROWS,
)

register("ring_attention", "pallas_mosaic_gpu", platforms=("gpu",), priority=15, support=SUPPORT,
         target=f"{__name__}.implementation:IMPLEMENTATION")

# cache_attention: the split-K decode kernel (decode.py) for a few new tokens against a cache part, the
# forward kernel (prefill.py) for long chunks; neither imports kernel code until it runs
register("cache_attention", "pallas_mosaic_gpu", platforms=("gpu",), priority=15,
         target=f"{__name__}.cache:CACHE_IMPLEMENTATION")

__all__ = ["SUPPORT", "MosaicGpuConfig"]

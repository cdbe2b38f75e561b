"""Pallas TPU backend: flash-attention block kernels in the ppermute ring, or fused ring
kernels that move K/V by remote DMA (`TpuConfig(fused=True)`).

Registered as "pallas_tpu" and "pallas_tpu_interpret" (the same kernels in the Pallas TPU
interpreter on CPU, for tests; never chosen by "auto").
"""

from ringjax.backends.pallas_tpu.config import TpuConfig
from ringjax.core.features import Support
from ringjax.dispatch.registry import register

SUPPORT = Support(
    features=frozenset({"causal", "sliding_window", "segment_ids", "logits_soft_cap", "sinks", "chunk_size",
                        "chunk_size_segments", "alibi_slopes", "dropout", "num_sink_tokens",
                        "num_sink_tokens_segments", "invariant", "all_gather", "ulysses"}),
    dtypes=("float32", "bfloat16"),
    head_dims=lambda d: d % 128 == 0 or d in (8, 16, 32, 64),
    head_dims_text="a multiple of 128, or 8 to 64",
    float32_text="full float32, whatever jax's setting",
)

register("ring_attention", "pallas_tpu", platforms=("tpu",), priority=20, support=SUPPORT,
         target=f"{__name__}.implementation:IMPLEMENTATION")
register("ring_attention", "pallas_tpu_interpret", platforms=("cpu",), priority=-20, support=SUPPORT,
         target=f"{__name__}.implementation:INTERPRET_IMPLEMENTATION", auto=False)

__all__ = ["SUPPORT", "TpuConfig"]

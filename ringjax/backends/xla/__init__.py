"""Pure-XLA backend: the reference ring step, every feature, every platform."""

from ringjax.backends.xla.config import XlaCacheConfig, XlaConfig
from ringjax.core.features import BY_NAME, Support
from ringjax.dispatch.registry import register

SUPPORT = Support(features=frozenset(BY_NAME), dtypes=("float32", "bfloat16", "float16", "float64"),
                  float32_text="jax's matmul precision: TF32 on GPUs by default, full float32 under `highest`")

register("ring_attention", "xla", platforms=("cpu", "gpu", "tpu"), priority=0, support=SUPPORT,
         target=f"{__name__}.implementation:IMPLEMENTATION")

# cache_attention: the mask and logit features that mean something for a query against a cache
CACHE_SUPPORT = Support(features=frozenset({"causal", "sliding_window", "logits_soft_cap", "sinks", "chunk_size",
                                            "alibi_slopes", "num_sink_tokens"}),
                        dtypes=SUPPORT.dtypes, float32_text=SUPPORT.float32_text)

register("cache_attention", "xla", platforms=("cpu", "gpu", "tpu"), priority=0, support=CACHE_SUPPORT,
         target=f"{__name__}.implementation:CACHE_IMPLEMENTATION")

__all__ = ["CACHE_SUPPORT", "SUPPORT", "XlaCacheConfig", "XlaConfig"]

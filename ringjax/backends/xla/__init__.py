"""Pure-XLA backend: the reference ring step, every feature, every platform."""

from ringjax.backends.xla.config import XlaConfig
from ringjax.core.features import BY_NAME, Support
from ringjax.dispatch.registry import register

SUPPORT = Support(features=frozenset(BY_NAME), dtypes=("float32", "bfloat16", "float16", "float64"),
                  float32_text="jax's matmul precision: TF32 on GPUs by default, full float32 under `highest`")

register("ring_attention", "xla", platforms=("cpu", "gpu", "tpu"), priority=0, support=SUPPORT,
         target=f"{__name__}.implementation:IMPLEMENTATION")

__all__ = ["SUPPORT", "XlaConfig"]

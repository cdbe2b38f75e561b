"""Pallas GPU backend lowered through Triton: ring steps for any NVIDIA GPU of sm80 or newer.

Registered as "pallas_triton" and "pallas_triton_interpret" (the same kernels in the Pallas
interpreter, for tests; never chosen by "auto"); "pallas_gpu" is its deprecated former name.
"""

from ringjax.backends.pallas_triton.config import MIN_BLOCK, GpuConfig
from ringjax.core import precision
from ringjax.core.features import Support
from ringjax.dispatch.registry import register, register_alias

SUPPORT = Support(
    features=frozenset({"causal", "sliding_window", "segment_ids", "logits_soft_cap", "sinks", "chunk_size",
                        "chunk_size_segments", "invariant", "all_gather", "ulysses"}),
    dtypes=("bfloat16", "float16", "float32"),
    head_dims=lambda d: MIN_BLOCK <= d <= 256 and d & (d - 1) == 0,
    head_dims_text="a power of two, 16 to 256",
    min_seq_multiple=MIN_BLOCK,
    # Triton lowers full-float32 dots to scalar FMAs: measured 0.8 TFLOP/s on an H100 where XLA ran 18
    float32_precisions=precision.TF32,
    float32_text="TF32 only (`highest` refused: its full-float32 dots are far slower than XLA's)",
)
TritonConfig = GpuConfig

register("ring_attention", "pallas_triton", platforms=("gpu",), priority=10, support=SUPPORT,
         target=f"{__name__}.implementation:IMPLEMENTATION")
register("ring_attention", "pallas_triton_interpret", platforms=("cpu", "gpu"), priority=-10, support=SUPPORT,
         target=f"{__name__}.implementation:INTERPRET_IMPLEMENTATION", auto=False)
register_alias("ring_attention", "pallas_gpu", "pallas_triton")
register_alias("ring_attention", "pallas_gpu_interpret", "pallas_triton_interpret")

__all__ = ["SUPPORT", "GpuConfig", "TritonConfig"]

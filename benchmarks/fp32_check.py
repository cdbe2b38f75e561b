import jax.numpy as jnp
import numpy as np

import ringjax

x = np.random.default_rng(0).standard_normal((1, 2048, 8, 128)).astype(np.float32)
for impl in ("auto", "pallas_gpu", "pallas_mosaic_gpu"):
    try:
        out = ringjax.ring_attention(x, x[:, :, :2], x[:, :, :2], axis_name=None, causal=True, implementation=impl)
        print("FP32", impl, "ok", float(jnp.abs(out).mean()))
    except ValueError as e:
        print("FP32", impl, "refused:", str(e).splitlines()[0][:200])
    except Exception as e:
        print("FP32", impl, "CRASH", type(e).__name__, str(e)[:200])

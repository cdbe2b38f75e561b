"""Inference: a KV cache sharded over a mesh axis (`KVCache`) and attention to it (`cache_attention`).

`cache.py` holds the cache and its striped layout, `attention.py` the op, `spread.py` how its work
is spread over the axis (pass queries or pass the cache stripes) and the rule that picks one.
"""

from ringjax.inference.attention import cache_attention
from ringjax.inference.cache import KVCache

__all__ = ["KVCache", "cache_attention"]

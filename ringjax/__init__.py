"""ringjax: exact ring attention for JAX over a sequence sharded on a named mesh axis."""

from ringjax._version import __version__ as __version__
from ringjax.api import ring_attention
from ringjax.dilated import dilated_attention
from ringjax.dispatch.autotuning import TuneSettings, autotune
from ringjax.dispatch.registry import config_from_json, config_to_json, list_implementations
from ringjax.inference import KVCache, cache_attention
from ringjax.layouts import from_layout, to_layout
from ringjax.merge import merge_attention, merge_attention_many
from ringjax.options import AttentionOptions
from ringjax.packed import ring_attention_kvpacked, ring_attention_qkvpacked, ring_attention_varlen

__all__ = [
    "AttentionOptions",
    "KVCache",
    "TuneSettings",
    "autotune",
    "cache_attention",
    "config_from_json",
    "config_to_json",
    "dilated_attention",
    "from_layout",
    "list_implementations",
    "merge_attention",
    "merge_attention_many",
    "ring_attention",
    "ring_attention_kvpacked",
    "ring_attention_qkvpacked",
    "ring_attention_varlen",
    "to_layout",
]

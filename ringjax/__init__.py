"""ringjax: exact ring attention for JAX over a sequence sharded on a named mesh axis."""

from ringjax.api import ring_attention
from ringjax.autotuning import TuneSettings, autotune
from ringjax.layouts import from_layout, to_layout
from ringjax.merge import merge_attention, merge_attention_many
from ringjax.options import AttentionOptions
from ringjax.registry import config_from_json, config_to_json, list_implementations

__version__ = "0.1.0"

__all__ = [
    "AttentionOptions",
    "TuneSettings",
    "autotune",
    "config_from_json",
    "config_to_json",
    "from_layout",
    "list_implementations",
    "merge_attention",
    "merge_attention_many",
    "ring_attention",
    "to_layout",
]

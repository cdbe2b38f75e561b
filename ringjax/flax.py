"""Flax attention layers (NNX and Linen); they live in `ringjax.layers.flax`."""

from ringjax.layers.flax import *  # noqa: F403
from ringjax.layers.flax import __all__ as __all__

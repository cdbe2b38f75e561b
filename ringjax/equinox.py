"""Equinox attention layer; it lives in `ringjax.layers.equinox`."""

from ringjax.layers.equinox import *  # noqa: F403
from ringjax.layers.equinox import __all__ as __all__

"""Model layers (Flax NNX / Linen in `ringjax.flax`, Equinox in `ringjax.equinox`) on one
framework-free core, and rotary embeddings at global positions."""

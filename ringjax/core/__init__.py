"""The shared kernel core every backend builds on: mask rules, score modifiers, tiling and
visit ranges, the ring schedule and its `custom_vjp`, and the feature table."""

"""Pallas backends: one subpackage per platform (tpu, gpu), imported only when selected."""

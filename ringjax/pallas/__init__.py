"""Pallas backends; each subpackage is one platform and is imported only when selected."""

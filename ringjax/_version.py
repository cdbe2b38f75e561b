"""The package version, in a module of its own so that the cache can read it without importing ringjax."""

__version__ = "0.1.0"

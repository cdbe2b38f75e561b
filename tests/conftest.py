"""Simulate 8 CPU devices before jax initialises its backends."""

import os

import pytest

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture(autouse=True, scope="session")
def _isolated_config_cache(tmp_path_factory):
    """No test reads or writes the user's real config cache, or tunes because of the caller's environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGJAX_CACHE_DIR", str(tmp_path_factory.mktemp("ringjax-cache")))
        mp.delenv("RINGJAX_AUTOTUNE", raising=False)
        yield

"""Simulate 8 CPU devices, and compile for speed on a CPU-only jax, before jax initialises its backends."""

import importlib.util
import os

import pytest

# XLA's CPU compiler without LLVM's optimisation passes: the suite compiles thousands of tiny programs and runs
# each once or twice, so compiling weighs. Measured 2026-11-28 on 2 cores, jax 0.12.0.1, beside another test
# run: 16 feature tests took 142 s instead of 172 s. Only where no GPU or TPU plugin is installed: the flags
# would reach their compilers too.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")

flags = os.environ.get("XLA_FLAGS", "").split()
if not any("xla_force_host_platform_device_count" in f for f in flags):
    flags.append("--xla_force_host_platform_device_count=8")
if not any(importlib.util.find_spec(m) for m in ACCELERATOR_PLUGINS):
    flags += [f for f in FAST_COMPILE if f.split("=")[0] not in " ".join(flags)]
os.environ["XLA_FLAGS"] = " ".join(flags)


@pytest.fixture(autouse=True, scope="session")
def _isolated_config_cache(tmp_path_factory):
    """No test reads or writes the user's real config cache, or tunes because of the caller's environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGJAX_CACHE_DIR", str(tmp_path_factory.mktemp("ringjax-cache")))
        mp.delenv("RINGJAX_AUTOTUNE", raising=False)
        yield


_MAPS = "/proc/self/maps"
_MAX_MAPS = 20000  # a third of Linux's default vm.max_map_count (65530)


def _mappings() -> int:
    try:
        with open(_MAPS) as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no count to read
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code_per_module():
    """Drop jax's compiled executables after each test module. Each keeps memory mappings of its machine code;
    a whole run's (over a thousand tests on 8 simulated devices) reached the kernel's limit on mappings
    (vm.max_map_count, 65530 by default) and the XLA CPU compiler crashed late in the run (jax 0.12, 2026-11-26:
    SIGABRT and SIGSEGV in backend_compile, in different tests)."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(autouse=True)
def _release_compiled_code_when_many():
    """Also within a module, after any test that leaves more than `_MAX_MAPS` mappings: one module alone
    reached 19000 (jax 0.12, 2026-11-26)."""
    yield
    if _mappings() > _MAX_MAPS:
        import jax

        jax.clear_caches()


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests that pytest-xdist's --dist loadgroup keeps in "
                                       "one worker (they share an expensive module fixture)")
    config.addinivalue_line("markers", "matmul_precision(name): jax's matmul precision a test runs under on GPUs "
                                       "(default: highest; None: jax's own setting, untouched)")


@pytest.fixture(autouse=True)
def _float32_matmuls(request):
    """On GPUs a test runs at full float32 ("highest") unless marked: float32 results are checked against
    float64 references at 1e-5, which TF32 (jax's default there) does not meet. CPUs multiply float32 exactly."""
    import jax

    marker = request.node.get_closest_marker("matmul_precision")
    name = marker.args[0] if marker else "highest"
    if jax.default_backend() != "gpu" or name is None:
        yield
        return
    with jax.default_matmul_precision(name):
        yield

"""Fakes 8 CPU devices before JAX is imported, so every mesh test runs on a laptop, and
compiles without LLVM's backend optimisations (faster compiles, below).

One persistent XLA compilation cache per test process (each pytest-xdist worker, shared with
the subprocesses its tests start): many tests compile the same small step again (a resumed
run, a restarted process), and a cache hit skips XLA's compile. Results are unchanged: the
cache key is the whole HLO module, the compile options and the devices.
"""

import atexit
import os
import shutil
import tempfile

_EIGHT = "--xla_force_host_platform_device_count=8"
# LLVM's backend optimisation off: most tests compile a small step and run it a few times, and
# XLA:CPU's LLVM passes were most of the compile (an equivalence-matrix case 28 -> 16 CPU
# seconds; the precision loss-curve test 55 -> 35). HLO passes, buffer assignment (the memory
# tests' figures) and the dot kernels are unchanged; both sides of every comparison compile
# alike. Processes a test starts inherit it unless the test clears XLA_FLAGS.
_FAST = "--xla_backend_optimization_level=0"
for _flag in (_EIGHT, _FAST):
    if _flag not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit them
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_NAME = "maxmoe-tests-xla-cache-"
_PREFIX = os.path.join(tempfile.gettempdir(), _NAME)
# each pytest-xdist worker its own (inherited from the controller otherwise): JAX writes cache
# entries in place, so a worker could read another's half-written entry
if os.environ.get("JAX_COMPILATION_CACHE_DIR", _PREFIX).startswith(_PREFIX):
    _cache = tempfile.mkdtemp(prefix=_NAME)
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache


def pytest_sessionfinish(session):
    """Free this process's compiled programs while the session still runs. Otherwise Python's
    exit-time garbage collection did it (JAX's gc callback, seconds for a worker that compiled
    hundreds of steps) after a pytest-xdist worker had reported itself finished, and xdist
    interrupted it with SIGINT after 5 s, printing a KeyboardInterrupt warning."""
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()

"""Fakes 8 CPU devices before JAX is imported, so every mesh test runs on a laptop.

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
if _EIGHT not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit it
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _EIGHT).strip()
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

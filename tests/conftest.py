"""Fakes 8 CPU devices before JAX is imported, so every mesh test runs on a laptop.

One persistent XLA compilation cache for the session (and the subprocesses it starts): many
tests compile the same small step again (a resumed run, a restarted process), and a cache hit
skips XLA's compile. Results are unchanged: the cache key is the whole HLO module, the
compile options and the devices.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="maxmoe-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache

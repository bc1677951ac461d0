"""Which C allocator a `maxmoe` process runs on (standard library only: imported before JAX).

XLA:CPU allocates each step's temporaries afresh (the temporaries in `maxmoe bench`'s memory
line), and glibc's malloc gives blocks that large back to the kernel when they are freed, so
every step page-faults its temporaries in again and the kernel zeroes them. tcmalloc that never
releases memory, or jemalloc that never purges it, keeps what a step freed for the next one, so
steps run faster (docs/performance/planning.md, Allocator; `tools/bench_malloc.py`). The price:
memory
a process frees stays with it for reuse, so its resident size stays at its high-water mark.

`reexec` restarts the process once (same pid) with the first allocator installed, in this
order: tcmalloc, jemalloc (LD_PRELOAD is read by the loader at process start, hence the exec),
else glibc's malloc asking for transparent huge pages where the kernel gives them only on
request. MAXMOE_MALLOC chooses: auto (that order), tcmalloc, jemalloc, glibc, off (no restart).

`auto` restarts only where the gain was measured: a process whose JAX runs on XLA:CPU, i.e.
JAX_PLATFORMS is exactly "cpu", or JAX_PLATFORMS is unset and no accelerator device node is
visible (ACCELERATOR_NODES: NVIDIA's /dev/nvidiaN, AMD ROCm's /dev/kfd, TPU VMs' /dev/accelN).
A file test, because this runs before JAX is imported (and must stay cheap); a container
without the device nodes cannot use the GPU, so it counts as a CPU host. On a GPU host the step's
buffers live in device memory, which these allocators do not manage; nothing was measured there,
so `auto` leaves the process alone. An explicit MAXMOE_MALLOC choice applies everywhere.
"""

from __future__ import annotations

import glob
import os
import platform
import sys

ENV = "MAXMOE_MALLOC"
CHOICES = ("auto", "tcmalloc", "jemalloc", "glibc", "off")
# library file, Debian/Ubuntu package, settings (each only where the user has not set it)
PRELOADS = {
    "tcmalloc": (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "libtcmalloc-minimal4", {
        "TCMALLOC_RELEASE_RATE": "0",
        # gperftools prints a line per allocation above 1 GiB (checkpoints, HF conversion)
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}),
    "jemalloc": (("libjemalloc.so.2",), "libjemalloc2", {
        "MALLOC_CONF": "thp:always,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"}),
}
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")  # a user's own LD_PRELOAD of these is kept
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*")  # globs


class MallocError(Exception):
    """MAXMOE_MALLOC names an unknown value or an allocator that is not installed."""


def library_dirs() -> list[str]:
    arch = f"{platform.machine()}-linux-gnu"
    return [f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/lib64", "/usr/lib", "/usr/local/lib",
            os.path.join(sys.prefix, "lib")]


def find(name: str) -> str | None:
    """Path of allocator `name`'s shared library, or None."""
    for directory in library_dirs():
        for filename in PRELOADS[name][0]:
            path = os.path.join(directory, filename)
            if os.path.exists(path):
                return path
    return None


def _preloaded(environ) -> bool:
    return any(name in environ.get("LD_PRELOAD", "") for name in PRELOADED)


def _madvise_thp() -> bool:
    try:
        with open(THP_MODE) as f:
            return "[madvise]" in f.read()  # [always]: on already; [never]: not available
    except OSError:
        return False


def runs_on_cpu(environ) -> bool:
    """Whether JAX will run on XLA:CPU (module docstring): JAX_PLATFORMS is exactly cpu, or it
    is unset and no ACCELERATOR_NODES path exists."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    return not any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def restart_env(environ) -> dict[str, str] | None:
    """The environment to restart with, or None to run on as is."""
    choice = environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise MallocError(f"{ENV}={choice!r} is not one of {', '.join(CHOICES)}; "
                          f"unset it to pick the fastest allocator installed")
    if sys.platform != "linux" or choice == "off" or _preloaded(environ):
        return None
    if choice == "auto" and not runs_on_cpu(environ):
        return None  # measured on XLA:CPU only
    names = {"auto": ("tcmalloc", "jemalloc"), "glibc": ()}.get(choice, (choice,))
    for name in names:
        path = find(name)
        if path is None:
            if choice == "auto":
                continue
            files, package, _ = PRELOADS[name]
            raise MallocError(f"{ENV}={name} but {' / '.join(files)} is in none of "
                              f"{', '.join(library_dirs())}: install it (Debian/Ubuntu: apt "
                              f"install {package}) or unset {ENV}")
        env = {**PRELOADS[name][2], **environ}
        env["LD_PRELOAD"] = ":".join(p for p in (environ.get("LD_PRELOAD", ""), path) if p)
        return env
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not _madvise_thp():
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES_TUNABLE}".lstrip(":")}


def reexec(args: list[str]) -> None:
    """Restart as `python ARGS` with the allocator `restart_env` picks (no return), or return.
    A bad MAXMOE_MALLOC prints one line and exits with code 2."""
    try:
        env = restart_env(os.environ)
    except MallocError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if env is not None:
        os.execve(sys.executable, [sys.executable, *args], env)


def in_use() -> str:
    """The allocator this process runs on, read from its mapped libraries."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "system"
    for name in PRELOADED:
        if f"lib{name}" in maps:
            return name
    huge = HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "")
    return "glibc (huge pages)" if huge else "glibc"

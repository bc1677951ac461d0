"""The host side of the training loop, per logging window: how long the host waited
for data and for the device, whether the device ever sat idle for want of a step, and how much
CPU the host's own threads and data workers used."""

from __future__ import annotations

import os
import threading
import time

import jax


class HostTiming:
    """Where the loop's wall time goes, measured without a device sync per step.

    Per logging window, per step: `data_wait` is the time blocked in next(data_iter) (the
    prefetch buffer was empty), `device_wait` the time blocked on a step's results. The
    device is idle only while no step is queued; just before each dispatch the loop asks,
    without blocking, whether the previous step has finished, and if so counts the time since
    the device was last seen busy (a probe that found a step unfinished, or the end of a
    wait that blocked) as idle. That is an upper bound, exact to one probe interval, and
    `host_overhead_fraction` = idle / wall (0 while the host keeps a step queued).

    On a CPU backend the host's threads also slow the step itself by sharing its cores:
    `host_cpu_s` is the CPU time per step of the host side (see host_cpu_ns) and
    `host_cpu_fraction` its share of the window's core time (wall x usable cores), the most
    it can take from the step there (comparing the loop's step time with `maxmoe bench` in
    another process cannot resolve it on a shared host).
    """

    def __init__(self):
        self._latest = None  # an output of the newest dispatched step
        self._busy_at = 0.0  # the last moment the device was known to have work
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self.reset()

    def reset(self) -> None:
        self.data_wait = self.device_wait = self.idle = 0.0
        self._cpu = host_cpu_ns()

    def probe(self) -> None:
        """Non-blocking: notes that the device is busy if the newest step is unfinished."""
        if self._latest is not None and not self._latest.is_ready():
            self._busy_at = time.perf_counter()

    def next_batch(self, data_iter):
        t = time.perf_counter()
        local = next(data_iter)
        self.data_wait += time.perf_counter() - t
        self.probe()
        return local

    def dispatching(self) -> None:
        if self._latest is not None and self._latest.is_ready():
            self.idle += time.perf_counter() - self._busy_at

    def dispatched(self, metrics: dict) -> None:
        self._latest, self._busy_at = metrics["loss"], time.perf_counter()

    def fetch(self, metrics: dict) -> dict:
        """The step's metrics on the host (blocks until the step has run)."""
        t = time.perf_counter()
        waited = not metrics["loss"].is_ready()
        host = jax.device_get(metrics)
        now = time.perf_counter()
        self.device_wait += now - t
        if waited:  # the device was busy until now (and the newest step is queued, or it)
            self._busy_at = now
        self.probe()
        return host

    def busy_now(self) -> None:
        """The device just finished work of the loop's own (evaluation)."""
        self._busy_at = time.perf_counter()

    def window(self, steps: int, wall: float) -> dict:
        """Per-step costs of the window that just ended, then starts a new one."""
        n = max(steps, 1)
        record = {"data_wait_s": self.data_wait / n,
                  "host_time_s": max(wall - self.device_wait, 0.0) / n,
                  "host_overhead_fraction": min(self.idle / wall, 1.0) if wall > 0 else 0.0}
        now = host_cpu_ns()
        if now is not None and self._cpu is not None:
            # threads or workers that ended during the window are gone from `now`: their time
            # since the window began is not counted (an undercount by at most that)
            cpu = sum(max(v - self._cpu.get(k, 0), 0) for k, v in now.items()) / 1e9
            record.update(host_cpu_s=cpu / n, host_cpu_fraction=min(
                cpu / (wall * self._cores), 1.0) if wall > 0 else 0.0)
        self.reset()
        return record


def _task_ns(task: str) -> int:
    """CPU time (ns) a thread has run, from /proc/.../task/TID/schedstat (its first field)."""
    with open(f"{task}/schedstat") as f:
        return int(f.read().split()[0])


def host_cpu_ns() -> dict | None:
    """CPU time (ns) used so far by the host side of this process, keyed by thread or worker:
    its Python threads (the loop, the data pipeline's readers and prefetch thread, checkpoint
    writers) and its child processes (data workers, every thread of them). XLA's own threads
    are not Python threads and are left out. None where Linux's /proc schedstat is missing."""
    if not os.path.exists("/proc/self/schedstat"):
        return None
    # the calling thread from its own clock: schedstat is brought up to date only when a
    # thread is switched out or at a scheduler tick, and the caller is running (a window of one
    # short step read 0 ns); every other thread's count is off by at most one tick
    me = threading.get_native_id()
    out = {("thread", me): time.thread_time_ns()}
    for thread in threading.enumerate():
        if thread.native_id == me:
            continue
        try:
            out[("thread", thread.native_id)] = _task_ns(f"/proc/self/task/{thread.native_id}")
        except (OSError, TypeError):
            continue  # it ended just now (or has not started: native_id None)
    children = set()
    for task in os.listdir("/proc/self/task"):
        try:  # absent on kernels built without CONFIG_PROC_CHILDREN: workers not counted
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
        except OSError:
            continue
    for pid in children:
        try:
            out[("process", pid)] = sum(_task_ns(f"/proc/{pid}/task/{t}")
                                        for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue  # it exited just now
    return out

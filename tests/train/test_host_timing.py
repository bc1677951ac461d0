"""The loop's host-side CPU accounting (metrics.host: HostTiming, host_cpu_ns): Python threads and
child processes count, XLA's own threads do not."""

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from maxmoe.metrics.host import HostTiming, host_cpu_ns

pytestmark = pytest.mark.skipif(host_cpu_ns() is None, reason="needs Linux /proc schedstat")


def _spin(seconds: float, out: list, release: threading.Event) -> None:
    """Burns `seconds` of this thread's CPU time, appends what it used, then stays alive (a
    thread that has ended is no longer counted) until `release`."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    out.append(time.thread_time() - start)
    release.wait()


def test_python_threads_count_and_xla_threads_do_not():
    f = jax.jit(lambda a: a @ a)
    x = jnp.ones((1024, 1024), jnp.float32)
    f(x).block_until_ready()
    timing = HostTiming()
    main0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
    timing.reset()
    used, release = [], threading.Event()
    spinner = threading.Thread(target=_spin, args=(0.3, used, release))
    spinner.start()
    while not used:  # XLA's threads multiply meanwhile
        f(x).block_until_ready()
    wall = time.perf_counter() - wall0  # one reading for the record and the check below
    record = timing.window(steps=2, wall=wall)
    release.set()
    spinner.join()
    main = time.thread_time() - main0
    xla = time.process_time() - process0 - main - used[0]
    host = 2 * record["host_cpu_s"]  # per step over 2 steps
    # the spinner's 0.3 s and the main thread's dispatching, within 50 ms (other Python
    # threads of the test runner, idle here); XLA's matmul threads ran far more than that
    assert abs(host - used[0] - main) < 0.05, (host, used[0], main)
    assert xla > 0.2, xla
    cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    assert record["host_cpu_fraction"] == pytest.approx(
        min(host / (wall * cores), 1.0), rel=0.1)


def test_child_processes_count():
    """Data workers (grain's mp_prefetch) are child processes: their CPU is host CPU too."""
    timing = HostTiming()
    child = subprocess.Popen([sys.executable, "-c", (
        "import time, sys\n"
        "s = time.process_time()\n"
        "while time.process_time() - s < 0.4: pass\n"
        "print('done', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        record = timing.window(steps=1, wall=1.0)
    finally:
        child.kill()
        child.wait()
    # its 0.4 s spin plus its interpreter start-up, none of which is this thread's
    assert 0.4 <= record["host_cpu_s"] < 2.0, record


def test_short_windows_count_the_calling_thread():
    """The loop's own thread is read from its clock: its /proc schedstat moves only at a
    scheduler tick or switch, so windows of one short step read 0 from it (9 in 10 here)."""
    def work():  # a fixed amount of CPU work, whatever else runs on the machine
        return sum(range(60_000))

    costs = []
    for _ in range(5):
        start = time.thread_time()
        work()
        costs.append(time.thread_time() - start)
    least = min(costs)  # the work never takes less CPU than its fastest run
    timing = HostTiming()
    for _ in range(20):
        work()  # no clock read in between, which would bring schedstat up to date
        record = timing.window(steps=1, wall=0.01)
        assert record["host_cpu_s"] >= 0.5 * least, (record, least)

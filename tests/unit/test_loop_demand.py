"""The journal's busy test counts the time the loop thread waited for a core
(``journal.loop_demand``): a saturated loop on a machine whose cores other processes take
must still be busy, or the group commit stops batching when it matters most."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sessionrouter.server.journal import loop_demand
from sessionrouter.server.journal.loop_demand import DemandClock

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not DemandClock().counts_waiting,
    reason="needs Linux's per-thread scheduler statistics",
)


HOG = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
"""A process that spins for up to 30 s (killed as soon as the test has measured)."""


HOG = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
"""A process that spins for up to 30 s (killed as soon as the test has measured)."""


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_demand_counts_the_wait_for_a_shared_core() -> None:
    """Spinning on a core a second process spins on too: the thread's CPU clock sees about
    half the wall time, the demand clock about all of it."""
    before_affinity = os.sched_getaffinity(0)
    core = min(before_affinity)
    os.sched_setaffinity(0, {core})
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG],
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    clock = DemandClock()
    try:
        spin(0.3)  # the hog is up and sharing the core
        wall, cpu, demand = time.perf_counter(), time.thread_time(), clock()
        spin(1.0)
        wall = time.perf_counter() - wall
        cpu = time.thread_time() - cpu
        demand = clock() - demand
    finally:
        hog.kill()
        hog.wait()
        clock.close()
        os.sched_setaffinity(0, before_affinity)
    assert cpu < 0.75 * wall, f"the core was not shared: {cpu:.2f} s CPU in {wall:.2f} s"
    assert demand > 0.9 * wall, f"{demand:.2f} s of demand in {wall:.2f} s"


def test_without_the_statistics_it_is_the_cpu_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_demand, "SCHEDSTAT", "/proc/thread-self/no-such-file")
    clock = DemandClock()
    assert not clock.counts_waiting
    cpu, demand = time.thread_time(), clock()
    spin(0.05)
    assert clock() - demand == pytest.approx(time.thread_time() - cpu, abs=0.005)
    clock.close()


def test_closed_clock_lets_its_file_go() -> None:
    clock = DemandClock()
    fds = len(os.listdir("/proc/self/fd"))
    clock.close()
    clock.close()
    assert len(os.listdir("/proc/self/fd")) == fds - 1

"""How much of the time the event loop's thread wanted a core, for the journal's busy test.

The group commit waits for more callers only while the loop thread is busy: then the loop
is what limits throughput, and fewer, larger batches leave it more time for the calls. The
thread's CPU clock alone says "busy" only when the thread gets a core: on a machine where
other processes take the cores (the trainer beside the router, a load generator, other
tenants), a saturated loop runs only part of the time, its CPU share falls under the
threshold, the journal stops batching, every call pays a batch of its own (about 1.5x the
CPU per StartSession here), and the loop gets more saturated still. Measured on 2 cores
with another process busy: StartSession with the journal at 0.42 to 0.66 of in-memory in
the runs that fell into that state, against 0.93 to 0.96 in those that did not.

So the demand clock counts the time the thread waited, runnable, for a core too: Linux keeps
both for each thread in ``/proc/thread-self/schedstat`` (nanoseconds on the CPU, nanoseconds
waiting on a run queue, time slices). Where that file cannot be read (another OS, a kernel
without scheduler statistics), it falls back to the thread's CPU clock. Time the thread
waited for the GIL or sat in epoll counts in neither: the loop was not what held callers up.
"""

from __future__ import annotations

import os
import time

SCHEDSTAT = "/proc/thread-self/schedstat"


class DemandClock:
    """A clock, in seconds, of the time one thread ran or waited runnable for a core: the
    thread that made it (make it on the loop), read for that thread on every call. The
    thread's CPU clock (``time.thread_time``, on the calling thread) where the scheduler's
    statistics are not available. ``close`` lets its file go."""

    def __init__(self) -> None:
        self._fd = -1
        try:
            fd = os.open(SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            self._fd = fd
            self()
        except (OSError, ValueError, IndexError):
            self._fd = -1
            os.close(fd)

    @property
    def counts_waiting(self) -> bool:
        """True when it counts the time waited for a core (the statistics are there)."""
        return self._fd >= 0

    def __call__(self) -> float:
        if self._fd < 0:
            return time.thread_time()
        running, waiting = os.pread(self._fd, 128, 0).split()[:2]
        return (int(running) + int(waiting)) / 1e9

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

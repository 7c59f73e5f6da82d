"""A child process that fsyncs the journal's WAL for the event loop.

The loop writes each batch into the WAL itself and asks the child for the fsync by writing
one byte into a pipe; the child answers with one byte once ``fdatasync`` returns, which the
loop reads when the pipe is readable (``add_reader``). No thread of the router takes part,
so nothing waits for the GIL between the loop and the disk. The child holds nothing but a
read-only descriptor of the WAL, and leaves when its pipe closes (the router stopped or
died).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import subprocess
import sys

_CHILD = """\
import os, sys
fd = int(sys.argv[1])
while os.read(0, 1):
    try:
        os.fdatasync(fd)
        answer = 0
    except OSError as exc:
        answer = min(exc.errno or 255, 255)
    os.write(1, bytes([answer]))
"""
"""The child's program: one answer byte per request byte, 0 or the errno of the fsync."""


class FsyncChild:
    """Fsyncs ``fd`` in a child process; ``request()`` returns a future of the running loop
    that resolves when an fsync started after the request returns, or fails with its
    ``OSError``, or with ``ChildProcessError`` when the child is gone."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD, str(fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(fd,),
            bufsize=0,
            start_new_session=True,  # the terminal's Ctrl-C is for the router, not for it
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to = self._proc.stdin.fileno()
        self._from = self._proc.stdout.fileno()
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._gone: BaseException | None = None
        loop.add_reader(self._from, self._answered)

    def request(self) -> asyncio.Future[None]:
        done = self._loop.create_future()
        if self._gone is not None:
            done.set_exception(self._gone)
            return done
        try:
            os.write(self._to, b"s")
        except OSError:
            self._exited()
            done.set_exception(self._gone or ChildProcessError("the fsync process is gone"))
            return done
        self._waiting.append(done)
        return done

    def _answered(self) -> None:
        try:
            answers = os.read(self._from, 4096)
        except OSError:
            answers = b""
        if not answers:
            self._exited()
            return
        for answer in answers:
            done = self._waiting.popleft()
            if done.done():
                continue
            if answer:
                done.set_exception(OSError(answer, os.strerror(answer)))
            else:
                done.set_result(None)

    def _exited(self) -> None:
        """The child closed its end: it exited (or was killed); every waiter fails."""
        if self._gone is not None:
            return
        self._loop.remove_reader(self._from)
        code = self._proc.poll()
        self._gone = ChildProcessError(
            f"the journal's fsync process exited (code {code})"
            if code is not None
            else "the journal's fsync process closed its pipe"
        )
        while self._waiting:
            done = self._waiting.popleft()
            if not done.done():
                done.set_exception(self._gone)
                done.exception()

    async def stop(self) -> None:
        """Closes the pipe (the child answers what it was asked, then leaves) and reaps it."""
        if self._gone is None:
            self._loop.remove_reader(self._from)
            self._gone = ChildProcessError("the journal is closed")
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        await asyncio.to_thread(self._proc.wait)
        self._proc.stdout.close()

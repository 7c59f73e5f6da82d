"""The ``sessionrouter`` command.

``sessionrouter serve`` runs the router until SIGTERM or Ctrl-C, then drains gracefully and
exits 0. Bad configuration prints one ``sessionrouter: error: ...`` line and exits 2. A journal
that cannot be used (not SQLite, not ours, another schema version, unreadable, locked by
another router) prints one line naming the file and the problem and exits 1, and so does a
journal that fails while serving (after draining what it can); the file is never reset. A
shard that cannot reach NATS, or finds shards of another count registered, prints one line and
exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from sessionrouter.server.extras import require_server_extra

# Before the server's modules: without `pip install "sessionrouter[server]"` they cannot be
# imported, and the command says so in one line instead of a traceback.
require_server_extra()

from sessionrouter.server import logs  # noqa: E402
from sessionrouter.server.app import RouterServer  # noqa: E402
from sessionrouter.server.config import (  # noqa: E402
    TOKEN_ENV,
    ConfigError,
    ServerConfig,
    Sources,
    add_arguments,
    build_config,
    env_values,
    flag_values,
    load_file,
)
from sessionrouter.server.gc_policy import settle_heap  # noqa: E402
from sessionrouter.server.journal import JournalError  # noqa: E402
from sessionrouter.server.shards.link import ShardStartError  # noqa: E402

log = logging.getLogger("sessionrouter.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sessionrouter",
        description="gRPC session router for online RL: distinct-worker placement of GRPO"
        " groups, reward collection and per-group advantages.",
    )
    parser.add_argument("--version", action="version", version=f"sessionrouter {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the router",
        description="Run the router. Each setting comes from its flag, else its environment"
        " variable (in brackets), else the config file, else its default.",
    )
    add_arguments(serve)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("sessionrouter")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "unknown"


async def serve(config: ServerConfig, port_file: str | None) -> int:
    """Runs the server until SIGTERM/SIGINT (returns 0) or a journal failure (returns 1),
    then drains."""
    server = RouterServer(config)
    port = await server.start()
    settle_heap()
    if port_file:
        _write_port_file(port_file, port)
    print(f"sessionrouter listening on {config.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(server.failed.wait())
    await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, failed):
        task.cancel()
    await server.stop()
    if server.failed.is_set():
        print("sessionrouter: error: the journal failed; stopped (see the log)", file=sys.stderr)
        return 1
    return 0


def _write_port_file(path: str, port: int) -> None:
    """Writes the port atomically, so a reader never sees a half-written file."""
    tmp = Path(path + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        flags = flag_values(args)
        env = env_values(os.environ)
        path = flags.get("config") or env.get("config")
        file_data = load_file(path) if path else {}
        sources = Sources(flags, env, file_data)
        logs.configure(sources.get("log_level"), sources.get("log_format"))
        config = build_config(flags, file_data, env, os.environ.get(TOKEN_ENV) or None)
    except ConfigError as exc:
        print(f"sessionrouter: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, sources.get("port_file")))
    except ShardStartError as exc:  # NATS unreachable, another shard count: like bad config
        print(f"sessionrouter: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, JournalError) as exc:
        # grpc reports a port it cannot bind as RuntimeError.
        print(f"sessionrouter: error: {exc}", file=sys.stderr)
        return 1

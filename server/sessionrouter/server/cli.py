"""The ``sessionrouter`` command.

``sessionrouter serve`` runs the router until SIGTERM or Ctrl-C, then drains gracefully and
exits 0. Bad configuration prints one ``sessionrouter: error: ...`` line and exits 2. A journal
that cannot be used (not SQLite, not ours, another schema version, unreadable, locked by
another router) prints one line naming the file and the problem and exits 1, and so does a
journal that fails while serving (after draining what it can); the file is never reset.
"""

from __future__ import annotations

import argparse
import asyncio
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
from sessionrouter.server.app import RouterServer, ServerConfig  # noqa: E402
from sessionrouter.server.config import (  # noqa: E402
    ConfigError,
    Overrides,
    build_config,
    load_file,
)
from sessionrouter.server.core.journal import JournalError  # noqa: E402

log = logging.getLogger("sessionrouter.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sessionrouter",
        description="gRPC session router for online RL: distinct-worker placement of GRPO"
        " groups, reward collection and per-group advantages.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router")
    add = serve.add_argument
    add("--config", metavar="FILE", help="TOML config file (flags override it)")
    add("--listen", metavar="HOST:PORT", help="address to bind (default 127.0.0.1:50051)")
    add("--port-file", metavar="FILE", help="write the bound port here once serving")
    add(
        "--worker",
        action="append",
        default=[],
        metavar="ID=ADDRESS[,CAPACITY]",
        help="a worker known at start-up (repeatable); the server heartbeats it itself",
    )
    add(
        "--demo-workers",
        type=int,
        metavar="N",
        help="add N demo workers (demo-0..) of capacity 8 on 127.0.0.1:30000+",
    )
    add("--estimator", help="default estimator: grpo, dr_grpo or rloo (default grpo)")
    add("--eps", type=float, help="grpo: added to the std (default 1e-6)")
    add("--ddof", type=int, help="std degrees of freedom: 1 sample (default), 0 population")
    add(
        "--batch-std",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="grpo: divide by the micro-batch std instead of the group std",
    )
    add(
        "--group-deadline",
        type=float,
        dest="deadline_s",
        metavar="SECONDS",
        help="default group deadline (default 600)",
    )
    add("--min-members", type=int, help="default least rewarded members of a partial group")
    add(
        "--heartbeat-timeout",
        type=float,
        dest="heartbeat_timeout_s",
        metavar="SECONDS",
        help="a worker silent this long turns unhealthy (default 10)",
    )
    add(
        "--reducer-window-ms",
        type=float,
        metavar="MS",
        help="micro-batch window of the advantage reducer (default 2)",
    )
    add(
        "--reducer-max-batch",
        type=int,
        metavar="GROUPS",
        help="reduce at once when this many groups are queued (default 4096)",
    )
    add(
        "--placement",
        choices=("spread", "strict"),
        help="server-wide placement mode when workers are scarce (default spread)",
    )
    add(
        "--grace",
        type=float,
        dest="grace_s",
        metavar="SECONDS",
        help="time in-flight calls get on shutdown (default 10)",
    )
    add(
        "--shutdown-delay",
        type=float,
        dest="shutdown_delay_s",
        metavar="SECONDS",
        help="after SIGTERM, report NOT_SERVING and keep serving this long before draining"
        " (the Kubernetes preStop pattern; default 0)",
    )
    add(
        "--max-connection-age",
        type=float,
        dest="max_connection_age_s",
        metavar="SECONDS",
        help="close client connections after this long, so clients rebalance",
    )
    add(
        "--keepalive-time",
        type=float,
        dest="keepalive_time_s",
        metavar="SECONDS",
        help="ping idle connections this often (default 30); keep it below every proxy idle"
        " timeout on the path (nginx grpc_read_timeout, load balancer idle timeouts)",
    )
    add(
        "--feed-retention",
        type=int,
        metavar="GROUPS",
        help="finished groups kept for resuming subscribers (default 100000)",
    )
    add(
        "--token-file",
        metavar="FILE",
        help="require 'authorization: Bearer <token>' (token read from FILE or"
        " $SESSIONROUTER_TOKEN)",
    )
    add("--tls-cert", dest="tls_cert_file", metavar="FILE")
    add("--tls-key", dest="tls_key_file", metavar="FILE")
    add("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on PORT")
    add(
        "--state-dir",
        metavar="DIR",
        help="journal state here, durably, and recover it on start (default ./state)",
    )
    add(
        "--in-memory",
        action="store_true",
        help="keep no journal: a restart loses every group, reward and cursor (tests, benchmarks)",
    )
    add(
        "--journal-sync",
        choices=("full", "normal"),
        help="full (default): fsync every group commit, survives power loss; normal: survives a"
        " router crash but not an OS crash or power loss",
    )
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add("--log-format", default="json", choices=("json", "text"))
    return parser


def _overrides(args: argparse.Namespace) -> Overrides:
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file!r}: {exc.strerror}") from None
    token = token or os.environ.get("SESSIONROUTER_TOKEN") or None
    return Overrides(
        listen=args.listen,
        workers=tuple(args.worker),
        demo_workers=args.demo_workers,
        estimator=args.estimator,
        eps=args.eps,
        ddof=args.ddof,
        batch_std=args.batch_std,
        deadline_s=args.deadline_s,
        min_members=args.min_members,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        reducer_window_ms=args.reducer_window_ms,
        reducer_max_batch=args.reducer_max_batch,
        placement=args.placement,
        grace_s=args.grace_s,
        shutdown_delay_s=args.shutdown_delay_s,
        max_connection_age_s=args.max_connection_age_s,
        keepalive_time_s=args.keepalive_time_s,
        auth_token=token,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        metrics_port=args.metrics_port,
        feed_retention=args.feed_retention,
        state_dir=args.state_dir,
        in_memory=args.in_memory,
        journal_sync=args.journal_sync,
    )


async def serve(config: ServerConfig, port_file: str | None) -> int:
    """Runs the server until SIGTERM/SIGINT (returns 0) or a journal failure (returns 1),
    then drains."""
    server = RouterServer(config)
    port = await server.start()
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
    logs.configure(args.log_level, args.log_format)
    try:
        file_data = load_file(args.config) if args.config else None
        config = build_config(_overrides(args), file_data)
    except ConfigError as exc:
        print(f"sessionrouter: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, args.port_file))
    except (OSError, RuntimeError, JournalError) as exc:
        # grpc reports a port it cannot bind as RuntimeError.
        print(f"sessionrouter: error: {exc}", file=sys.stderr)
        return 1

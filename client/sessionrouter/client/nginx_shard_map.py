"""nginx as the shard map of a sharded sessionrouter: prints the config for N shard addresses.

    python -m sessionrouter.client.nginx_shard_map 10.0.0.1:50051 10.0.0.2:50051 > shards.conf

prints an ``upstream`` and a ``server`` block for nginx's ``http {}`` context (``--full`` wraps
them in a complete nginx.conf). Clients send the group of each call in the ``x-group-id``
header; nginx's plain ``hash $http_x_group_id;`` over the shards, listed in shard order with
equal weight, sends it to peer ``((crc32(key) >> 16) & 0x7fff) % N``, which is
``sessionrouter.client.shardmap.shard_of``: the group's owner.

Two settings keep that true when a shard is down. nginx marks a peer failed after
``max_fails`` errors and then rehashes its keys to other peers, and ``grpc_next_upstream``
retries a failed connection on the next peer: either would send a down shard's groups to a
shard that does not own them (it refuses them, WRONG_SHARD, but the caller gets a refusal
instead of a retryable error). So every server has ``max_fails=0`` (never marked failed) and
``grpc_next_upstream off`` (for ``grpc_pass``, the twin of ``proxy_next_upstream``): a down
shard's calls get 502, which gRPC clients read as UNAVAILABLE and retry until it is back.

A call naming no group (a worker's registration, StartSession without a group id, the feed)
has an empty key, which nginx's hash balances round-robin; any shard serves those.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

UPSTREAM = "sessionrouter_shards"
"""Name of the upstream block."""


def upstream_block(shards: Sequence[str], name: str = UPSTREAM) -> str:
    """The ``upstream`` block: the shards in shard order, hashed by ``x-group-id``."""
    if not shards:
        raise ValueError("at least one shard address is needed")
    lines = [f"upstream {name} {{", "    hash $http_x_group_id;  # plain, not `consistent`"]
    lines += [f"    server {address} max_fails=0;  # shard {i}" for i, address in enumerate(shards)]
    return "\n".join([*lines, "}"]) + "\n"


def server_block(
    listen: str,
    *,
    name: str = UPSTREAM,
    read_timeout_s: int = 300,
    extra: Sequence[str] = (),
) -> str:
    """The ``server`` block: HTTP/2 on ``listen`` (``8443``, ``unix:/path``), gRPC to the
    shards, no retry on another shard. ``read_timeout_s`` must stay above the routers'
    ``--keepalive-time`` so idle feeds are not cut."""
    lines = [
        "server {",
        f"    listen {listen} http2;",
        *(f"    {line}" for line in extra),
        "    location / {",
        f"        grpc_pass grpc://{name};",
        "        grpc_next_upstream off;  # a down shard's groups are UNAVAILABLE, never moved",
        f"        grpc_read_timeout {read_timeout_s}s;",
        f"        grpc_send_timeout {read_timeout_s}s;",
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def full_config(
    shards: Sequence[str],
    *,
    listen: str,
    prefix: str,
    read_timeout_s: int = 300,
    access_log_format: str | None = None,
) -> str:
    """A complete nginx.conf for ``nginx -p PREFIX -c CONF`` in the foreground: pid, logs and
    temporary files under ``prefix``. ``access_log_format`` (an nginx ``log_format`` string)
    replaces the default access log line."""
    log_format = ""
    access_log = f"access_log {prefix}/access.log;"
    if access_log_format is not None:
        log_format = f"    log_format shards '{access_log_format}';\n"
        access_log = f"access_log {prefix}/access.log shards;"
    body = upstream_block(shards) + server_block(listen, read_timeout_s=read_timeout_s)
    indented = "".join(f"    {line}\n" if line else "\n" for line in body.splitlines())
    return (
        "daemon off;\n"
        "worker_processes 1;\n"
        f"pid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\n"
        "events { worker_connections 1024; }\n"
        "http {\n"
        f"{log_format}"
        f"    {access_log}\n"
        f"    client_body_temp_path {prefix}/body;\n"
        f"    proxy_temp_path {prefix}/proxy;\n"
        f"    fastcgi_temp_path {prefix}/fastcgi;\n"
        f"    uwsgi_temp_path {prefix}/uwsgi;\n"
        f"    scgi_temp_path {prefix}/scgi;\n"
        f"{indented}"
        "}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", nargs="+", help="shard addresses HOST:PORT, in shard order")
    parser.add_argument("--listen", default="8443", help="nginx listen address (default 8443)")
    parser.add_argument("--read-timeout", type=int, default=300, help="grpc_read_timeout, s")
    parser.add_argument(
        "--full", metavar="PREFIX", help="print a complete nginx.conf with files under PREFIX"
    )
    args = parser.parse_args(argv)
    if args.full:
        text = full_config(
            args.shards, listen=args.listen, prefix=args.full, read_timeout_s=args.read_timeout
        )
    else:
        text = upstream_block(args.shards) + server_block(
            args.listen, read_timeout_s=args.read_timeout
        )
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What token roles cost per call: unary Heartbeat calls/s with and without a token file.

Two router processes run side by side, one without authentication (the baseline) and one with
a token file of 64 tokens (every role, a worker token bound to the benchmark's worker). The
same client sends concurrent Heartbeat calls to each, alternating rounds, as an admin (role
check only) and as the worker (role check plus the worker-id binding check on the request).
The ratio to the baseline of the same run is the figure to quote.

    .venv/bin/python scripts/bench_auth.py [--calls 4000] [--concurrency 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import grpc
from bench_common import header, median, router_command, server_process

from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

WORKER_ID = "bench-worker-0"


def token_file(directory: Path) -> Path:
    """64 tokens: 15 of each role but worker, 19 worker tokens; the measured ones last."""
    lines = [
        f"{role}:{role}-{i:04d}-padding-to-32-chars"
        for role in ("rollout", "trainer", "admin")
        for i in range(15)
    ]
    lines += [f"worker:worker-{i:04d}-padding-to-32-chars:other-{i}" for i in range(17)]
    lines += ["admin:bench-admin-token", f"worker:bench-worker-token:{WORKER_ID}"]
    path = directory / "tokens"
    path.write_text("\n".join(lines) + "\n")
    return path


async def calls_per_s(address: str, token: str | None, calls: int, concurrency: int) -> float:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = wpb_grpc.WorkerServiceStub(channel)
        await stub.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id=WORKER_ID, address="10.0.0.1:1", capacity=1),
            metadata=metadata,
        )
        request = wpb.HeartbeatRequest(worker_id=WORKER_ID)
        left = calls

        async def caller() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await stub.Heartbeat(request, metadata=metadata)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return calls / (time.perf_counter() - started)


async def run(open_address: str, auth_address: str, args: argparse.Namespace) -> None:
    sides = {
        "no token file": (open_address, None),
        "token file, admin": (auth_address, "bench-admin-token"),
        "token file, worker (bound)": (auth_address, "bench-worker-token"),
    }
    results: dict[str, list[float]] = {name: [] for name in sides}
    for address, token in sides.values():  # warm-up: connections, registration
        await calls_per_s(address, token, 500, args.concurrency)
    names = list(sides)
    for round_ in range(args.repeats):
        # Each round starts with another side, so no side always runs first.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            address, token = sides[name]
            results[name].append(await calls_per_s(address, token, args.calls, args.concurrency))
    base = median(results["no token file"])
    print(f"{'side':<28} {'calls/s (median)':>17} {'min-max':>13} {'ratio':>7}")
    for name, values in results.items():
        spread = f"{min(values):,.0f}-{max(values):,.0f}"
        print(f"{name:<28} {median(values):>17,.0f} {spread:>13} {median(values) / base:>7.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--calls", type=int, default=4000, help="calls per round and side")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    header(f"Heartbeat calls/s with and without roles, {args.calls} calls x {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tokens = token_file(Path(tmp))
        heartbeat = ("--heartbeat-timeout", "3600")
        open_address = stack.enter_context(server_process(router_command(*heartbeat)))
        auth_address = stack.enter_context(
            server_process(router_command(*heartbeat, "--token-file", str(tokens)))
        )
        asyncio.run(run(open_address, auth_address, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

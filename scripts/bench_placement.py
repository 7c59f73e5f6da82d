"""StartSession cost versus pool size, and memory per open session.

Prints, for 16, 256 and 4096 workers:
- core: microseconds per StartSession call of the router core (groups of 8 joined one member
  at a time), next to a baseline that scans every worker on every placement (what a router
  without the least-loaded index does), measured in the same run;
- gRPC: StartSession calls/s and median latency against a real router process on 127.0.0.1
  (32 concurrent callers, groups of 8 joined by concurrent calls);
and the memory held per open session with 100k sessions open (tracemalloc, core only).

    .venv/bin/python scripts/bench_placement.py [--sessions 20000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import tracemalloc

import grpc
from bench_common import header, median, router_command, server_process

from sessionrouter.server.core.placement import PlacementChoice, PlacementMode
from sessionrouter.server.core.router import (
    RouterSettings,
    SessionRouter,
    StartSessionCommand,
)
from sessionrouter.server.core.workers import WorkerRegistry
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

POOLS = (16, 256, 4096)
GROUP = 8


def _router(workers: int, capacity: int) -> SessionRouter:
    router = SessionRouter(RouterSettings(deadline_s=86_000))
    for i in range(workers):
        router.register_worker(f"w{i}", f"10.0.{i // 250}.{i % 250}:1", capacity, {})
    return router


def _start_sessions(router: SessionRouter, count: int) -> float:
    """Starts ``count`` sessions in groups of GROUP; returns seconds."""
    started = time.perf_counter()
    for n in range(count):
        router.start_session(
            StartSessionCommand(task_id="t", group_id=f"g{n // GROUP}", group_size=GROUP)
        )
    return time.perf_counter() - started


def _scan_choose(
    registry: WorkerRegistry,
    group_id: str,
    members_per_worker: dict[str, int],
    mode: PlacementMode,
    retry_after_s: float,
) -> PlacementChoice:
    """Baseline placement: one pass over every worker per call, O(W)."""
    best = None
    for worker in registry:
        if (
            worker.eligible
            and worker.worker_id not in members_per_worker
            and (best is None or worker.load < best.load)
        ):
            best = worker
    if best is None:
        raise RuntimeError("baseline only covers the distinct case")
    return PlacementChoice(best, shared=False)


def core_table(sessions: int, repeats: int) -> None:
    import sessionrouter.server.core.router as router_module

    print(f"\n## core: us per StartSession ({sessions} sessions, groups of {GROUP})")
    print(f"{'workers':>8} {'indexed':>9} {'full scan':>10} {'scan/indexed':>13}")
    # The baseline swaps the placement function the router calls (module attribute).
    original = getattr(router_module, "choose_worker")  # noqa: B009
    for pool in POOLS:
        capacity = sessions // pool + GROUP + 1
        ours, scan = [], []
        for _ in range(repeats):
            ours.append(_start_sessions(_router(pool, capacity), sessions) / sessions * 1e6)
            setattr(router_module, "choose_worker", _scan_choose)  # noqa: B010
            try:
                scan.append(_start_sessions(_router(pool, capacity), sessions) / sessions * 1e6)
            finally:
                setattr(router_module, "choose_worker", original)  # noqa: B010
        print(
            f"{pool:>8} {median(ours):>9.1f} {median(scan):>10.1f}"
            f" {median(scan) / median(ours):>13.1f}"
        )


async def _grpc_run(
    address: str, pool: int, sessions: int, concurrency: int
) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        workers = wpb_grpc.WorkerServiceStub(channel)
        for first in range(0, pool, 256):  # in chunks: thousands of calls at once are refused
            await asyncio.gather(
                *(
                    workers.RegisterWorker(
                        wpb.RegisterWorkerRequest(
                            worker_id=f"w{i}", address=f"10.0.0.{i % 250}:{i}", capacity=1_000_000
                        )
                    )
                    for i in range(first, min(first + 256, pool))
                )
            )
        stub = spb_grpc.SessionServiceStub(channel)
        latencies: list[float] = []
        queue = iter(range(sessions))

        async def caller() -> None:
            for n in queue:
                t = time.perf_counter()
                await stub.StartSession(
                    spb.StartSessionRequest(
                        task_id="t", group_id=f"g{n // GROUP}", group_size=GROUP, request_id=f"r{n}"
                    )
                )
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return sessions / elapsed, median(latencies) * 1e3


def grpc_table(sessions: int, repeats: int, concurrency: int) -> None:
    print(
        f"\n## gRPC: StartSession against a router process ({sessions} calls,"
        f" {concurrency} concurrent callers, one channel)"
    )
    print(f"{'workers':>8} {'calls/s':>9} {'p50 ms':>7} {'vs 16 workers':>14}")
    first = 0.0
    for pool in POOLS:
        rates, p50s = [], []
        for _ in range(repeats):
            with server_process(router_command("--heartbeat-timeout", "3600")) as address:
                rate, p50 = asyncio.run(_grpc_run(address, pool, sessions, concurrency))
            rates.append(rate)
            p50s.append(p50)
        first = first or median(rates)
        print(
            f"{pool:>8} {median(rates):>9,.0f} {median(p50s):>7.2f} {median(rates) / first:>14.2f}"
        )


def memory_table(open_sessions: int) -> None:
    print(f"\n## memory: {open_sessions:,} open sessions (groups of {GROUP}, 1000 workers)")
    gc.collect()
    tracemalloc.start()
    router = _router(1000, open_sessions // 1000 + GROUP)
    base = tracemalloc.get_traced_memory()[0]
    _start_sessions(router, open_sessions)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(
        f"{used / 2**20:,.1f} MiB in all, {used / open_sessions:,.0f} bytes per open session"
        " (session record, group share, worker index, request-free)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--open-sessions", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="small counts, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.repeats, args.open_sessions = 2_000, 1, 10_000
    header("placement cost by pool size")
    core_table(args.sessions, args.repeats)
    grpc_table(args.sessions // 2, args.repeats, args.concurrency)
    memory_table(args.open_sessions)


if __name__ == "__main__":
    main()

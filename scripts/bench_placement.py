"""StartSession cost versus pool size, placement policies side by side, and memory per open
session.

Prints, for 16, 256 and 4096 workers:
- core: microseconds per StartSession call of the router core (groups of 8 joined one member
  at a time), next to a baseline that scans every worker on every placement (what a router
  without the least-loaded index does), measured in the same run;
- gRPC: StartSession calls/s and median latency against a real router process on 127.0.0.1
  (32 concurrent callers, groups of 8 joined by concurrent calls);
then, on the core:
- selectors: us per StartSession at 4096 workers labelled over 8 values of one label, groups
  selecting one value, next to a baseline that scans every worker (filtering by labels) on
  every placement, and next to the same pool without selectors;
- policies: for spread, strict, pack (fair-share cap) and pack with explicit caps, at several
  loads of a churning pool (groups start, random groups finish), the load spread over workers
  (coefficient of variation of open sessions, median of samples) and a prefix-cache model's
  prefill work (a group's prompt prefix is prefilled once per distinct worker it uses:
  prefixes per group, 1 is the ideal, group size is no sharing at all);
and the memory held per open session with 100k sessions open (tracemalloc, core only).

    .venv/bin/python scripts/bench_placement.py [--sessions 20000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
import tracemalloc

import grpc
from bench_common import header, median, router_command, server_process

from sessionrouter.server.core.errors import ResourceExhausted, Unavailable
from sessionrouter.server.core.placement import PlacementChoice, PlacementMode, PlacementPolicy
from sessionrouter.server.core.router import (
    OptionsSpec,
    RouterSettings,
    SessionRouter,
    StartGroupCommand,
    StartSessionCommand,
)
from sessionrouter.server.core.workers import WorkerRegistry, matches
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

POOLS = (16, 256, 4096)
GROUP = 8


LABEL_VALUES = 8


def _router(workers: int, capacity: int, labelled: bool = False) -> SessionRouter:
    router = SessionRouter(RouterSettings(deadline_s=86_000))
    for i in range(workers):
        labels = {"pool": f"p{i % LABEL_VALUES}"} if labelled else {}
        router.register_worker(f"w{i}", f"10.0.{i // 250}.{i % 250}:1", capacity, labels)
    return router


def _start_sessions(router: SessionRouter, count: int, selectors: bool = False) -> float:
    """Starts ``count`` sessions in groups of GROUP (each group selecting one label value
    when ``selectors``); returns seconds."""
    started = time.perf_counter()
    for n in range(count):
        group = n // GROUP
        options = OptionsSpec(selector={"pool": f"p{group % LABEL_VALUES}"} if selectors else {})
        router.start_session(
            StartSessionCommand(
                task_id="t", group_id=f"g{group}", group_size=GROUP, options=options
            )
        )
    return time.perf_counter() - started


def _scan_choose(
    registry: WorkerRegistry,
    group_id: str,
    group_size: int,
    members_per_worker: dict[str, int],
    last_worker_id: str,
    policy: PlacementPolicy,
    retry_after_s: float,
) -> PlacementChoice:
    """Baseline placement: one pass over every worker per call, O(W)."""
    best = None
    for worker in registry:
        if (
            worker.eligible
            and worker.worker_id not in members_per_worker
            and matches(worker.labels, policy.selector)
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


def selector_table(sessions: int, repeats: int) -> None:
    import sessionrouter.server.core.router as router_module

    pool = 4096
    print(
        f"\n## core: us per StartSession with selectors ({pool} workers over {LABEL_VALUES}"
        f" label values, {sessions} sessions, groups of {GROUP})"
    )
    print(f"{'selectors':>10} {'indexed':>9} {'full scan':>10} {'scan/indexed':>13}")
    original = getattr(router_module, "choose_worker")  # noqa: B009
    capacity = sessions // pool * LABEL_VALUES + GROUP + 1
    for selectors in (False, True):
        ours, scan = [], []
        for _ in range(repeats):
            router = _router(pool, capacity, labelled=True)
            ours.append(_start_sessions(router, sessions, selectors) / sessions * 1e6)
            setattr(router_module, "choose_worker", _scan_choose)  # noqa: B010
            try:
                router = _router(pool, capacity, labelled=True)
                scan.append(_start_sessions(router, sessions, selectors) / sessions * 1e6)
            finally:
                setattr(router_module, "choose_worker", original)  # noqa: B010
        name = f"{LABEL_VALUES} pools" if selectors else "none"
        print(
            f"{name:>10} {median(ours):>9.1f} {median(scan):>10.1f}"
            f" {median(scan) / median(ours):>13.1f}"
        )


POLICIES: tuple[tuple[str, PlacementMode, int | None], ...] = (
    ("spread", PlacementMode.SPREAD, None),
    ("strict", PlacementMode.STRICT, None),
    ("pack fair", PlacementMode.PACK, None),
    ("pack cap 4", PlacementMode.PACK, 4),
    ("pack no cap", PlacementMode.PACK, 0),
)
"""(name, mode, cap): cap None is the fair share, 0 the group's size (no cap at all)."""


def _churn(
    mode: PlacementMode,
    cap: int | None,
    load: float,
    workers: int,
    capacity: int,
    group: int,
    steps: int,
    seed: int,
) -> tuple[float, float, int]:
    """A pool kept near ``load`` (fraction of its slots): each step starts one group and,
    above the load, finishes a random open group. Returns (median CV of open sessions per
    worker, prefixes prefilled per group, groups refused)."""
    rng = random.Random(seed)
    router = _router(workers, capacity)
    # Mixed sizes and a quarter of the pool at twice the capacity: a pool as it is, not ideal.
    for i in range(workers // 4):
        router.register_worker(f"w{i}", f"10.0.0.{i % 250}:1", capacity * 2, {})
    slots = sum(w.capacity for w in router.workers)
    open_groups: list[list[str]] = []
    cvs: list[float] = []
    prefixes: list[int] = []
    refused = 0
    for step in range(steps):
        size = rng.choice((group // 2, group, group))
        limit = None if cap is None else min(cap or size, size)
        options = OptionsSpec(max_members_per_worker=limit)
        try:
            started = router.start_group(
                StartGroupCommand(
                    task_id="t", group_size=size, placement_mode=mode, options=options
                )
            )
        except (ResourceExhausted, Unavailable):
            refused += 1
        else:
            members = started.group.members
            open_groups.append([m.name for m in members])
            prefixes.append(len({m.worker_id for m in members}))
        while open_groups and sum(len(w.open_sessions) for w in router.workers) > load * slots:
            names = open_groups.pop(rng.randrange(len(open_groups)))
            router.submit_rewards([(name, rng.random()) for name in names])
        if step % 64 == 0:
            router.finalizer.drain()
        if step > steps // 4:
            counts = [len(w.open_sessions) / w.capacity for w in router.workers]
            mean = statistics.fmean(counts)
            cvs.append(statistics.pstdev(counts) / mean if mean else 0.0)
    return median(cvs), statistics.fmean(prefixes) if prefixes else 0.0, refused


def policy_table(steps: int) -> None:
    workers, capacity, group = 16, 32, 16
    print(
        f"\n## core: policies side by side ({workers} workers, a quarter at capacity"
        f" {capacity * 2}, the rest {capacity}; groups of {group // 2} or {group};"
        f" {steps} groups per cell)"
    )
    print("load CV: std/mean of open sessions per slot over workers (lower is evener);")
    print(f"prefixes/group: distinct workers a group uses (1 ideal for the cache, {group} none)")
    loads = (0.25, 0.5, 0.9)
    head = "".join(
        f" {'CV@' + format(load, '.0%'):>8} {'pfx@' + format(load, '.0%'):>8}" for load in loads
    )
    print(f"{'policy':>12}{head} {'refused':>8}")
    for name, mode, cap in POLICIES:
        row, refused = "", 0
        for load in loads:
            cv, pfx, ref = _churn(mode, cap, load, workers, capacity, group, steps, seed=7)
            row += f" {cv:>8.3f} {pfx:>8.2f}"
            refused += ref
        print(f"{name:>12}{row} {refused:>8}")


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
    parser.add_argument("--policy-steps", type=int, default=3000)
    parser.add_argument("--skip-grpc", action="store_true", help="core tables only")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.repeats, args.open_sessions = 2_000, 1, 10_000
        args.policy_steps = 600
    header("placement cost by pool size")
    core_table(args.sessions, args.repeats)
    selector_table(args.sessions, args.repeats)
    policy_table(args.policy_steps)
    if not args.skip_grpc:
        grpc_table(args.sessions // 2, args.repeats, args.concurrency)
    memory_table(args.open_sessions)


if __name__ == "__main__":
    main()

"""Cost of the per-RPC metrics interceptor on StartSession.

Two router processes run side by side, both serving metrics, one with ``--rpc-metrics`` and
one with ``--no-rpc-metrics``; rounds of StartSession calls (32 concurrent callers, groups of
8 joined by concurrent calls) alternate between them, the order swapped every round, so
drift on a shared machine hits both sides alike. Prints each side's median calls/s, median
latency and server CPU time per call (user + system time of the router process, from
/proc, which a loaded machine disturbs far less than wall-clock figures), and the ratios
(with / without).

    .venv/bin/python scripts/bench_rpc_metrics.py [--calls 4000] [--rounds 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from bench_common import ROOT, header, median, router_command

from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

GROUP = 8
WORKERS = 16
TICKS = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _router(args: Sequence[str]) -> Iterator[tuple[str, int]]:
    """A router process; yields its address and pid (for its CPU time)."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(
            [*args, "--port-file", str(port_file)], cwd=ROOT, stdout=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the router did not start")
                time.sleep(0.05)
            yield f"127.0.0.1:{port_file.read_text().strip()}", proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def _register(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        workers = wpb_grpc.WorkerServiceStub(channel)
        for i in range(WORKERS):
            await workers.RegisterWorker(
                wpb.RegisterWorkerRequest(
                    worker_id=f"w{i}", address=f"10.0.0.{i}:1", capacity=10**6
                )
            )


async def _round(address: str, tag: str, calls: int, concurrency: int) -> tuple[float, float]:
    """Runs ``calls`` StartSession calls; returns (calls/s, median latency in ms)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.SessionServiceStub(channel)
        latencies: list[float] = []
        queue = iter(range(calls))

        async def caller() -> None:
            for n in queue:
                t = time.perf_counter()
                await stub.StartSession(
                    spb.StartSessionRequest(
                        task_id="t", group_id=f"{tag}-{n // GROUP}", group_size=GROUP
                    )
                )
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return calls / elapsed, median(latencies) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="StartSession calls per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per side")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1000 calls, 4 rounds")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds = 1000, 4
    header("per-RPC metrics interceptor: StartSession with and without")
    print(
        f"# {args.calls} calls per round, {args.rounds} rounds per side, {args.concurrency}"
        f" concurrent callers, {WORKERS} workers, groups of {GROUP}"
    )
    sides = {"with": "--rpc-metrics", "without": "--no-rpc-metrics"}
    rates: dict[str, list[float]] = {side: [] for side in sides}
    p50s: dict[str, list[float]] = {side: [] for side in sides}
    cpus: dict[str, list[float]] = {side: [] for side in sides}
    with contextlib.ExitStack() as stack:
        routers = {
            side: stack.enter_context(
                _router(router_command("--heartbeat-timeout", "3600", "--metrics-port", "0", flag))
            )
            for side, flag in sides.items()
        }
        for address, _ in routers.values():
            asyncio.run(_register(address))
        for side, (address, _) in routers.items():  # warm-up, not counted
            asyncio.run(_round(address, f"warm-{side}", min(args.calls, 500), args.concurrency))
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                address, pid = routers[side]
                cpu = _cpu_s(pid)
                rate, p50 = asyncio.run(_round(address, f"r{r}", args.calls, args.concurrency))
                cpus[side].append((_cpu_s(pid) - cpu) / args.calls * 1e6)
                rates[side].append(rate)
                p50s[side].append(p50)
    print(f"\n{'side':>8} {'calls/s':>9} {'p50 ms':>7} {'server CPU us/call':>19}")
    for side in sides:
        print(
            f"{side:>8} {median(rates[side]):>9,.0f} {median(p50s[side]):>7.3f}"
            f" {median(cpus[side]):>19.1f}"
        )
    print(
        f"\nwith/without: throughput {median(rates['with']) / median(rates['without']):.3f},"
        f" p50 latency {median(p50s['with']) / median(p50s['without']):.3f},"
        f" server CPU per call {median(cpus['with']) / median(cpus['without']):.3f}"
    )
    per_round = [w / wo for w, wo in zip(cpus["with"], cpus["without"], strict=True)]
    print(f"per-round CPU ratios: {' '.join(f'{x:.3f}' for x in per_round)}")


if __name__ == "__main__":
    main()

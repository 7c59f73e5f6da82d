"""SubmitRewards throughput and server CPU per reward over gRPC on loopback, against an
ack-only baseline.

Drives one bidirectional stream with 1 and with 256 reward entries per message and prints
rewards/s and the server process's CPU time per reward (from /proc) for the real router next
to a trivial server that only acknowledges the same messages (same proto, same client, same
run, the two alternated). The router runs at its default settings, default log level
included. Three ways of sending, each against an ack-only server that answers in kind:

- ``message``: RewardEntry sub-messages, raw stubs, per-group GroupResult messages back;
- ``columnar``: RewardColumns of session handles, raw stubs, packed statuses and one
  GroupResultBatch per message back;
- ``client``: the project's Python client, ``RewardStream.submit_arrays`` with handles and
  ``columnar_results`` (what a trainer using the client gets).

The ratios are the figures to quote: they say how much of the transport's ceiling the
router's bookkeeping and reduction leave. The last two columns are the client's own CPU per
reward (this process: the driving loop and gRPC's threads) against each server: client and
server share the machine's cores, so when the client costs more per reward than the ack-only
server, the ack-only rewards/s is the client's ceiling, not the transport's, and the rewards/s
ratio then says how much of the client's pace the router keeps.

Steady state only: each run first sends ``--warmup`` messages on its open stream and waits for
their acks (the channel is connected, the stream and the server's caches are warm), and only
then starts the clock and reads the server's CPU; both are read again at the last ack. Server
CPU is the sum of the run time of the server's threads from /proc/PID/task/*/schedstat
(nanoseconds): the ack-only server spends well under 0.1 s on a run, which /proc/PID/stat's
10 ms ticks would measure to a tenth.

    .venv/bin/python scripts/bench_rewards.py [--rewards 100000] [--repeats 3] [--modes ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import numpy as np
from bench_common import Server, header, median, router_command, serve

from sessionrouter.client import SessionRouterClient
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

GROUP_SIZE = 8
WINDOW = 64
"""Requests in flight at most (unacknowledged), for every mode."""


def cpu_ns(pid: int) -> int:
    """Nanoseconds the threads of process ``pid`` have run so far (schedstat's first field,
    summed over its threads). A thread that ends takes its time with it; the servers measured
    here keep theirs (gRPC's and the journal's threads live as long as the process)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


class Window:
    """The timed stretch of one run: wall seconds, the server's CPU seconds and this
    process's (the client's: the driving loop and gRPC's threads) CPU seconds between
    ``start`` (after the warm-up) and ``stop`` (the last ack)."""

    def __init__(self, pid: int | None = None) -> None:
        self._pid = pid
        self._started = self._cpu = self._client_cpu = 0.0
        self.seconds = self.cpu_seconds = self.client_cpu_seconds = 0.0

    def start(self) -> None:
        self._cpu = cpu_ns(self._pid) / 1e9 if self._pid is not None else 0.0
        self._client_cpu = cpu_ns(os.getpid()) / 1e9
        self._started = time.perf_counter()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._started
        self.client_cpu_seconds = cpu_ns(os.getpid()) / 1e9 - self._client_cpu
        if self._pid is not None:
            self.cpu_seconds = cpu_ns(self._pid) / 1e9 - self._cpu


class AckOnlyServicer(spb_grpc.SessionServiceServicer):
    """The baseline: answers every SubmitRewards request with ACCEPTED per entry, in the
    request's form (one RewardResult per entry, or packed statuses)."""

    async def SubmitRewards(  # noqa: N802  (the RPC's name)
        self,
        request_iterator: AsyncIterator[spb.SubmitRewardsRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[spb.SubmitRewardsResponse]:
        accepted = spb.RewardResult(status=spb.REWARD_STATUS_ACCEPTED)
        async for request in request_iterator:
            if request.HasField("columns"):
                count = len(request.columns.rewards)
                ack = spb.RewardAck(
                    sequence=request.sequence, statuses=[spb.REWARD_STATUS_ACCEPTED] * count
                )
            else:
                ack = spb.RewardAck(
                    sequence=request.sequence, results=[accepted] * len(request.entries)
                )
            yield spb.SubmitRewardsResponse(ack=ack)


async def serve_trivial(port_file: str) -> None:
    server = grpc.aio.server()
    # Only SubmitRewards is measured; the other RPCs answer UNIMPLEMENTED.
    servicer = AckOnlyServicer()  # type: ignore[abstract]
    spb_grpc.add_SessionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))  # noqa: ASYNC240  (once, before serving)
    await server.wait_for_termination()


async def make_sessions(address: str, count: int) -> list[str]:
    """Registers workers and starts ``count`` sessions in groups of GROUP_SIZE; returns
    their names."""
    return (await make_sessions_with_handles(address, count))[0]


async def make_sessions_with_handles(address: str, count: int) -> tuple[list[str], list[int]]:
    """``make_sessions``, returning the sessions' handles too."""
    async with grpc.aio.insecure_channel(address) as channel:
        workers = wpb_grpc.WorkerServiceStub(channel)
        for i in range(16):
            await workers.RegisterWorker(
                wpb.RegisterWorkerRequest(
                    worker_id=f"bench-{i}", address=f"10.0.0.{i}:1", capacity=1_000_000
                )
            )
        sessions = spb_grpc.SessionServiceStub(channel)
        names: list[str] = []
        handles: list[int] = []
        for start in range(0, count, GROUP_SIZE * 64):
            replies = await asyncio.gather(
                *(
                    sessions.StartGroup(
                        spb.StartGroupRequest(task_id="bench", group_size=GROUP_SIZE)
                    )
                    for _ in range(min(64, (count - start) // GROUP_SIZE))
                )
            )
            names += [m.name for r in replies for m in r.group.members]
            handles += [m.handle for r in replies for m in r.group.members]
        return names, handles


def interleaved(
    names: Sequence[str], handles: Sequence[int], per_message: int, seed: int = 0
) -> tuple[list[str], list[int]]:
    """The sessions in the order a trainer sends rewards as its rollouts finish: each
    message's entries shuffled (the same permutation for names and handles), so the members
    of its groups are interleaved instead of one group after the other."""
    rng = np.random.default_rng(seed)
    order = np.concatenate(
        [
            start + rng.permutation(min(per_message, len(names) - start))
            for start in range(0, len(names), per_message)
        ]
    ).tolist()
    return [names[i] for i in order], [handles[i] for i in order]


def requests_of(
    mode: str, names: Sequence[str], handles: Sequence[int], per_message: int
) -> list[spb.SubmitRewardsRequest]:
    requests = []
    for k, start in enumerate(range(0, len(names), per_message)):
        end = start + per_message
        rewards = [float(i % 3) for i in range(start, min(end, len(names)))]
        if mode == "message":
            request = spb.SubmitRewardsRequest(
                entries=[
                    spb.RewardEntry(session=n, reward=r)
                    for n, r in zip(names[start:end], rewards, strict=True)
                ],
                sequence=k,
            )
        else:
            request = spb.SubmitRewardsRequest(
                columns=spb.RewardColumns(handles=handles[start:end], rewards=rewards),
                sequence=k,
                columnar_results=True,
            )
        requests.append(request)
    return requests


async def drive_stubs(
    address: str,
    requests: Sequence[spb.SubmitRewardsRequest],
    window: Window | None = None,
    warmup: int = 0,
) -> None:
    """Streams the requests, keeping at most WINDOW unacknowledged, until every ack came.
    With a ``window``, the first ``warmup`` requests are sent and acknowledged before it
    starts; it stops at the last ack."""
    acked = asyncio.Semaphore(WINDOW)
    warm = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.SessionServiceStub(channel)

        async def produce() -> AsyncIterator[spb.SubmitRewardsRequest]:
            for i, request in enumerate(requests):
                if window is not None and i == warmup:
                    if warmup:
                        await warm.wait()
                    window.start()
                await acked.acquire()
                yield request

        call = stub.SubmitRewards(produce())
        acks = 0
        async for response in call:
            if response.HasField("ack"):
                acks += 1
                acked.release()
                if acks == warmup:
                    warm.set()
                if acks == len(requests):
                    if window is not None:
                        window.stop()
                    call.cancel()
                    break


async def drive(address: str, names: Sequence[str], per_message: int) -> float:
    """Message form with raw stubs: one reward per name, ``per_message`` entries per request;
    returns rewards per second."""
    requests = requests_of("message", names, [0] * len(names), per_message)
    started = time.perf_counter()
    await drive_stubs(address, requests)
    return len(names) / (time.perf_counter() - started)


async def drive_client(
    address: str, handles: Sequence[int], per_message: int, window: Window, warmup: int
) -> None:
    """The project's client: one ``submit_arrays`` per message, WINDOW in flight; the first
    ``warmup`` messages are acknowledged before ``window`` starts, and it stops at the last
    ack (connecting and closing left out, as the stub modes leave out building their
    requests)."""
    ids = np.asarray(handles, dtype=np.uint64)
    rewards = (np.arange(len(ids)) % 3).astype(np.float64)
    in_flight = asyncio.Semaphore(WINDOW)
    async with SessionRouterClient.connect(address) as client:
        stream = client.reward_stream(
            max_batch=per_message, columnar_results=True, keep_results=False
        )
        async with stream:

            async def one(start: int) -> None:
                async with in_flight:
                    ack = await stream.submit_arrays(
                        ids[start : start + per_message], rewards[start : start + per_message]
                    )
                    if not ack.all_ok:
                        raise RuntimeError(f"rewards refused: {ack.details[:3]}")

            starts = range(0, len(ids), per_message)
            await asyncio.gather(*(one(s) for s in starts[:warmup]))  # open and warm
            window.start()
            await asyncio.gather(*(one(s) for s in starts[warmup:]))
            window.stop()


async def run_once(
    server: Server,
    mode: str,
    names: Sequence[str],
    handles: Sequence[int],
    per_message: int,
    warmup: int = 0,
) -> tuple[float, float, float]:
    """Rewards/s, server CPU µs per reward and client CPU µs per reward of one run, over the
    rewards after the first ``warmup`` messages."""
    window = Window(server.pid)
    if mode == "client":
        await drive_client(server.address, handles, per_message, window, warmup)
    else:
        requests = requests_of(mode, names, handles, per_message)
        await drive_stubs(server.address, requests, window, warmup)
    timed = len(names) - min(len(names), warmup * per_message)
    return (
        timed / window.seconds,
        window.cpu_seconds / timed * 1e6,
        window.client_cpu_seconds / timed * 1e6,
    )


def uptime() -> str:
    """What ``uptime`` says: how loaded the machine was (the figures are shared-core ones)."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


async def measure(args: argparse.Namespace) -> None:
    header("SubmitRewards throughput and server CPU per reward, router vs ack-only server")
    print(f"# uptime before: {uptime()}")
    print(
        f"# {args.rewards} rewards timed per run (a quarter at 1 entry/msg) after"
        f" {args.warmup} warm-up messages, groups of {GROUP_SIZE}, {WINDOW} requests in"
        f" flight, entries {'interleaved' if args.interleave else 'group by group'},"
        f" router flags {args.router_arg or 'default'}, median of {args.repeats}"
        " (router and ack-only alternated); server CPU from schedstat over the timed window"
    )
    trivial = [sys.executable, __file__, "--serve-trivial"]
    print(
        f"{'mode':>8} {'entries/msg':>11} {'router rew/s':>13} {'ack-only rew/s':>15}"
        f" {'ratio':>6} {'router µs CPU/rew':>18} {'ack-only µs':>12} {'CPU ratio':>10}"
        f" {'client µs (router)':>19} {'client µs (ack-only)':>21}"
    )
    for mode in args.modes:
        for per_message in args.per_message:
            timed = args.rewards if per_message > 1 else args.rewards // 4
            count = timed + args.warmup * per_message
            ours, base, ours_cpu, base_cpu, ours_client, base_client = [], [], [], [], [], []
            for _ in range(args.repeats):
                with serve(
                    router_command("--heartbeat-timeout", "3600", *args.router_arg)
                ) as router:
                    names, handles = await make_sessions_with_handles(router.address, count)
                    if args.interleave:
                        names, handles = interleaved(names, handles, per_message)
                    rate, cpu, client = await run_once(
                        router, mode, names, handles, per_message, args.warmup
                    )
                    ours.append(rate)
                    ours_cpu.append(cpu)
                    ours_client.append(client)
                with serve(trivial) as ack_only:
                    rate, cpu, client = await run_once(
                        ack_only, mode, names, handles, per_message, args.warmup
                    )
                    base.append(rate)
                    base_cpu.append(cpu)
                    base_client.append(client)
            print(
                f"{mode:>8} {per_message:>11} {median(ours):>13,.0f} {median(base):>15,.0f}"
                f" {median(ours) / median(base):>6.2f} {median(ours_cpu):>18.2f}"
                f" {median(base_cpu):>12.2f} {median(ours_cpu) / median(base_cpu):>10.1f}"
                f" {median(ours_client):>19.2f} {median(base_client):>21.2f}",
                flush=True,
            )
    print(f"# uptime after: {uptime()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rewards", type=int, default=100_000, help="rewards timed per run (256/msg)"
    )
    parser.add_argument(
        "--warmup", type=int, default=16, help="messages sent and acked before the clock starts"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("message", "columnar", "client"),
        default=["message", "columnar", "client"],
    )
    parser.add_argument("--per-message", nargs="+", type=int, default=[1, 256])
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="an extra router flag (repeat it): leave the defaults to quote figures, e.g."
        " --router-arg=--log-level --router-arg=warning only to show what logging costs",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="shuffle each message's entries (groups interleaved, as rewards come when"
        " rollouts finish) instead of sending each group's members together",
    )
    parser.add_argument("--serve-trivial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_trivial:
        asyncio.run(serve_trivial(args.port_file))
    else:
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()

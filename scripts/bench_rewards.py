"""SubmitRewards throughput over gRPC on loopback, against a do-nothing baseline.

Drives one bidirectional stream with 1 and with 256 reward entries per message and prints
rewards/s for the real router next to a trivial server that only acknowledges the same
messages (same proto, same client, same run). The ratio is the figure to quote: it says how
much of the transport's ceiling the router's bookkeeping and reduction leave.

    .venv/bin/python scripts/bench_rewards.py [--rewards 40000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from bench_common import header, median, router_command, server_process

from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

GROUP_SIZE = 8


class AckOnlyServicer(spb_grpc.SessionServiceServicer):
    """The baseline: answers every SubmitRewards request with ACCEPTED per entry."""

    async def SubmitRewards(  # noqa: N802  (the RPC's name)
        self,
        request_iterator: AsyncIterator[spb.SubmitRewardsRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[spb.SubmitRewardsResponse]:
        accepted = spb.RewardResult(status=spb.REWARD_STATUS_ACCEPTED)
        async for request in request_iterator:
            yield spb.SubmitRewardsResponse(
                ack=spb.RewardAck(
                    sequence=request.sequence, results=[accepted] * len(request.entries)
                )
            )


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
    """Registers workers and starts ``count`` sessions in groups of GROUP_SIZE."""
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
        return names


async def drive(address: str, names: Sequence[str], per_message: int, window: int = 64) -> float:
    """Streams one reward per name, ``per_message`` entries per request, keeping at most
    ``window`` requests unacknowledged; returns rewards per second."""
    requests = [
        spb.SubmitRewardsRequest(
            entries=[
                spb.RewardEntry(session=n, reward=float(i % 3))
                for i, n in enumerate(names[start : start + per_message])
            ],
            sequence=k,
        )
        for k, start in enumerate(range(0, len(names), per_message))
    ]
    acked = asyncio.Semaphore(window)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.SessionServiceStub(channel)

        async def produce() -> AsyncIterator[spb.SubmitRewardsRequest]:
            for request in requests:
                await acked.acquire()
                yield request

        started = time.perf_counter()
        call = stub.SubmitRewards(produce())
        acks = 0
        async for response in call:
            if response.HasField("ack"):
                acks += 1
                acked.release()
                if acks == len(requests):
                    call.cancel()
                    break
        elapsed = time.perf_counter() - started
    return len(names) / elapsed


async def measure(args: argparse.Namespace) -> None:
    header("SubmitRewards throughput, router vs ack-only server")
    print(f"# {args.rewards} rewards per run, groups of {GROUP_SIZE}, median of {args.repeats}")
    trivial = [sys.executable, __file__, "--serve-trivial"]
    print(f"{'entries/msg':>11} {'router rewards/s':>17} {'ack-only rewards/s':>19} {'ratio':>6}")
    for per_message in (1, 256):
        count = args.rewards if per_message > 1 else args.rewards // 4
        ours, base = [], []
        for _ in range(args.repeats):
            with server_process(router_command("--heartbeat-timeout", "3600")) as address:
                names = await make_sessions(address, count)
                ours.append(await drive(address, names, per_message))
            with server_process(trivial) as address:
                base.append(await drive(address, names, per_message))
        print(
            f"{per_message:>11} {median(ours):>17,.0f} {median(base):>19,.0f}"
            f" {median(ours) / median(base):>6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rewards", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-trivial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_trivial:
        asyncio.run(serve_trivial(args.port_file))
    else:
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()

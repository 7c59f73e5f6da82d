"""How much of the router's CPU per reward is the contract's own traffic: the router against
the ack-only server and against a floor server that acks the same way and also sends, with
every ack, a result batch of the router's own making, and does nothing else.

The reward stream's contract sends each request's group results back on the stream (columnar:
one ``GroupResultBatch`` per message). The ack-only baseline of ``bench_rewards.py`` sends
acks only, so the ratio against it mixes two costs: the router's bookkeeping and reduction,
and writing (and the client reading) the results. The floor server pays only the second: it
answers every request with packed ACCEPTED statuses and a copy of a real result batch (taken
once from the router, for a request of the same size), so "router minus floor" is what the
router's own work costs per reward, and "floor against ack-only" is the most any router that
keeps the contract could reach. Same driver as ``bench_rewards.py`` (columnar requests of
handles, raw stubs or the Python client), the three servers alternated, medians.

    .venv/bin/python scripts/bench_reward_floor.py [--repeats 3] [--modes columnar client]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from bench_common import header, median, router_command, serve
from bench_rewards import make_sessions_with_handles, requests_of, run_once, uptime

from sessionrouter.server.core.validation import HANDLE_INDEX_BITS
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc

PER_MESSAGE = 256
BENCH_REWARDS = Path(__file__).with_name("bench_rewards.py")


class FloorServicer(spb_grpc.SessionServiceServicer):
    """Acks every columnar request ACCEPTED per entry and sends ``results`` with the ack."""

    def __init__(self, results: pb.GroupResultBatch) -> None:
        self._results = results

    async def SubmitRewards(  # noqa: N802  (the RPC's name)
        self,
        request_iterator: AsyncIterator[spb.SubmitRewardsRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[spb.SubmitRewardsResponse]:
        async for request in request_iterator:
            count = len(request.columns.rewards)
            ack = spb.RewardAck(
                sequence=request.sequence, statuses=[spb.REWARD_STATUS_ACCEPTED] * count
            )
            yield spb.SubmitRewardsResponse(ack=ack, result_batch=self._results)


async def serve_floor(port_file: str, results: pb.GroupResultBatch) -> None:
    server = grpc.aio.server()
    servicer = FloorServicer(results)  # type: ignore[abstract]
    spb_grpc.add_SessionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))  # noqa: ASYNC240  (once, before serving)
    await server.wait_for_termination()


async def one_result_batch(address: str) -> pb.GroupResultBatch:
    """The result batch a router sends for one columnar request of PER_MESSAGE rewards that
    completes PER_MESSAGE / 8 groups (the rewards 0, 1, 2 repeated, as the benchmark's)."""
    names, handles = await make_sessions_with_handles(address, PER_MESSAGE)
    (request,) = requests_of("columnar", names, handles, PER_MESSAGE)
    async with grpc.aio.insecure_channel(address) as channel:
        call = spb_grpc.SessionServiceStub(channel).SubmitRewards(iter([request]))
        batch = pb.GroupResultBatch()
        async for response in call:
            batch.MergeFrom(response.result_batch)
    if len(batch.group_ids) != PER_MESSAGE // 8:
        raise RuntimeError(f"expected {PER_MESSAGE // 8} group results, got {batch.group_ids}")
    return batch


async def measure(args: argparse.Namespace) -> None:
    header("SubmitRewards: router, ack-only and ack+results floor servers")
    print(f"# uptime before: {uptime()}")
    print(
        f"# {args.rewards} rewards timed per run after {args.warmup} warm-up messages,"
        f" {PER_MESSAGE} per message, groups of 8, median of {args.repeats} (servers"
        " alternated); server CPU from schedstat over the timed window"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results_file = Path(tmp) / "results.bin"
        with serve(router_command("--heartbeat-timeout", "3600")) as router:
            results = await one_result_batch(router.address)
        results_file.write_bytes(results.SerializeToString())
        commands = {
            "router": router_command("--heartbeat-timeout", "3600"),
            "ack-only": [sys.executable, str(BENCH_REWARDS), "--serve-trivial"],
            "floor": [sys.executable, __file__, "--serve-floor", str(results_file)],
        }
        print(
            f"{'mode':>8} {'server':>9} {'rew/s':>11} {'µs CPU/rew':>11}"
            f" {'rew/s vs ack-only':>18} {'CPU vs ack-only':>16}"
        )
        for mode in args.modes:
            rates: dict[str, list[float]] = {name: [] for name in commands}
            cpus: dict[str, list[float]] = {name: [] for name in commands}
            count = args.rewards + args.warmup * PER_MESSAGE
            # The baselines accept any handle: ones of the router's shape (group seq in the
            # high bits, member index in the low 16), so their requests are the same bytes.
            shaped = [((k // 8 + 1) << HANDLE_INDEX_BITS) | (k % 8) for k in range(count)]
            for repeat in range(args.repeats):
                order = list(commands) if repeat % 2 == 0 else list(commands)[::-1]
                for name in order:
                    with serve(commands[name]) as server:
                        handles = shaped
                        if name == "router":
                            _, handles = await make_sessions_with_handles(server.address, count)
                        rate, cpu, _ = await run_once(
                            server, mode, [""] * count, handles, PER_MESSAGE, args.warmup
                        )
                        rates[name].append(rate)
                        cpus[name].append(cpu)
            base_rate, base_cpu = median(rates["ack-only"]), median(cpus["ack-only"])
            for name in commands:
                rate, cpu = median(rates[name]), median(cpus[name])
                print(
                    f"{mode:>8} {name:>9} {rate:>11,.0f} {cpu:>11.2f}"
                    f" {rate / base_rate:>18.2f} {cpu / base_cpu:>16.1f}",
                    flush=True,
                )
    print(f"# uptime after: {uptime()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rewards", type=int, default=100_000, help="rewards timed per run")
    parser.add_argument("--warmup", type=int, default=16, help="messages before the clock")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes", nargs="+", choices=("columnar", "client"), default=["columnar", "client"]
    )
    parser.add_argument("--serve-floor", metavar="RESULTS_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        results = pb.GroupResultBatch.FromString(Path(args.serve_floor).read_bytes())
        asyncio.run(serve_floor(args.port_file, results))
    else:
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()

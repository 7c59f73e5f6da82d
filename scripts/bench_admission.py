"""What the shared staleness budget costs a start: StartGroup/s on 3 shards with and without a
staleness policy, for two lease chunks.

Two deployments of 3 shards run side by side on 127.0.0.1, each with its NATS, 16 static
workers and the routers' default settings (journal on, ``sync=full``), one with
``--admission-lease-chunk 1`` and one with the default chunk (16). Each is driven by the Python
client (``SessionRouterClient.connect([shard addresses])``) with ``--starts`` StartGroup calls
of one member, ``--concurrency`` in flight, spread over the shards, in three modes alternated
round by round so drift hits all alike:

- ``none``: no staleness policy (the baseline: no lease is asked for);
- ``policy``: a policy whose limit the run never reaches, so every start is admitted and each
  shard leases one chunk per ``chunk`` starts (one compare-and-set round trip to NATS each).

It prints the median rate of ``--repeats`` rounds, its ratio to ``none`` of the same
deployment, and the routers' CPU seconds per 1,000 starts (from /proc, over all rounds).

    .venv/bin/python scripts/bench_admission.py [--starts 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, header, median
from bench_shards import cpu_seconds

sys.path.insert(0, str(ROOT))

from sessionrouter.client import SessionRouterClient, StalenessPolicy
from tests.shards._cluster import Cluster

WORKERS = tuple(f"--worker=w{i}=10.0.0.{i}:1,1000000" for i in range(16))


def routers_cpu(cluster: Cluster) -> float:
    return sum(cpu_seconds(s.proc.pid) for s in cluster.shards if s.proc is not None)


async def run_starts(client: SessionRouterClient, starts: int, concurrency: int) -> float:
    """Starts/s of ``starts`` StartGroup calls (groups of one), ``concurrency`` in flight."""
    queue = iter(range(starts))

    async def worker() -> None:
        for _ in queue:
            await client.start_group("bench", 1)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return starts / (time.perf_counter() - began)


async def measure(args: argparse.Namespace, clusters: dict[str, Cluster]) -> None:
    rates: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], float] = {}
    clients = {
        name: SessionRouterClient.connect(c.addresses, default_timeout=60.0)
        for name, c in clusters.items()
    }
    version = 0
    try:
        for _ in range(args.repeats):
            for mode in ("none", "policy"):
                for name, client in clients.items():
                    if mode == "none":
                        await client.set_trainer_state(version, clear_policy=True)
                    else:  # a limit the run never reaches: every start admitted
                        await client.set_trainer_state(
                            version,
                            policy=StalenessPolicy(max_staleness=0, batch_size=1_000_000),
                            reset_counters=True,
                        )
                    await asyncio.sleep(0.5)  # every shard applied it
                    before = routers_cpu(clusters[name])
                    rate = await run_starts(client, args.starts, args.concurrency)
                    cpu[name, mode] = cpu.get((name, mode), 0.0) + (
                        routers_cpu(clusters[name]) - before
                    )
                    rates.setdefault((name, mode), []).append(rate)
                version += 1
    finally:
        for client in clients.values():
            await client.close()
    total = args.starts * args.repeats / 1000
    print(f"{'deployment':<10} {'mode':<7} {'starts/s':>9} {'vs none':>8} {'CPU s/1k':>9}")
    for name in clients:
        base = median(rates[name, "none"])
        for mode in ("none", "policy"):
            rate = median(rates[name, mode])
            print(
                f"{name:<10} {mode:<7} {rate:>9,.0f} {rate / base:>8.2f}"
                f" {cpu[name, mode] / total:>9.2f}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=1500, help="starts per measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians are quoted)")
    args = parser.parse_args()
    header("bench_admission: StartGroup/s on 3 shards, staleness policy on and off")
    print(f"# load before: {Path('/proc/loadavg').read_text().strip()}")
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        clusters = {
            "chunk 1": Cluster(
                Path(tmp) / "c1", 3, *WORKERS, "--admission-lease-chunk", "1", journal_sync=None
            ),
            "chunk 16": Cluster(Path(tmp) / "c16", 3, *WORKERS, journal_sync=None),
        }
        try:
            for cluster in clusters.values():
                cluster.start()
            asyncio.run(measure(args, clusters))
        finally:
            for cluster in clusters.values():
                cluster.stop()
    print(f"# load after: {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What each shard adds: StartSession/s and rewards/s with 1, 2 and 3 shards, at default settings.

Three deployments run side by side on 127.0.0.1 for the whole run: one router (the embedded
default, no NATS: the baseline), 2 shards with their NATS, 3 shards with theirs; every router at
its default settings (journal on, ``sync=full``) with the same 16 static workers, and an nginx
shard map (``sessionrouter.client.nginx_shard_map``) in front of each. Each is driven two ways
by the Python client: directly (``SessionRouterClient.connect([shard addresses])``, which
routes by group itself) and through nginx (one address, ``x-group-id`` on every call).

Workloads, per deployment and way, alternated round by round so drift hits all alike:

- StartSession: ``--sessions`` sessions as groups of 8, each member joined by its own
  StartSession call, ``--concurrency`` calls in flight;
- rewards: the same number of sessions, started by StartGroup beforehand, then one reward
  each over the client's reward stream (one SubmitRewards stream per shard), submitted in
  batches of 256 by 4 concurrent submitters; timed until every ack is in.

It prints the median rate of ``--repeats`` rounds, the ratio to the 1-router baseline of the
same way in the same run, and the CPU seconds per 1,000 operations that the routers, NATS and
nginx spent (from /proc, over all rounds): the basis of the README's projection for more
cores. On 2 cores the client, every shard, NATS and nginx share two CPUs, so more shards
cannot add throughput here; the figures show what sharding costs, not how it scales.

    .venv/bin/python scripts/bench_shards.py [--sessions 2400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import ROOT, header, median

sys.path.insert(0, str(ROOT))

from sessionrouter.client import SessionRouterClient
from tests.shards._cluster import Cluster, ShardMapNginx, ShardProcess

GROUP = 8
WORKERS = tuple(f"--worker=w{i}=10.0.0.{i}:1,1000000" for i in range(16))
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its children (nginx's worker), in seconds."""
    pids = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    pids.append(int(entry.name))
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


@dataclass
class Deployment:
    """One router or N shards (with NATS), and nginx in front."""

    shards: int
    base: Path
    cluster: Cluster | None = None
    single: ShardProcess | None = None
    nginx: ShardMapNginx | None = None
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def addresses(self) -> list[str]:
        if self.cluster is not None:
            return self.cluster.addresses
        assert self.single is not None
        return [self.single.address]

    def start(self) -> None:
        if self.shards == 1:
            self.single = ShardProcess(
                self.base / "router", "--state-dir", str(self.base / "router" / "state"), *WORKERS
            )
            self.single.start()
            self.nginx = ShardMapNginx(self.base / "nginx", self.addresses)
            self.nginx.start()
        else:
            self.cluster = Cluster(self.base, self.shards, *WORKERS, journal_sync=None)
            self.cluster.start()
            self.nginx = self.cluster.nginx

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        else:
            if self.nginx is not None:
                self.nginx.stop()
            if self.single is not None:
                self.single.stop()

    def processes(self) -> dict[str, int]:
        """Role -> pid, for CPU accounting."""
        pids: dict[str, int] = {}
        shards = self.cluster.shards if self.cluster is not None else [self.single]
        for i, shard in enumerate(shards):
            assert shard is not None
            assert shard.proc is not None
            pids[f"router{i}"] = shard.proc.pid
        if self.cluster is not None and self.cluster.nats.proc is not None:
            pids["nats"] = self.cluster.nats.proc.pid
        if self.nginx is not None and self.nginx.proc is not None:
            pids["nginx"] = self.nginx.proc.pid
        return pids

    def client(self, way: str) -> SessionRouterClient:
        if way == "direct":
            return SessionRouterClient.connect(self.addresses, default_timeout=60.0)
        assert self.nginx is not None
        return SessionRouterClient.connect(
            self.nginx.target, shard_count=self.shards, default_timeout=60.0
        )


async def start_sessions(client: SessionRouterClient, sessions: int, concurrency: int) -> float:
    """StartSession calls per second: groups of 8 joined member by member."""
    run = uuid.uuid4().hex[:8]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for n in range(sessions):
        queue.put_nowait(f"b-{run}-{n // GROUP}")

    async def caller() -> None:
        while not queue.empty():
            group = queue.get_nowait()
            await client.start_session("bench", group_id=group, group_size=GROUP)

    began = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return sessions / (time.perf_counter() - began)


async def submit_rewards(client: SessionRouterClient, sessions: int, concurrency: int) -> float:
    """Rewards per second over the client's reward stream (one stream per shard)."""
    run = uuid.uuid4().hex[:8]
    groups = [f"r-{run}-{g}" for g in range(sessions // GROUP)]
    names: list[str] = []
    queue: asyncio.Queue[str] = asyncio.Queue()
    for group in groups:
        queue.put_nowait(group)

    async def starter() -> None:
        while not queue.empty():
            started = await client.start_group("bench", GROUP, group_id=queue.get_nowait())
            names.extend(s.name for s in started.sessions)

    await asyncio.gather(*(starter() for _ in range(concurrency)))
    batches = [names[i : i + 256] for i in range(0, len(names), 256)]
    async with client.reward_stream(keep_results=False) as stream:
        began = time.perf_counter()

        async def submitter(k: int) -> None:
            for batch in batches[k::4]:
                results = await stream.submit_many((n, float(i % 3)) for i, n in enumerate(batch))
                assert all(r.ok for r in results), results[:3]

        await asyncio.gather(*(submitter(k) for k in range(4)))
        elapsed = time.perf_counter() - began
    return len(names) / elapsed


def deployments(base: Path) -> Iterator[Deployment]:
    for shards in (1, 2, 3):
        yield Deployment(shards, base / f"n{shards}")


async def measure(args: argparse.Namespace, deps: list[Deployment]) -> None:
    ways = ("direct", "nginx")
    rates: dict[tuple[str, int, str], list[float]] = {}
    ops: dict[int, int] = {d.shards: 0 for d in deps}
    for _ in range(args.repeats):
        for workload, run in (("start", start_sessions), ("rewards", submit_rewards)):
            for way in ways:
                for dep in deps:
                    # CPU is counted inside the deployment's own measurements only, so the
                    # idle loops of the others running meanwhile are not charged to it.
                    pids = dep.processes()
                    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
                    async with dep.client(way) as client:
                        rate = await run(client, args.sessions, args.concurrency)
                    for role, pid in pids.items():
                        spent = cpu_seconds(pid) - before[role]
                        dep.cpu[role] = dep.cpu.get(role, 0.0) + spent
                    rates.setdefault((workload, dep.shards, way), []).append(rate)
                    ops[dep.shards] += args.sessions

    print()
    print("| workload | way | shards | median /s | vs 1 router | rounds |")
    print("|---|---|---:|---:|---:|---|")
    for workload, label in (("start", "StartSession"), ("rewards", "rewards")):
        for way in ways:
            base = median(rates[(workload, 1, way)])
            for dep in deps:
                values = rates[(workload, dep.shards, way)]
                shown = ", ".join(f"{v:,.0f}" for v in values)
                print(
                    f"| {label} | {way} | {dep.shards} | {median(values):,.0f} |"
                    f" {median(values) / base:.2f} | {shown} |"
                )
    print()
    print(
        "CPU seconds per 1,000 sessions (one StartSession each, or one eighth of a StartGroup"
        " and one reward), both ways, all rounds:"
    )
    print("| shards | routers (sum) | per router | NATS | nginx |")
    print("|---:|---:|---:|---:|---:|")
    for dep in deps:
        per_k = 1000 / ops[dep.shards]
        routers = sum(v for r, v in dep.cpu.items() if r.startswith("router"))
        print(
            f"| {dep.shards} | {routers * per_k:.3f} | {routers * per_k / dep.shards:.3f} |"
            f" {dep.cpu.get('nats', 0.0) * per_k:.3f} | {dep.cpu.get('nginx', 0.0) * per_k:.3f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2400, help="sessions per measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians are quoted)")
    args = parser.parse_args()
    header("sharded routers: StartSession and rewards with 1, 2 and 3 shards")
    print(f"# uptime: {Path('/proc/loadavg').read_text().strip()}")
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        deps = list(deployments(Path(tmp)))
        try:
            for dep in deps:
                dep.start()
            asyncio.run(measure(args, deps))
        finally:
            for dep in deps:
                dep.stop()
    print(f"# load after: {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

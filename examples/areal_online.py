"""An AReaL-shaped online RL loop: the trainer hands out group ids, agents join them.

In online mode the rollouts are not run by the trainer: independent agent processes (users,
environment servers, tool-using agents) start sessions, "generate" on the inference worker
they are given, and report a reward. The trainer only decides *which* groups it wants (one
group id per prompt and step, ``group_size`` samples each) and consumes the finished groups,
with their advantages, from the router's feed. Membership is the router's job: the agents name
the group, the router refuses a ninth member, a wrong size or another task, and places the
members of a group on distinct workers.

    python examples/areal_online.py --address 127.0.0.1:50051           # the trainer
    python examples/areal_online.py agent --address ... --group-id ...  # one agent (spawned)

The trainer spawns every agent as a separate ``python`` process (``asyncio`` subprocesses, at
most ``--parallel`` at a time), waits for each step's groups on the feed, applies a stand-in
policy update and prints one JSON line per step and a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from sessionrouter.client import GroupResult, SessionRouterClient

DEFAULT_ADDRESS = os.environ.get("SESSIONROUTER_ADDRESS", "127.0.0.1:50051")
THIS_PROGRAM = str(Path(__file__).resolve())
STEP_TIMEOUT_S = 60.0
"""Seconds a step's groups may take to reach the feed once all its agents have reported."""


# --- the agent: one process, one session -------------------------------------------------------


async def run_agent(address: str, group_id: str, task_id: str, group_size: int) -> None:
    """Joins ``group_id``, "generates" on the worker it was given, and reports its reward.

    The reward is a noisy correctness score of a toy arithmetic answer, so the members of one
    group disagree (and some groups, by chance, all agree: degenerate, zero advantages).
    """
    async with SessionRouterClient.connect(address) as client:
        started = await client.start_session(
            task_id,
            group_id=group_id,
            group_size=group_size,
            metadata={"agent_pid": str(os.getpid())},
        )
        session = started.session
        rng = random.Random(session.name)
        await asyncio.sleep(rng.uniform(0.0, 0.05))  # the generation call to worker_address
        a, b = (int(x) for x in task_id.rsplit("-", 2)[-2:])
        answer = a + b if rng.random() < 0.6 else a + b + rng.choice((-1, 1))
        reward = 1.0 if answer == a + b else 0.0
        (ack,) = (await client.submit_rewards({session.name: reward})).results
        if not ack.ok:
            raise SystemExit(
                f"agent {session.name}: reward refused: {ack.status.name} {ack.detail}"
            )


# --- the trainer ---------------------------------------------------------------------------------


def step_groups(run_id: str, step: int, prompts: int) -> dict[str, str]:
    """The group ids of one step, each with its task id (a toy prompt ``add-A-B``)."""
    rng = random.Random(f"{run_id}/{step}")
    return {
        f"{run_id}-step{step}-p{k}": f"add-{rng.randrange(100)}-{rng.randrange(100)}"
        for k in range(prompts)
    }


async def spawn_agents(
    address: str, groups: dict[str, str], group_size: int, parallel: asyncio.Semaphore
) -> list[int]:
    """Starts ``group_size`` agent processes per group; returns their exit codes."""

    async def one(group_id: str, task_id: str) -> int:
        async with parallel:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                THIS_PROGRAM,
                "agent",
                *("--address", address, "--group-id", group_id),
                *("--task-id", task_id, "--group-size", str(group_size)),
            )
            return await proc.wait()

    return await asyncio.gather(*(one(g, t) for g, t in groups.items() for _ in range(group_size)))


async def take_groups(
    feed: AsyncIterator[GroupResult], groups: dict[str, str], consumed: dict[str, GroupResult]
) -> list[GroupResult]:
    """Reads the feed until every group of ``groups`` came by; others' groups pass."""
    batch: list[GroupResult] = []
    async for group in feed:
        if group.group_id in groups:
            if group.group_id in consumed:
                raise RuntimeError(f"group {group.group_id} delivered twice")
            consumed[group.group_id] = group
            batch.append(group)
            if len(batch) == len(groups):
                break
    return batch


def policy_update(batch: list[GroupResult]) -> dict[str, float]:
    """A stand-in for the gradient step: the numbers a trainer would log for this batch."""
    used = [g for g in batch if not g.degenerate]
    advantages = [a for g in used for a in g.advantages]
    return {
        "groups_used": len(used),
        "groups_degenerate": len(batch) - len(used),
        "samples": len(advantages),
        "mean_reward": sum(r for g in batch for r in g.rewards)
        / max(1, sum(len(g.rewards) for g in batch)),
        "max_abs_advantage": max((abs(a) for a in advantages), default=0.0),
    }


async def run_trainer(
    address: str, *, steps: int, prompts: int, group_size: int, parallel: int, after_cursor: int
) -> dict[str, object]:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    limit = asyncio.Semaphore(parallel)
    consumed: dict[str, GroupResult] = {}
    async with SessionRouterClient.connect(address) as client:
        feed = client.subscribe_groups(after_cursor=after_cursor)
        async with contextlib.aclosing(feed):
            for step in range(steps):
                groups = step_groups(run_id, step, prompts)
                # The feed is read while the agents run; a failed agent ends the step at once
                # rather than leave the trainer waiting for the group's deadline.
                batch_task = asyncio.create_task(take_groups(feed, groups, consumed))
                codes = await spawn_agents(address, groups, group_size, limit)
                if any(codes):
                    batch_task.cancel()
                    raise RuntimeError(f"agents failed with exit codes {sorted(set(codes))}")
                batch = await asyncio.wait_for(batch_task, STEP_TIMEOUT_S)
                print(json.dumps({"step": step, **policy_update(batch)}), flush=True)
        members = {g: await client.get_group(g) for g in consumed}
    return {
        "run_id": run_id,
        "groups": {
            g: {
                "outcome": r.outcome.name,
                "cursor": r.cursor,
                "sessions": list(r.sessions),
                "rewards": list(r.rewards),
                "advantages": list(r.advantages),
                "degenerate": r.degenerate,
                "workers": [m.worker_id for m in members[g].members],
                "agent_pids": [m.metadata.get("agent_pid", "") for m in members[g].members],
            }
            for g, r in consumed.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", choices=("trainer", "agent"), default="trainer")
    parser.add_argument("--address", default=DEFAULT_ADDRESS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=8, help="agent processes at a time")
    parser.add_argument("--after-cursor", type=int, default=0, help="where the feed starts")
    parser.add_argument("--group-id", help="agent: the group to join")
    parser.add_argument("--task-id", help="agent: the group's task")
    args = parser.parse_args(argv)
    if args.role == "agent":
        asyncio.run(run_agent(args.address, args.group_id, args.task_id, args.group_size))
        return 0
    summary = asyncio.run(
        run_trainer(
            args.address,
            steps=args.steps,
            prompts=args.prompts,
            group_size=args.group_size,
            parallel=args.parallel,
            after_cursor=args.after_cursor,
        )
    )
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

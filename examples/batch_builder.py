"""A verl/TRL-shaped consumer: the router's feed turned into the arrays of one trainer step.

Trainers such as verl and TRL's GRPOTrainer hold a step's rollouts as a flat batch of
``B * G`` samples (B prompts, G samples each), with one advantage per sample that is then
broadcast over the sample's response tokens (``advantages[:, None] * response_mask``). The
router already computed the advantages per group; what is left is laying them out:

- every sample slot ``b * G + i`` is member ``i`` of the b-th group kept, so the advantages line
  up with the rollouts the trainer keeps by session (``sessions[k]`` names slot ``k``);
- degenerate groups (all rewards equal: zero advantages, no signal) and dropped groups are
  left out of the batch and counted, as DAPO-style dynamic sampling does;
- a partial group keeps its slots: the members that count get their advantage and
  ``mask = True``, the excluded ones (aborted, or no reward by the deadline) ``mask = False``
  and advantage 0, so the loss ignores them without reshaping the batch.

Run against a router (``make run``), it plays a small scenario (a complete, a degenerate, a
partial, a dropped and another complete group), reads them back from the feed and prints the
batch as JSON:

    python examples/batch_builder.py --address 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sessionrouter.client import GroupOutcome, GroupResult, SessionRouterClient

DEFAULT_ADDRESS = os.environ.get("SESSIONROUTER_ADDRESS", "127.0.0.1:50051")


@dataclass(frozen=True)
class TrainBatch:
    """One trainer step's worth of groups, as flat arrays of ``n = B * G`` sample slots.

    Slot ``k`` holds member ``k % G`` of group ``group_ids[k // G]``; ``reshape(B, G)`` gives
    the per-group view. float64 throughout.
    """

    group_size: int
    group_ids: list[str]
    """(B,) the groups kept, in feed order."""
    sessions: list[str]
    """(n,) the session of each slot; "" for a member that never joined."""
    rewards: npt.NDArray[np.float64]
    """(n,) the reward of each counted slot, 0.0 where ``mask`` is False."""
    advantages: npt.NDArray[np.float64]
    """(n,) the router's advantage of each counted slot, 0.0 where ``mask`` is False."""
    mask: npt.NDArray[np.bool_]
    """(n,) True for a slot whose sample counts in the loss."""
    group_index: npt.NDArray[np.int64]
    """(n,) the row of each slot's group in ``group_ids``."""
    skipped: dict[str, list[str]] = field(default_factory=dict)
    """Groups left out, by why: ``degenerate`` and ``dropped``."""


def member_index(session: str) -> int:
    """The member index in a session name ``groups/{group_id}/sessions/{index}``."""
    return int(session.rsplit("/", 1)[1])


def build_batch(
    groups: Sequence[GroupResult], group_size: int, *, keep_degenerate: bool = False
) -> TrainBatch:
    """Lays ``groups`` out as a ``TrainBatch`` of ``len(kept) * group_size`` slots."""
    kept: list[GroupResult] = []
    skipped: dict[str, list[str]] = {"degenerate": [], "dropped": []}
    for group in groups:
        if group.group_size != group_size:
            raise ValueError(
                f"group {group.group_id} has size {group.group_size}, not {group_size}"
            )
        if group.outcome is GroupOutcome.DROPPED:
            skipped["dropped"].append(group.group_id)
        elif group.degenerate and not keep_degenerate:
            skipped["degenerate"].append(group.group_id)
        else:
            kept.append(group)
    n = len(kept) * group_size
    sessions = [""] * n
    rewards = np.zeros(n, dtype=np.float64)
    advantages = np.zeros(n, dtype=np.float64)
    mask = np.zeros(n, dtype=np.bool_)
    for row, group in enumerate(kept):
        base = row * group_size
        counted = np.array([base + member_index(s) for s in group.sessions], dtype=np.int64)
        rewards[counted] = group.rewards_array
        advantages[counted] = group.advantages_array
        mask[counted] = True
        for session in (*group.sessions, *group.excluded_sessions):
            sessions[base + member_index(session)] = session
    return TrainBatch(
        group_size=group_size,
        group_ids=[g.group_id for g in kept],
        sessions=sessions,
        rewards=rewards,
        advantages=advantages,
        mask=mask,
        group_index=np.repeat(np.arange(len(kept), dtype=np.int64), group_size),
        skipped=skipped,
    )


# --- a scenario to build a batch from ------------------------------------------------------------

SCENARIO: dict[str, list[float | None]] = {
    "complete": [1.0, 0.0, 0.5, 1.0],
    "degenerate": [1.0, 1.0, 1.0, 1.0],
    "partial": [0.2, None, 0.9, 0.4],  # None: the member is aborted (its rollout failed)
    "dropped": [None, None, 0.7, None],  # one reward, fewer than min_members (2)
    "complete-2": [0.1, 0.3, 0.6, 1.0],
}
"""Rewards by member index of each group this program plays."""


async def play(client: SessionRouterClient, run_id: str) -> dict[str, str]:
    """Starts the scenario's groups one by one and ends each; returns group id by name."""
    ids = {}
    for name, rewards in SCENARIO.items():
        started = await client.start_group(
            f"task-{name}", len(rewards), group_id=f"{run_id}-{name}"
        )
        ids[name] = started.group_id
        scored = {
            s.name: r for s, r in zip(started.sessions, rewards, strict=True) if r is not None
        }
        for session, reward in zip(started.sessions, rewards, strict=True):
            if reward is None:
                await client.abort_session(session.name, reason="rollout failed")
        results = (await client.submit_rewards(scored)).results
        if not all(r.ok for r in results):
            raise RuntimeError(f"rewards refused: {results}")
    return ids


async def collect(
    client: SessionRouterClient, group_ids: set[str], after_cursor: int
) -> list[GroupResult]:
    """The results of ``group_ids`` from the feed, in feed order."""
    got: list[GroupResult] = []
    feed = client.subscribe_groups(after_cursor=after_cursor)
    async with contextlib.aclosing(feed):
        async for group in feed:
            if group.group_id in group_ids:
                got.append(group)
                if len(got) == len(group_ids):
                    break
    return got


async def run(address: str, after_cursor: int) -> dict[str, object]:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    async with SessionRouterClient.connect(address) as client:
        ids = await play(client, run_id)
        groups = await collect(client, set(ids.values()), after_cursor)
    batch = build_batch(groups, group_size=4)
    return {
        "run_id": run_id,
        "group_ids": ids,
        "batch": {
            "group_ids": batch.group_ids,
            "sessions": batch.sessions,
            "rewards": batch.rewards.tolist(),
            "advantages": batch.advantages.tolist(),
            "mask": batch.mask.tolist(),
            "group_index": batch.group_index.tolist(),
            "skipped": batch.skipped,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=DEFAULT_ADDRESS)
    parser.add_argument("--after-cursor", type=int, default=0, help="where the feed starts")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.address, args.after_cursor))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

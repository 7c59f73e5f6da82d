"""The programs in examples/ run as written against a real router, and compute the right thing.

Each runs as its own process (the AReaL-shaped one spawns further agent processes) against a
router process on 127.0.0.1:0; the tests check their JSON output against references computed
here with plain loops.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.examples.programs import ROOT, example_router, run_program

EXAMPLES = ROOT / "examples"
EPS = 1e-6  # the router's default GRPO eps; ddof 1


def grpo_reference(rewards: list[float]) -> list[float]:
    """GRPO advantages as the README defines them, one member at a time."""
    if len(rewards) < 2 or len(set(rewards)) == 1:
        return [0.0] * len(rewards)
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + EPS) for r in rewards]


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with example_router(tmp_path_factory.mktemp("router"), persist=False, workers=8) as addr:
        yield addr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_areal_online_agents_join_the_trainers_groups(address: str, tmp_path: Path) -> None:
    done = run_program(
        [sys.executable, EXAMPLES / "areal_online.py", "--steps", "2", "--prompts", "2"],
        address,
        cwd=tmp_path,
        timeout_s=200,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    steps, summary = lines[:-1], lines[-1]["summary"]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(s["groups_used"] + s["groups_degenerate"] == 2 for s in steps)
    groups = summary["groups"]
    # Every group the trainer asked for came back once, whole, from the feed.
    assert sorted(groups) == sorted(
        f"{summary['run_id']}-step{step}-p{k}" for step in (0, 1) for k in (0, 1)
    )
    assert len({g["cursor"] for g in groups.values()}) == 4
    all_pids: set[str] = set()
    for group_id, g in groups.items():
        assert g["outcome"] == "COMPLETE"
        assert g["sessions"] == [f"groups/{group_id}/sessions/{i}" for i in range(4)]
        # Four independent agent processes joined it, each placed on its own worker.
        assert len(set(g["agent_pids"])) == 4 and str(os.getpid()) not in g["agent_pids"]
        assert len(set(g["workers"])) == 4
        all_pids |= set(g["agent_pids"])
        assert set(g["rewards"]) <= {0.0, 1.0}
        assert g["degenerate"] == (len(set(g["rewards"])) == 1)
        assert g["advantages"] == pytest.approx(grpo_reference(g["rewards"]), abs=1e-12)
    assert len(all_pids) == 16


@pytest.mark.timeout(120)
def test_batch_builder_lays_out_a_trainer_step(address: str, tmp_path: Path) -> None:
    done = run_program([sys.executable, EXAMPLES / "batch_builder.py"], address, cwd=tmp_path)
    out = json.loads(done.stdout)
    ids, batch = out["group_ids"], out["batch"]
    # Degenerate and dropped groups are left out; the rest keep feed order.
    assert batch["group_ids"] == [ids["complete"], ids["partial"], ids["complete-2"]]
    assert batch["skipped"] == {"degenerate": [ids["degenerate"]], "dropped": [ids["dropped"]]}
    scenario: dict[str, list[float | None]] = {
        "complete": [1.0, 0.0, 0.5, 1.0],
        "partial": [0.2, None, 0.9, 0.4],
        "complete-2": [0.1, 0.3, 0.6, 1.0],
    }
    sessions, mask, rewards, advantages = [], [], [], []
    for name, member_rewards in scenario.items():
        counted = [r for r in member_rewards if r is not None]
        reference = iter(grpo_reference(counted))
        for i, r in enumerate(member_rewards):
            sessions.append(f"groups/{ids[name]}/sessions/{i}")
            mask.append(r is not None)
            rewards.append(0.0 if r is None else r)
            advantages.append(0.0 if r is None else next(reference))
    # Slot k is member k % 4 of group k // 4: advantages aligned with the sessions, the
    # aborted member of the partial group masked out with a zero advantage.
    assert batch["sessions"] == sessions
    assert batch["mask"] == mask
    assert batch["rewards"] == rewards
    assert batch["advantages"] == pytest.approx(advantages, abs=1e-12)
    assert batch["group_index"] == [0] * 4 + [1] * 4 + [2] * 4

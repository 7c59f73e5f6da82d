"""Every ```python block of the README is a complete program that runs as written.

Each block runs as a script (``python block.py``), in README order, twice in a row against one
router with a persisted journal: the second run meets the groups, cursors and files the first
left behind, as a user who runs an example again does. Warnings are errors.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.examples.programs import ROOT, example_router, run_program

README = ROOT / "README.md"


def readme_programs(readme: Path = README) -> list[str]:
    """The ```python blocks of ``readme``, in order."""
    return re.findall(r"^```python\n(.*?)^```", readme.read_text(), flags=re.S | re.M)


def write_programs(directory: Path) -> list[Path]:
    paths = []
    for n, source in enumerate(readme_programs(), start=1):
        path = directory / f"readme_{n}.py"
        path.write_text(source)
        paths.append(path)
    return paths


def test_the_readme_has_trainer_programs() -> None:
    programs = readme_programs()
    assert len(programs) >= 3
    assert all("asyncio.run(main())" in p for p in programs)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readme_programs_run_twice_against_a_persisted_router(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    programs = write_programs(work)
    outputs: list[list[str]] = []
    with example_router(tmp_path, persist=True) as address:
        for _ in range(2):
            outputs.append(
                [run_program([sys.executable, p], address, cwd=work).stdout for p in programs]
            )
    check_outputs(outputs)


def check_outputs(outputs: list[list[str]]) -> None:
    """What the five README programs print, run after run (see README.md)."""
    for run, (group, joined, feed, arrays, placed) in enumerate(outputs, start=1):
        assert " COMPLETE [" in group, group
        assert joined.startswith("8 distinct workers COMPLETE"), joined
        # The feed follower resumes after the cursor of the previous run: each run consumes
        # the two groups the two programs before it made, and from the second run on the
        # array program's four groups and the placement program's group of the run before.
        consumed, cursor = (2, 2) if run == 1 else (7, 7 * run - 5)
        assert feed.rstrip().endswith(
            f"{consumed} groups consumed; the next run resumes after cursor {cursor}"
        ), feed
        assert arrays.startswith("4 groups in "), arrays
        assert "advantage sums per group" in arrays and "/sessions/0 " in arrays, arrays
        assert placed.startswith("2 workers for 8 members"), placed
        assert "COMPLETE ('groups/" in placed and "degenerate: True" in placed, placed
        assert placed.rstrip().endswith("1 degenerate group(s) skipped"), placed

"""A few seconds of the ghz load test (scripts/ghz/loadtest.py --profile smoke): the router and
the trivial baseline both answer every StartSession, StartGroup and SubmitRewards call, the
reports parse, every reward stream finalizes its group, and the throughput ratio is printed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ._server import REPO_ROOT
from ._toolchain import make, require_tools

LOADTEST = REPO_ROOT / "scripts" / "ghz" / "loadtest.py"
GHZ = REPO_ROOT / ".tools" / "bin" / "ghz"


@pytest.mark.interop
@pytest.mark.slow
@pytest.mark.timeout(600)  # a cold `make ghz` compiles ghz first
def test_ghz_smoke_router_and_trivial_server(tmp_path: Path) -> None:
    require_tools("go")
    make("ghz")

    done = subprocess.run(
        [
            sys.executable,
            str(LOADTEST),
            "--profile",
            "smoke",
            "--ghz",
            str(GHZ),
            "--reports-dir",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    print(output)  # the summary, shown with -rP or on failure
    assert done.returncode == 0, output

    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {row["scenario"]: row for row in summary["scenarios"]}
    assert set(rows) == {"start_session", "start_group", "submit_rewards"}
    for name, row in rows.items():
        for server in ("real", "trivial"):
            measured = row[server]
            report = json.loads(Path(measured["report"]).read_text())
            assert report["count"] == measured["count"] > 0, (name, server)
            assert measured["rps"] > 0, (name, server)
            assert measured["non_ok_share"] == 0, (name, server, measured["status_codes"])
        assert math.isfinite(row["ratio"]), row
        assert row["ratio"] > 0, row
        assert f"ratio {row['ratio']:.2f}" in done.stdout, output
    # ghz cannot see per-entry reward statuses; the router's own count of finalized groups can.
    assert summary["finalized_groups"] == summary["reward_streams"], summary

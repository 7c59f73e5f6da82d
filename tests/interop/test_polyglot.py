"""Clients in Go, Node and Java, built from protos/, run the interop scenario against a real
router: 4 workers, one group of 4 formed by concurrent StartSession calls on distinct workers,
a conflicting group_size refused, rewards with a bad entry and a NaN on one stream, GRPO
advantages checked against numbers each client computes itself, and a weight update of one
worker begun with one call during which no probe group is placed on it (clients/*/,
mk/polyglot.mk).
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator

import pytest

from sessionrouter.client.shardmap import shard_of
from tests.shards._cluster import Cluster, running

from ._server import REPO_ROOT, running_server
from ._toolchain import make, require_tools

CLIENT_TIMEOUT_S = 90


@dataclasses.dataclass(frozen=True)
class Client:
    tools: tuple[str, ...]
    make_target: str
    argv: tuple[str, ...]


CLIENTS = {
    "go": Client(("go",), "interop-go", ("clients/go/bin/interop-client",)),
    "node": Client(("node", "npm"), "interop-node", ("node", "clients/node/client.mjs")),
    "java": Client(
        ("java", "mvn"), "interop-java", ("java", "-jar", "clients/java/target/interop-client.jar")
    ),
}


def run_client(language: str, address: str) -> None:
    """Runs the language's scenario against ``address``; fails with its output."""
    client = CLIENTS[language]
    try:
        done = subprocess.run(
            [*client.argv, address],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the {language} client ran over {CLIENT_TIMEOUT_S} s:\n{e.output!r}")
    output = f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    assert done.returncode == 0, f"the {language} client exited with {done.returncode}\n{output}"
    assert f"{language} interop client: OK" in done.stdout, output
    if language == "go":  # the Go scenario also submits and reads the columnar form
        assert "columnar ack: statuses" in done.stdout and "columnar result:" in done.stdout, output


@pytest.mark.interop
@pytest.mark.timeout(600)  # a cold Maven or Go build downloads its dependencies first
@pytest.mark.parametrize("language", sorted(CLIENTS))
def test_client_runs_the_scenario_against_the_router(language: str) -> None:
    client = CLIENTS[language]
    require_tools(*client.tools)
    make(client.make_target)

    with running_server("real") as address:
        run_client(language, address)


@pytest.fixture(scope="module")
def shard_map(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """3 shards with NATS, and nginx hashing x-group-id over them on a TCP port."""
    with running(Cluster(tmp_path_factory.mktemp("interop-shards"), 3, nginx_tcp=True)) as c:
        yield c


@pytest.mark.interop
@pytest.mark.timeout(600)
@pytest.mark.parametrize("language", sorted(CLIENTS))
def test_client_runs_the_scenario_through_the_nginx_shard_map(
    language: str, shard_map: Cluster
) -> None:
    """The same scenario, unchanged, through nginx in front of 3 shards: the group's calls
    reach its owner by their x-group-id, the worker calls any shard (one shared pool, with
    its weight updates)."""
    client = CLIENTS[language]
    require_tools(*client.tools)
    make(client.make_target)
    before = len(shard_map.nginx.access_log())
    run_client(language, shard_map.nginx.target)
    calls = shard_map.nginx.access_log()[before:]
    keyed = {(key, upstream) for key, upstream, _ in calls if key not in ("", "-")}
    groups = {key for key, _ in keyed}
    # Every call about a group named it (the Go scenario has a second, columnar group; each
    # scenario probes placement during a weight update with 9 more), and each reached that
    # group's owner.
    probes = {key for key in groups if "-update-" in key}
    assert len(probes) == 9, keyed
    assert len(groups - probes) == (2 if language == "go" else 1), keyed
    for group in groups:
        owner = shard_map.addresses[shard_of(group, 3)]
        assert {upstream for key, upstream in keyed if key == group} == {owner}, keyed

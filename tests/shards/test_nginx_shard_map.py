"""nginx itself computes ``shard_of``: the generated shard map over three real routers.

The routers run unsharded here (each accepts any group), so where a group ends up is nginx's
choice alone: after a few hundred StartGroup calls through nginx, each router's own
``ListGroups`` holds exactly the ids that ``shard_of(id, 3)`` gives it. Ids beyond what a
router accepts (unicode) are sent with curl, which puts raw UTF-8 in the header, and nginx's
access log says which upstream each went to. And a shard that is down keeps its keys: nginx
answers 502 (UNAVAILABLE) for them and never moves them to a live shard.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessionrouter.client import (
    NotFoundError,
    RetryPolicy,
    SessionRouterClient,
    UnavailableError,
)
from sessionrouter.client.nginx_shard_map import main as generator_main
from sessionrouter.client.nginx_shard_map import server_block, upstream_block
from sessionrouter.client.shardmap import shard_of

from ._cluster import ShardMapNginx, ShardProcess

N = 3
ONE_TRY = RetryPolicy(max_attempts=1)
UNICODE_KEYS = [
    "ü-unicode",
    "日本語のグループ",
    "emoji-🎲-group",
    "Ελληνικά",
    "\u00e9t\u00e9-2026",
    "кириллица-42",
    "mixed-ascii-and-ß",
    "العربية",
    "a\\b",  # nginx escapes the backslash in its log too
    'quote"d',
    "spaces in a key",
    "",  # no header at all: round-robin, checked below
]


@pytest.fixture(scope="module")
def shard_map(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[list[ShardProcess], ShardMapNginx]]:
    """Three unsharded routers (in memory, 2 static workers each) behind the shard map."""
    base = tmp_path_factory.mktemp("nginx-shard-map")
    workers = [f"--worker=w{i}=10.0.0.{i}:1,100000" for i in range(2)]
    routers = [ShardProcess(base / f"r{i}", "--in-memory", *workers) for i in range(N)]
    nginx = ShardMapNginx(base / "nginx", [])
    try:
        for router in routers:
            router.launch()
        nginx.shards = [router.wait_serving() for router in routers]
        nginx.start()
        yield routers, nginx
    finally:
        nginx.stop()
        for router in routers:
            router.stop()
        print("--- nginx error log ---", nginx.error_log())


def test_generated_config_has_the_settings_that_keep_groups_on_their_shard() -> None:
    upstream = upstream_block(["10.0.0.1:50051", "10.0.0.2:50051"])
    assert "hash $http_x_group_id;" in upstream and "consistent" not in upstream.split("#")[0]
    assert upstream.count("max_fails=0") == 2
    assert upstream.index("10.0.0.1:50051") < upstream.index("10.0.0.2:50051")  # shard order
    server = server_block("8443")
    assert "listen 8443 http2;" in server and "grpc_pass grpc://" in server
    assert "grpc_next_upstream off;" in server
    with pytest.raises(ValueError, match="at least one"):
        upstream_block([])


def test_the_generator_prints_a_config_nginx_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.integration.processes import nginx_binary

    assert generator_main(["--full", str(tmp_path), "--listen", "127.0.0.1:1", "a:1", "b:2"]) == 0
    conf = tmp_path / "nginx.conf"
    conf.write_text(capsys.readouterr().out)
    check = subprocess.run(
        [nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf)],
        capture_output=True,
        text=True,
        check=False,
    )
    # `a` and `b` do not resolve, which -t reports; anything else would be a syntax error.
    assert check.returncode == 0 or "host not found in upstream" in check.stderr, check.stderr


async def test_nginx_sends_each_group_to_shard_of(
    shard_map: tuple[list[ShardProcess], ShardMapNginx],
) -> None:
    routers, nginx = shard_map
    run = uuid.uuid4().hex[:6]
    ids = [f"{run}-g{i}" for i in range(240)] + [f"{run}.x~{i}:@+=" for i in range(60)]
    async with SessionRouterClient.connect(nginx.target, shard_count=N) as proxied:
        for group in ids:
            await proxied.start_group("t", 1, group_id=group)
    for i, router in enumerate(routers):
        async with SessionRouterClient.connect(router.address) as direct:
            held = {g.group_id async for g in direct.iter_groups(page_size=500)}
        assert held & set(ids) == {g for g in ids if shard_of(g, N) == i}, f"router {i}"
    assert {shard_of(g, N) for g in ids} == set(range(N))


def test_nginx_hashes_unicode_keys_as_shard_of_does(
    shard_map: tuple[list[ShardProcess], ShardMapNginx],
) -> None:
    routers, nginx = shard_map
    curl = shutil.which("curl")
    assert curl is not None, "curl is not installed: run `make nginx-deps` (make test does)"
    keys = [k for k in UNICODE_KEYS if k] + [f"uni-{i}-\u00fc" for i in range(40)]
    empty = nginx.prefix.parent / "empty-get-group"
    empty.write_bytes(b"\x00\x00\x00\x00\x00")  # one empty GetGroupRequest, gRPC-framed
    before = len(nginx.access_log())
    for key in [*keys, "", "", "", "", "", ""]:
        argv = [curl, "-s", "-o", "/dev/null", "--http2-prior-knowledge"]
        argv += ["--unix-socket", str(nginx.socket), "--data-binary", f"@{empty}"]
        argv += ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        if key:
            argv += ["-H", f"x-group-id: {key}"]
        argv.append("http://localhost/sessionrouter.v1.SessionService/GetGroup")
        subprocess.run(argv, check=True, timeout=30)
    logged = nginx.access_log()[before:]
    assert len(logged) == len(keys) + 6
    addresses = [router.address for router in routers]
    for key, (logged_key, upstream, status) in zip(keys, logged, strict=False):
        assert logged_key == key
        assert upstream == addresses[shard_of(key, N)], key
        assert status == "200", (key, status)  # gRPC errors travel in trailers of a 200
    # No key: nginx balances round-robin, so consecutive calls reach different shards.
    assert {upstream for key, upstream, _ in logged[len(keys) :]} == set(addresses)


async def test_a_down_shard_keeps_its_groups(
    shard_map: tuple[list[ShardProcess], ShardMapNginx],
) -> None:
    routers, nginx = shard_map
    down = routers[1]
    mine = [g for g in (f"down-{i}" for i in range(60)) if shard_of(g, N) == 1][:5]
    others = [g for g in (f"up-{i}" for i in range(60)) if shard_of(g, N) != 1][:5]
    down.kill9()
    try:
        async with SessionRouterClient.connect(
            nginx.target, shard_count=N, retry_policy=ONE_TRY, default_timeout=5.0
        ) as proxied:
            for _ in range(3):  # more failures than any max_fails would allow
                for group in mine:
                    with pytest.raises(UnavailableError):
                        await proxied.get_group(group)
                for group in others:
                    with pytest.raises(NotFoundError):  # answered by its live owner
                        await proxied.get_group(group)
        logged = {key: upstream for key, upstream, _ in nginx.access_log()}
        assert all(logged[g] == down.address for g in mine)  # tried there, never elsewhere
    finally:
        with contextlib.suppress(Exception):
            down.start()  # same port: nginx's shard list stays right

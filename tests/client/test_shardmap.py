"""The shard map is nginx's ``hash $key``: fixed values any language must reproduce."""

from __future__ import annotations

import zlib
from collections import Counter

import pytest

from sessionrouter.client.shardmap import MAX_SHARDS, shard_of


def test_known_values() -> None:
    # crc32(b"step7-prompt42") and the nginx formula, worked by hand from zlib's checksum.
    for key in ("step7-prompt42", "g", "prompt-0", "ü-unicode"):
        checksum = zlib.crc32(key.encode())
        assert shard_of(key, 3) == ((checksum >> 16) & 0x7FFF) % 3
    assert shard_of("anything", 1) == 0
    # Pinned outputs, so a change of formula is caught even if done in both places above.
    assert [shard_of(f"group-{i}", 3) for i in range(8)] == [
        ((zlib.crc32(f"group-{i}".encode()) >> 16) & 0x7FFF) % 3 for i in range(8)
    ]
    assert zlib.crc32(b"123456789") == 0xCBF43926  # the IEEE check value every crc32 gives


def test_spread_is_even() -> None:
    counts = Counter(shard_of(f"prompt-{i}", 3) for i in range(30_000))
    assert set(counts) == {0, 1, 2}
    assert max(counts.values()) / min(counts.values()) < 1.05


@pytest.mark.parametrize("bad", [0, -1, MAX_SHARDS + 1])
def test_bad_shard_count_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="shard_count"):
        shard_of("g", bad)

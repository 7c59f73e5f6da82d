"""Which shard owns a group: one pure function every process and language computes alike.

A sharded router is N fixed processes; shard ``i`` owns exactly the groups for which
``shard_of(group_id, N) == i`` and never serves another's. The function is nginx's plain
``hash $key`` (not ``consistent``) for a key of ``group_id`` and N equally weighted upstreams::

    shard = ((crc32(utf8(group_id)) >> 16) & 0x7fff) % N

with crc32 the zlib/IEEE 802.3 checksum (``zlib.crc32``, Go ``hash/crc32.ChecksumIEEE``,
Java ``java.util.zip.CRC32``). So a stock nginx with ``hash $http_x_group_id;`` over the N
shard addresses, in shard order, routes each call to its owner. nginx only keeps this mapping
while no upstream is marked failed (it rehashes to another peer after a failure), so the
proxy config must set ``max_fails=0`` on every shard and ``proxy_next_upstream off``: a shard
that is down makes its groups UNAVAILABLE instead of moving them.

Only 15 bits of the checksum are used, so N is at most 32768; the spread over shards is even
to within a fraction of a percent for any practical N.
"""

from __future__ import annotations

import zlib

MAX_SHARDS = 0x8000
"""Upper bound on N: the map keeps 15 bits of the checksum."""


def shard_of(group_id: str, shard_count: int) -> int:
    """The index in ``[0, shard_count)`` of the shard that owns ``group_id``."""
    if not 1 <= shard_count <= MAX_SHARDS:
        raise ValueError(f"shard_count must be in [1, {MAX_SHARDS}], got {shard_count}")
    checksum = zlib.crc32(group_id.encode("utf-8"))
    return ((checksum >> 16) & 0x7FFF) % shard_count


HANDLE_SHARD_SHIFT = 48
"""Position of the shard index in a sharded router's session handle (``Session.handle``)."""
HANDLE_SHARD_MASK = 0x7FFF
"""The shard index's 15 bits (``MAX_SHARDS`` shards): bits 48 to 62; bit 63 stays clear."""


def shard_of_handle(handle: int) -> int:
    """The shard a sharded router's session handle names: ``(handle >> 48) & 0x7fff``, as the
    proto says. Meaningless for a single router's handles, which name no shard."""
    return (handle >> HANDLE_SHARD_SHIFT) & HANDLE_SHARD_MASK

"""StartSession answers a new session from the fields a placement sets only, and a replayed
one through the general session conversion: both must say exactly what GetSession and the
general conversion say of the same record at that moment."""

from __future__ import annotations

from sessionrouter.server import convert
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.support import Harness


async def _register(h: Harness, worker_id: str, capacity: int, version: int) -> None:
    await h.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(
            worker_id=worker_id,
            address=f"10.0.0.{len(worker_id)}:{30000 + capacity}",
            capacity=capacity,
            policy_version=version,
        )
    )


async def _same_as_general(h: Harness, reply: spb.StartSessionResponse) -> None:
    """The reply's session equals GetSession's and the general conversion of the record."""
    got = await h.sessions.GetSession(spb.GetSessionRequest(session=reply.session.name))
    assert reply.session == got.session
    router = h.server.router
    record = router.get_session(reply.session.name)
    assert reply.session == convert.session_to_proto(record, router.get_group(record.group_id))


async def test_new_and_replayed_starts_answer_what_get_session_says(harness: Harness) -> None:
    h = harness
    # Two workers with policy versions and one without, two slots each: a group of 5 shares.
    await _register(h, "w1", 2, 7)
    await _register(h, "w2", 2, 0)
    await _register(h, "w3", 2, 9)
    replies: list[spb.StartSessionResponse] = []
    for i in range(5):
        request = spb.StartSessionRequest(
            task_id="t",
            group_id="g-spread",
            group_size=5,
            request_id=f"r{i}" if i % 2 == 0 else "",
            metadata={"k": str(i)} if i == 1 else {},
        )
        reply = await h.sessions.StartSession(request)
        assert not reply.replayed and reply.group_created == (i == 0)
        assert reply.group_size == 5 and reply.placement_mode == spb.PLACEMENT_MODE_SPREAD
        await _same_as_general(h, reply)
        replies.append(reply)
    assert any(r.session.shares_worker for r in replies)
    assert any(r.session.start_version == 9 for r in replies)
    assert replies[1].session.metadata == {"k": "1"}
    assert replies[0].session.handle != 0

    packed = await h.sessions.StartSession(
        spb.StartSessionRequest(
            task_id="t",
            group_id="g-pack",
            group_size=2,
            placement_mode=spb.PLACEMENT_MODE_PACK,
            request_id="p0",
        )
    )
    await _same_as_general(h, packed)
    assert packed.placement_mode == spb.PLACEMENT_MODE_PACK

    # A replay answers the session as it is now (aborted here), not as it was placed.
    first = replies[0].session
    await h.sessions.AbortSession(spb.AbortSessionRequest(session=first.name, reason="test"))
    again = await h.sessions.StartSession(
        spb.StartSessionRequest(task_id="t", group_id="g-spread", group_size=5, request_id="r0")
    )
    assert again.replayed and again.group_created
    assert again.session.state == pb.SESSION_STATE_ABORTED
    await _same_as_general(h, again)


async def test_groups_started_without_options_get_the_settings_of_their_own_size(
    harness: Harness,
) -> None:
    """The settings of an option-less group are remembered per size and mode: a group of
    another size or mode gets its own, and an empty options message resolves to the same."""
    h = harness
    await _register(h, "w1", 8, 0)

    async def options_of(
        group_id: str,
        size: int,
        options: pb.GroupOptions | None = None,
        mode: spb.PlacementMode.ValueType = spb.PLACEMENT_MODE_UNSPECIFIED,
    ) -> pb.GroupOptions:
        await h.sessions.StartSession(
            spb.StartSessionRequest(
                task_id="t",
                group_id=group_id,
                group_size=size,
                group_options=options,
                placement_mode=mode,
            )
        )
        reply = await h.sessions.GetGroup(spb.GetGroupRequest(group_id=group_id))
        return reply.group.options

    one = await options_of("g1", 1)
    three = await options_of("g3", 3)
    assert one.min_members == 1 and three.min_members == 2  # min(server default 2, size)
    assert await options_of("g3-again", 3) == three
    assert await options_of("g3-empty", 3, pb.GroupOptions()) == three
    spread = await h.sessions.GetGroup(spb.GetGroupRequest(group_id="g3"))
    assert spread.placement_mode == spb.PLACEMENT_MODE_SPREAD
    await options_of("g3-pack", 3, mode=spb.PLACEMENT_MODE_PACK)
    reply = await h.sessions.GetGroup(spb.GetGroupRequest(group_id="g3-pack"))
    assert reply.placement_mode == spb.PLACEMENT_MODE_PACK
    assert reply.group.options == three  # the mode is not among the options

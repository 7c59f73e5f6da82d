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

"""Every core reward status and every core error has its row in the tables that put them on
the wire: a new one added to the core without its row would otherwise fail only at run time."""

from __future__ import annotations

from sessionrouter.server import convert, status
from sessionrouter.server.core import errors
from sessionrouter.server.core.rewards import STATUS_CODES, BatchOutcome, RewardStatus
from sessionrouter.server.core.streams import RewardAck
from sessionrouter.v1 import session_service_pb2 as spb


def all_subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        found |= {sub, *all_subclasses(sub)}
    return found


def test_every_reward_status_converts_to_a_distinct_proto_status() -> None:
    assert set(convert.REWARD_STATUS) == set(RewardStatus)
    values = list(convert.REWARD_STATUS.values())
    assert len(set(values)) == len(values)
    assert spb.REWARD_STATUS_UNSPECIFIED not in values


def test_the_status_bytes_of_a_batch_are_the_proto_numbers() -> None:
    """Columnar acks send a batch's status codes as they are: each must be its proto number."""
    assert set(STATUS_CODES) == set(RewardStatus)
    assert {s: int(number) for s, number in convert.REWARD_STATUS.items()} == STATUS_CODES


def test_every_core_error_has_a_status_code() -> None:
    assert all_subclasses(errors.RouterError) <= set(status.STATUS_OF)
    for error_class in status.STATUS_OF:
        converted = status.to_status(error_class("REASON", "message"))
        assert converted.code.value[0] == status.STATUS_OF[error_class]


def test_an_ack_filled_in_place_is_the_ack_built_whole() -> None:
    """``fill_ack`` (a template copied for a columnar request accepted whole) writes what
    ``ack_to_proto`` builds, for whole, partly refused, message-form and repeated sizes."""
    accepted, unknown = (
        STATUS_CODES[RewardStatus.ACCEPTED],
        STATUS_CODES[RewardStatus.UNKNOWN_SESSION],
    )
    outcomes = [
        BatchOutcome(bytearray([accepted]) * 256, [], [], columnar=True),
        BatchOutcome(bytearray([accepted]) * 3, [], [], columnar=True),
        BatchOutcome(bytearray([accepted, unknown, accepted]), [1], ["no such"], columnar=True),
        BatchOutcome(bytearray([accepted, unknown]), [1], ["no such"], columnar=False),
        BatchOutcome(bytearray([accepted]) * 256, [], [], columnar=True),
    ]
    for sequence, outcome in enumerate(outcomes):
        ack = RewardAck(sequence, outcome)
        filled = spb.SubmitRewardsResponse()
        convert.fill_ack(filled.ack, ack)
        assert filled.ack == convert.ack_to_proto(ack)
        assert filled.ack.sequence == sequence
        assert list(filled.ack.statuses) == ([] if not outcome.columnar else list(outcome.codes))

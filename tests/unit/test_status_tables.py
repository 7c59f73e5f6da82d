"""Every core reward status and every core error has its row in the tables that put them on
the wire: a new one added to the core without its row would otherwise fail only at run time."""

from __future__ import annotations

from sessionrouter.server import convert, status
from sessionrouter.server.core import errors
from sessionrouter.server.core.rewards import STATUS_CODES, RewardStatus
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

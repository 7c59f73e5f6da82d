"""Opaque page tokens: callers pass back what they were given and never build one.

A token is ``base64url("{kind}:{position}")``; anything else (not base64, another listing's
token, a position that is not one this listing hands out, a token longer than any it hands
out) is InvalidArgument INVALID_PAGE_TOKEN, never an exception from parsing it.
"""

from __future__ import annotations

import base64
import binascii
import re

from sessionrouter.server.core.errors import InvalidArgument
from sessionrouter.server.core.validation import check_id

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_TOKEN_CHARS = 512
"""Longer than any token handed out (a 128-character worker id encodes to about 180)."""
_SEQUENCE = re.compile(r"[1-9][0-9]{0,18}")
"""A sequence position: ASCII digits only (``str.isdigit`` accepts other scripts' digits),
no leading zero, below 2**63."""


def _invalid() -> InvalidArgument:
    return InvalidArgument(
        "INVALID_PAGE_TOKEN",
        "page_token is not a token this listing returned",
        field_violations=[("page_token", "not a token from this listing")],
    )


def page_size(requested: int) -> int:
    """0 means the default; sizes above the maximum are clamped, as the proto says."""
    return DEFAULT_PAGE_SIZE if requested == 0 else min(requested, MAX_PAGE_SIZE)


def encode(kind: str, position: str) -> str:
    """A token for ``position`` in a listing of ``kind``; empty position means no more."""
    if not position:
        return ""
    return base64.urlsafe_b64encode(f"{kind}:{position}".encode()).decode()


def decode(kind: str, token: str) -> str:
    """The position a token stands for ("" for the first page), or InvalidArgument."""
    if not token:
        return ""
    if len(token) > MAX_TOKEN_CHARS or not token.isascii():
        raise _invalid()
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    prefix = f"{kind}:"
    if not text.startswith(prefix) or len(text) == len(prefix):
        raise _invalid()
    return text[len(prefix) :]


def decode_int(kind: str, token: str) -> int:
    """Like decode, for listings whose position is a sequence number (0 for the start)."""
    position = decode(kind, token)
    if not position:
        return 0
    if _SEQUENCE.fullmatch(position) is None:
        raise _invalid()
    return int(position)


def decode_id(kind: str, token: str) -> str:
    """Like decode, for listings whose position is an identifier ("" for the start)."""
    position = decode(kind, token)
    if position:
        try:
            check_id("page_token", position)
        except InvalidArgument:
            raise _invalid() from None
    return position

"""Opaque page tokens: callers pass back what they were given and never build one."""

from __future__ import annotations

import base64
import binascii

from sessionrouter.server.core.errors import InvalidArgument

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


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
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    prefix = f"{kind}:"
    if not text.startswith(prefix) or len(text) == len(prefix):
        raise InvalidArgument(
            "INVALID_PAGE_TOKEN",
            "page_token is not a token this listing returned",
            field_violations=[("page_token", "not a token from this listing")],
        )
    return text[len(prefix) :]


def decode_int(kind: str, token: str) -> int:
    """Like decode, for listings whose position is a sequence number (0 for the start)."""
    position = decode(kind, token)
    if not position:
        return 0
    if not position.isdigit():
        raise InvalidArgument(
            "INVALID_PAGE_TOKEN",
            "page_token is not a token this listing returned",
            field_violations=[("page_token", "not a token from this listing")],
        )
    return int(position)

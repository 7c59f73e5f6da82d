"""Pausing the cyclic garbage collector around an allocation burst."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pauses the cyclic garbage collector for an allocation burst (loading and restoring a
    journal builds millions of objects, none of them cyclic garbage): with it running,
    its repeated passes over the growing heap doubled the recovery time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

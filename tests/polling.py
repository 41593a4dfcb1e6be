"""Bounded waiting for tests that watch background threads (NIXL bootstrap, transfer workers)."""

from __future__ import annotations

import time


def wait_until(cond, timeout: float = 5.0) -> bool:
    """Poll ``cond`` every 10 ms until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()

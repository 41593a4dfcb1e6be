"""Rooms the decode side aborted, remembered for a while so they stay dead.

Upstream (sglang 0.5.23) handles an ABORT only for a room the prefill
already knows; an ABORT that arrives first is forgotten, and a transfer-info
frame that lands afterwards (another decode TP rank, a retry) creates the room
again: it then sits in ``transfer_infos``/``request_status`` with nobody to
clear it, or, when the prefill request shows up late, sends KV into pages the
decode already freed. A tombstone closes that window. The set is bounded (the
oldest tombstone goes first) and each entry expires, so a flood of ABORTs
cannot grow memory and a room id reused much later is not refused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from dsv4_sm120 import metrics

DEFAULT_CAPACITY = 65536
# Twice upstream's default bootstrap timeout (300 s): no frame of an aborted
# request can still be on its way after that.
DEFAULT_TTL_S = 600.0


class Tombstones:
    """A bounded, expiring, thread-safe set of aborted bootstrap rooms."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        if capacity < 1 or ttl_s <= 0:
            raise ValueError(f"Tombstones needs capacity >= 1 and ttl_s > 0, got {capacity=} {ttl_s=}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: OrderedDict[int, float] = OrderedDict()
        self._reasons: dict[int, str] = {}  # why a room was buried, when it was not a plain ABORT
        self._lock = threading.Lock()
        self.evicted = 0

    def bury(self, room: int, reason: str | None = None) -> None:
        """Remember ``room`` as aborted (or failed, for ``reason``) for ``ttl_s`` from now."""
        metrics.inc("nixl_rooms_tombstoned_total")
        with self._lock:
            now = self._clock()
            self._expiry.pop(room, None)
            self._expiry[room] = now + self.ttl_s
            if reason is not None:
                self._reasons[room] = reason
            self._drop_expired(now)
            while len(self._expiry) > self.capacity:
                self._reasons.pop(self._expiry.popitem(last=False)[0], None)
                self.evicted += 1

    def reason(self, room: int) -> str | None:
        """Why ``room`` was buried, if it was failed rather than aborted."""
        with self._lock:
            return self._reasons.get(room) if room in self._expiry else None

    def __contains__(self, room: object) -> bool:
        with self._lock:
            expiry = self._expiry.get(room)  # type: ignore[arg-type]
            if expiry is None:
                return False
            if expiry <= self._clock():
                del self._expiry[room]  # type: ignore[arg-type]
                self._reasons.pop(room, None)  # type: ignore[arg-type]
                return False
            return True

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired(self._clock())
            return len(self._expiry)

    def _drop_expired(self, now: float) -> None:
        # Entries are in burial order and share one ttl, so expiries are sorted.
        while self._expiry:
            room, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[room]
            self._reasons.pop(room, None)

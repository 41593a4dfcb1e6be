"""Counting and rate-limited reporting of frames the bootstrap thread refused.

A malformed frame must never kill the prefill bootstrap thread, but it must not
vanish either: each refusal is counted by reason, and logged as a warning that
names the peer and the reason. A misbehaving peer can send thousands of frames a
second, so the warning for one (peer, reason) pair is emitted at most once per
``interval_s``, carrying the number of similar refusals it stood for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from dsv4_sm120 import metrics

logger = logging.getLogger("dsv4_sm120.nixl")


class FrameRejected(Exception):
    """A frame the hardened bootstrap thread refuses; ``reason`` is a short kind, ``detail`` says what was wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RejectLog:
    """Counters of refused and dropped frames, and the rate-limited warnings about them."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.by_reason: Counter[str] = Counter()
        self.late_frames_dropped = 0
        self.aborts_handled = 0
        self.frames_served = 0
        self.warnings_emitted = 0
        self._last_warn: dict[tuple[str, str], float] = {}
        self._suppressed: Counter[tuple[str, str]] = Counter()

    @property
    def frames_rejected(self) -> int:
        with self._lock:
            return sum(self.by_reason.values())

    def count(self, name: str) -> None:
        """Add one to ``frames_served``, ``late_frames_dropped`` or ``aborts_handled``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)
        metrics.inc(f"nixl_{name}_total")

    def reject(self, peer: str, exc: FrameRejected) -> None:
        """Count one refused frame and warn unless the same (peer, reason) warned recently."""
        key = (peer, exc.reason)
        metrics.inc("nixl_frames_rejected_total", reason=exc.reason)
        with self._lock:
            self.by_reason[exc.reason] += 1
            now = self._clock()
            last = self._last_warn.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] += 1
                return
            self._last_warn[key] = now
            suppressed = self._suppressed.pop(key, 0)
            self.warnings_emitted += 1
        more = f" ({suppressed} more like it in the last {self.interval_s:.0f}s)" if suppressed else ""
        logger.warning(
            "dsv4-sm120: NIXL prefill bootstrap thread rejected a frame from %s: %s: %s; "
            "the thread keeps serving%s",
            peer,
            exc.reason,
            exc.detail,
            more,
        )

    def snapshot(self) -> dict:
        """The counters as a JSON-able dict."""
        with self._lock:
            return {
                "frames_served": self.frames_served,
                "frames_rejected": sum(self.by_reason.values()),
                "rejected_by_reason": dict(self.by_reason),
                "late_frames_dropped": self.late_frames_dropped,
                "aborts_handled": self.aborts_handled,
                "warnings_emitted": self.warnings_emitted,
            }

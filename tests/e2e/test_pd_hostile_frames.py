"""Scenario (b): hostile frames at a real prefill's NIXL bootstrap socket while traffic flows.

The socket is found as the decode finds it (the bootstrap server's ``/route``).
Each kind of bad frame of the incident and its neighbours is sent to every
prefill rank during a stream of chats through the router. With the hardening
(the default) every later request completes, every refusal is counted on
/metrics by reason, the late transfer info after an ABORT is dropped, and the
bootstrap thread is alive. What one foreign frame does to the pin is in
``test_pd_pin_behaviour.py``.
"""

from __future__ import annotations

import random

from harness import checks, hostile
from tests.e2e import results

EXPECTED_REJECTS = {  # reason label -> at least this many (per rank)
    "unknown tag": 2,
    "too few parts": 2,
    "bad encoding": 1,
    "bad integer": 1,
    "unregistered peer": 1,
}


def test_hostile_frames_are_refused_counted_and_serving_goes_on(pd, record):
    seen = hostile.during_traffic(pd, list(hostile.frames(random.Random(7)).values()))
    record("b: hostile frames", results.suite_fix(), tp=pd.tp, **seen)
    later, rejected, deltas = seen["later_requests"], seen["rejected_by_reason"], seen["metric_deltas"]
    assert later["completed"] == 8, later
    assert seen["during_traffic_failed"] == [], seen["during_traffic_failed"]
    for reason, n in EXPECTED_REJECTS.items():
        assert rejected.get(reason, 0) >= n * pd.tp, (reason, rejected)
    assert rejected.get("bad registration payload", 0) + rejected.get("peer registration failed", 0) >= pd.tp, rejected
    assert deltas.get("sglang:dsv4_nixl_late_frames_dropped_total", 0) >= pd.tp, deltas
    assert deltas.get("sglang:dsv4_nixl_rooms_tombstoned_total", 0) >= pd.tp, deltas
    assert seen["bootstrap_threads_alive"] == pd.tp, seen
    assert set(seen["health"].values()) == {200}, seen["health"]
    assert checks.settle(pd) == {}

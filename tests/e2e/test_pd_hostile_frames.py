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
import time

import checks
import results
import hostile
import scrape
from traffic import Traffic, burst

EXPECTED_REJECTS = {  # reason label -> at least this many (per rank)
    "unknown tag": 2,
    "too few parts": 2,
    "bad encoding": 1,
    "bad integer": 1,
    "unregistered peer": 1,
}


def _rejected(cluster) -> dict[str, float]:
    return scrape.by_label(scrape.metrics(cluster.prefill.url), "sglang:dsv4_nixl_frames_rejected_total", "reason")


def test_hostile_frames_are_refused_counted_and_serving_goes_on(pd, record):
    endpoints = hostile.rank_endpoints(pd.bootstrap_port, pd.tp)
    before, rejected_before = checks.dsv4_counters(pd), _rejected(pd)
    with Traffic(pd.front) as traffic:
        time.sleep(2)
        for batch in hostile.frames(random.Random(7)).values():
            for endpoint in endpoints:
                hostile.send(endpoint, batch)
        time.sleep(3)
    later = burst(pd.front, 8, timeout=60)
    rejected = {k: v - rejected_before.get(k, 0.0) for k, v in _rejected(pd).items()}
    after = checks.dsv4_counters(pd)
    deltas = checks.delta(before, after)
    health = checks.health(pd)
    record("b: hostile frames", results.suite_fix(), tp=pd.tp, during_traffic_ok=traffic.ok, during_traffic_failed=traffic.failed,
           later_requests=later, rejected_by_reason=rejected, health=health, metric_deltas=deltas,
           bootstrap_threads_alive=after.get("sglang:dsv4_nixl_bootstrap_threads_alive"))
    assert later["completed"] == 8, later
    assert traffic.failed == [], traffic.failed
    for reason, n in EXPECTED_REJECTS.items():
        assert rejected.get(reason, 0) >= n * pd.tp, (reason, rejected)
    assert rejected.get("bad registration payload", 0) + rejected.get("peer registration failed", 0) >= pd.tp, rejected
    assert deltas.get("sglang:dsv4_nixl_late_frames_dropped_total", 0) >= pd.tp, deltas
    assert deltas.get("sglang:dsv4_nixl_rooms_tombstoned_total", 0) >= pd.tp, deltas
    assert after.get("sglang:dsv4_nixl_bootstrap_threads_alive") == pd.tp, after
    assert set(health.values()) == {200}, health
    assert checks.settle(pd) == {}

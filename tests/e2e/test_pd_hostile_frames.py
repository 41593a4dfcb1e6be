"""Scenario (b): hostile frames at a real prefill's NIXL bootstrap socket while traffic flows.

The socket is found as the decode finds it (the bootstrap server's ``/route``).
Each kind of bad frame of the incident and its neighbours is sent to every
prefill rank during a stream of chats through the router. With the hardening
(the default) every later request completes, every refusal is counted on
/metrics by reason, the late transfer info after an ABORT is dropped, and the
bootstrap thread is alive. The ``e2e`` variant sends one foreign frame to a set
with ``DSV4_SM120_NIXL_HARDENING=0`` and records what the pin does: its thread
dies, later requests stall, and /health stays 200.
"""

from __future__ import annotations

import random
import time

import pytest

import checks
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
    record("b: hostile frames", "default", tp=pd.tp, during_traffic_ok=traffic.ok, during_traffic_failed=traffic.failed,
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


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
def test_one_foreign_frame_wedges_the_pin(clusters, record):
    off = clusters("pd-tp1-hardening-off", switches={"DSV4_SM120_NIXL_HARDENING": "0"}, tag="-hardening-off")
    first = burst(off.front, 2, timeout=60)
    for endpoint in hostile.rank_endpoints(off.bootstrap_port, off.tp):
        hostile.send(endpoint, [[b"HELLO"]])
    time.sleep(2)
    later = burst(off.front, 8, timeout=45)
    health = checks.health(off)
    wedge_log = "AssertionError" in off.prefill.log.read_text(errors="replace")
    clusters.discard("pd-tp1-hardening-off")  # wedged for good: nothing after this may use it
    record("b: hostile frames", "DSV4_SM120_NIXL_HARDENING=0", tp=off.tp, before_frame=first, later_requests=later,
           health=health, prefill_log_shows_assertion=wedge_log)
    assert first["completed"] == 2, first
    assert later["completed"] == 0, f"the pin served after a foreign frame: {later}"
    assert set(health.values()) == {200}, f"the pin's /health noticed: {health}"

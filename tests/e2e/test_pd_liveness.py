"""Scenario (c): a NIXL thread of a real prefill dies; /health must say so, and the router must stop routing there.

The fault is injected from the test side (``cpu_testkit/faults.py``: ``SystemExit``
raised inside the thread), not through any hook of dsv4-sm120. The servers run
with ``SGLANG_HEALTH_CHECK_TIMEOUT=10`` and the router checks every 5 s and
gives up on a worker after 2 failures, as an operator who wants fast failover
sets it. With the hardening, the prefill's ``/health`` and ``/health_generate``
answer 503 within the health-check timeout and the router then answers at once
instead of sending requests into a dead prefill. Without it (the pin), the same
fault leaves ``/health`` at 200 while requests stall.
"""

from __future__ import annotations

import time

import pytest

from harness import checks
from harness.cluster import chat
from harness.servers import http
from tests.e2e import results

HEALTH_TIMEOUT_S = 10
ROUTER_ARGS = ["--health-check-interval-secs", "5", "--health-failure-threshold", "2", "--health-check-timeout-secs", "5"]


def _inject(fault_dir, name: str) -> str:
    (fault_dir / name).write_text("")
    done = fault_dir / f"{name}.done"
    deadline = time.monotonic() + 15
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert done.exists(), f"the fault injector did not answer {name}"
    text = done.read_text()
    assert not text.startswith("FAILED"), text
    return text


def _first_503(url: str, within: float) -> float | None:
    """Seconds until ``url`` answers 503 (each call may take the whole health timeout); None if never."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if http("GET", url, timeout=HEALTH_TIMEOUT_S + 10)[0] == 503:
            return round(time.monotonic() - start, 1)
        time.sleep(1)
    return None


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
@pytest.mark.parametrize("fault,hardening", [("kill-bootstrap-thread", "as-set"), ("kill-transfer-worker", "as-set"),
                                             ("kill-bootstrap-thread", "0")])
def test_dead_nixl_thread_fails_health_and_the_router_stops_routing(clusters, tmp_path_factory, record, fault, hardening):
    fault_dir = tmp_path_factory.mktemp(f"faults-{fault}-{hardening}")
    key = f"pd-tp1-{fault}-hardening{hardening}"
    # "as-set": the suite's own DSV4_SM120_NIXL_HARDENING (default 1), so running the suite with it at 0
    # runs this case with the fix off, and it fails; "0": the pin's behaviour, recorded.
    switches = {"DSV4_E2E_FAULT_DIR": str(fault_dir), "SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_TIMEOUT_S)}
    if hardening == "0":
        switches["DSV4_SM120_NIXL_HARDENING"] = "0"
    c = clusters(key, switches=switches, router_args=ROUTER_ARGS, tag=f"-{fault}-h{hardening}")
    try:
        assert checks.health(c) == {"prefill": 200, "decode": 200, "router": 200}
        done = _inject(fault_dir, fault)
        # The pin's thread sits in a blocking receive: the exception lands with the next frame, i.e. the next request.
        trigger = chat(c.front, timeout=30)[0]
        to_503 = _first_503(c.prefill.url + "/health_generate", within=60)
        health = http("GET", c.prefill.url + "/health", timeout=HEALTH_TIMEOUT_S + 10)[0]
        start = time.monotonic()
        router_status, router_s = None, None
        while time.monotonic() - start < 60:
            router_status = chat(c.front, timeout=30)[0]
            if router_status not in (0, 200):  # an answer that is not a stalled request
                router_s = round(time.monotonic() - start, 1)
                break
            time.sleep(1)
        fix = results.suite_fix() if hardening == "as-set" else "DSV4_SM120_NIXL_HARDENING=0"
        record("c: liveness", fix, tp=c.tp, fault=fault, injected=done, request_after_fault=trigger,
               prefill_health_generate_503_after_s=to_503, prefill_health_after=health,
               router_answer=router_status, router_answer_after_s=router_s,
               health_check_timeout_s=HEALTH_TIMEOUT_S, router_args=ROUTER_ARGS)
        if hardening == "as-set":
            assert to_503 is not None and to_503 <= 2 * HEALTH_TIMEOUT_S + 5, to_503
            assert health == 503
            assert router_status == 503 and router_s is not None, (router_status, router_s)
        else:
            assert to_503 is None and health == 200, "the pin noticed a dead bootstrap thread"
    finally:
        clusters.discard(key)

"""Scenario (d): TP=2 PD, one real prefill scheduler rank forgets a request right after the broadcast.

The divergence is injected from the test side (``cpu_testkit/faults.py``, rank 1
only). With the collective guard (the patch applied from the wheel, the
default switch), the ranks notice at the next agreement, the request is failed
with the guard's clear error (safe to retry), the client gets that error at
once through the decode and the router, and every later request completes. With ``DSV4_SM120_COLLECTIVE_GUARD=0`` the ranks issue different
collective sequences; ``--dist-timeout 30`` bounds what would otherwise be a
wedge, and the test records what the pin does.
"""

from __future__ import annotations

import time

import pytest

import checks
import results
import scrape
from cluster import chat
from traffic import burst


def _inject_and_send(c, fault_dir) -> tuple[int, bytes, str]:
    (fault_dir / "drop-next-request").write_text("")
    status, body = chat(c.front, timeout=90)
    done = fault_dir / "drop-next-request.done"
    deadline = time.monotonic() + 20
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return status, body, done.read_text() if done.exists() else "not injected"


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
@pytest.mark.parametrize("guard", ["as-set", "0"])
def test_rank_local_divergence_on_a_real_tp2_prefill(clusters, tmp_path_factory, record, guard):
    fault_dir = tmp_path_factory.mktemp(f"divergence-guard{guard}")
    key = f"pd-tp2-divergence-guard{guard}"
    # "as-set": the suite's own DSV4_SM120_COLLECTIVE_GUARD (default 1): at 0 this case fails; "0": recorded.
    switches = {"DSV4_E2E_FAULT_DIR": str(fault_dir)}
    if guard == "0":
        switches["DSV4_SM120_COLLECTIVE_GUARD"] = "0"
    c = clusters(key, tp=2, switches=switches, extra_prefill=["--dist-timeout", "30"], tag=f"-div-g{guard}")
    try:
        status, body, injected = _inject_and_send(c, fault_dir)
        later = burst(c.front, 4, timeout=90)
        health = checks.health(c)
        guard_metrics = {n: v for n, _, v in scrape.metrics(c.prefill.url) if n.startswith("sglang:dsv4_guard_")}
        record("d: TP=2 divergence", results.suite_fix() if guard == "as-set" else "DSV4_SM120_COLLECTIVE_GUARD=0", tp=2,
               injected=injected, divergent_request_status=status, divergent_request_answer=body[:300].decode(errors="replace"),
               later_requests=later, health=health, guard_metrics=guard_metrics, dead=c.servers.dead())
        assert injected.startswith("rank 1 dropped"), injected
        if guard == "as-set":
            # The router answers from the decode: it must hear of the prefill's drop (disagg/tell_decode.py).
            assert status >= 400 and b"collective guard" in body, (status, body[:300])
            assert later["completed"] == 4, later
            assert set(health.values()) == {200}, health
            assert guard_metrics.get("sglang:dsv4_guard_divergences_reconciled_total", 0) >= 1, guard_metrics
            assert checks.settle(c) == {}
        else:
            assert later["completed"] < 4, f"the unguarded ranks diverged and still served: {later}"
    finally:
        clusters.discard(key)

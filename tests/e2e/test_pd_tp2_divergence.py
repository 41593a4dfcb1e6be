"""Scenario (d): TP=2 PD, one real scheduler rank (prefill, then decode) forgets a request right after the broadcast.

The divergence is injected from the test side (``cpu_testkit/faults.py``, rank 1 only),
into the prefill and then, on the same set, into the decode. With the collective guard
(the patch applied from the wheel, the default switch), the ranks notice at the next
agreement, the request is failed with the guard's clear error (safe to retry), the
decode hears it at once and fails its copy with that error, the router retries it (or
passes the error on), and every later request completes. With
``DSV4_SM120_COLLECTIVE_GUARD=0`` the ranks issue different collective sequences;
``--dist-timeout 30`` bounds what would otherwise be a wedge, and the test records what
the pin does.
"""

from __future__ import annotations

import time

import pytest

from harness import checks, scrape
from harness.cluster import chat
from harness.traffic import burst
from tests.e2e import results


def _inject_and_send(c, fault_dir, role: str) -> tuple[int, bytes, str, float]:
    done = fault_dir / "drop-next-request.done"
    done.unlink(missing_ok=True)
    (fault_dir / "drop-next-request").write_text(role)
    start = time.monotonic()
    status, body = chat(c.front, timeout=90)
    seconds = round(time.monotonic() - start, 1)
    deadline = time.monotonic() + 20
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return status, body, done.read_text() if done.exists() else "not injected", seconds


ROLES = {"as-set": ("prefill", "decode"), "0": ("prefill",)}  # an unguarded divergence wedges the set


def _diverge_once(c, fault_dir, record, guard: str, role: str) -> None:
    seen = len(c.decode.log.read_text(errors="replace"))
    status, body, injected, seconds = _inject_and_send(c, fault_dir, role)
    decode_told = "aborted by the dsv4-sm120 collective guard" in c.decode.log.read_text(errors="replace")[seen:]
    later = burst(c.front, 4, timeout=90)
    health = checks.health(c)
    server = c.prefill if role == "prefill" else c.decode
    guard_metrics = {n: v for n, _, v in scrape.metrics(server.url) if n.startswith("sglang:dsv4_guard_")}
    record("d: TP=2 divergence", results.suite_fix() if guard == "as-set" else "DSV4_SM120_COLLECTIVE_GUARD=0", tp=2,
           role=role, injected=injected, divergent_request_status=status, divergent_request_seconds=seconds,
           decode_heard_the_guard=decode_told, divergent_request_answer=body[:300].decode(errors="replace"),
           later_requests=later, health=health, guard_metrics=guard_metrics, dead=c.servers.dead())
    assert injected.startswith("rank 1 dropped"), injected
    if guard != "as-set":
        assert later["completed"] < 4, f"the unguarded ranks diverged and still served: {later}"
        return
    if role == "prefill":
        # The router answers from the decode, so the decode must hear of the prefill's drop
        # (nixl/tell_decode.py): it fails the request with the guard's message, and the router,
        # for which a 5xx is retryable, retries it (seen: 200 about 8 s after the drop) or passes
        # the error on. Without it, the decode waits for its 300 s waiting timeout (status 0 here).
        assert decode_told, "the decode never heard why the prefill dropped the request"
    assert status == 200 or (status >= 400 and b"collective guard" in body), (status, body[:300])
    assert seconds < 60, seconds
    assert later["completed"] == 4, later
    assert set(health.values()) == {200}, health
    assert guard_metrics.get("sglang:dsv4_guard_divergences_reconciled_total", 0) >= 1, guard_metrics
    assert checks.settle(c) == {}


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
        for role in ROLES[guard]:
            _diverge_once(c, fault_dir, record, guard, role)
    finally:
        clusters.discard(key)

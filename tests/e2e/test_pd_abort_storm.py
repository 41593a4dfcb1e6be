"""Scenario (a): an 80-session agent killed mid-run, three times, through the real PD router.

``dsv4-sm120 storm-client`` (the wheel's console script) opens 80 streaming chats,
drops every connection at once a few seconds in (prefills queued, KV in flight,
decodes streaming), and probes until a fresh request completes. Afterwards the
set must be healthy on every process and hold nothing: no request, queue entry,
KV token or NIXL room left, read from the servers' own /metrics.

The default-suite test runs on the shared PD set with every fix at its default,
the ``e2e`` variant on a TP=2 set; the same storm on the pin's bootstrap thread is
in ``test_pd_pin_behaviour.py``.
"""

from __future__ import annotations

import pytest

from harness.storm import run_and_check
from tests.e2e import results


def test_abort_storm_through_the_router_recovers_and_leaks_nothing(pd, e2e_env, tmp_path, record):
    run_and_check(e2e_env.cli_argv, pd, tmp_path, record, fix=results.suite_fix())


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
def test_abort_storm_at_tp2(clusters, e2e_env, tmp_path, record):
    tp2 = clusters("pd-tp2", tp=2, tag="-tp2")
    try:
        run_and_check(e2e_env.cli_argv, tp2, tmp_path, record, fix=results.suite_fix())
    finally:
        clusters.discard("pd-tp2")  # nothing else uses it: free the cores

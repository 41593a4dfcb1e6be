"""What users get without the NIXL hardening (``DSV4_SM120_NIXL_HARDENING=0``): the pin's bootstrap thread.

One PD set with the switch off serves both scenarios, in this order (the
second wedges it for good, so it is stopped right after):

* (a) the 80-session abort storm x 3: the pin handles ABORT frames itself,
  so a plain storm is expected to recover; whether the pin
  leaves rooms behind is not visible from outside (its tables have no gauge);
* (b) one foreign frame at the bootstrap socket: the thread dies, every later
  request stalls, and /health stays 200 on all three processes.
"""

from __future__ import annotations

import time

import pytest

from harness import checks, hostile
from harness.storm import run_and_check
from harness.traffic import burst

KEY = "pd-tp1-hardening-off"
OFF = {"DSV4_SM120_NIXL_HARDENING": "0"}
FIX = "DSV4_SM120_NIXL_HARDENING=0"


@pytest.fixture
def pin_set(clusters):
    return clusters(KEY, switches=OFF, tag="-hardening-off")


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
def test_abort_storm_on_the_pin_bootstrap_thread(pin_set, e2e_env, tmp_path, record):
    run_and_check(e2e_env.cli_argv, pin_set, tmp_path, record, fix=FIX)


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_one_foreign_frame_wedges_the_pin(pin_set, clusters, record):
    try:
        first = burst(pin_set.front, 2, timeout=60)
        for endpoint in hostile.rank_endpoints(pin_set.bootstrap_port, pin_set.tp):
            hostile.send(endpoint, [[b"HELLO"]])
        time.sleep(2)
        later = burst(pin_set.front, 8, timeout=45)
        health = checks.health(pin_set)
        wedge_log = "AssertionError" in pin_set.prefill.log.read_text(errors="replace")
        record("b: hostile frames", FIX, tp=pin_set.tp, before_frame=first, later_requests=later,
               health=health, prefill_log_shows_assertion=wedge_log)
        assert first["completed"] == 2, first
        assert later["completed"] == 0, f"the pin served after a foreign frame: {later}"
        assert set(health.values()) == {200}, f"the pin's /health noticed: {health}"
    finally:
        clusters.discard(KEY)  # wedged for good

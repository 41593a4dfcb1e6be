"""Scenario (e): ``kill -9`` of the whole decode server in the middle of a storm, then a new decode.

The prefill must let go of every room the dead decode held (read from its own
/metrics), keep a truthful /health (the prefill itself is fine: 200), and serve
again through the router once a new decode comes up on the same address.
"""

from __future__ import annotations

import subprocess
import time

import pytest

import checks
import results
import cluster as cluster_mod
from cluster import chat


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
def test_decode_killed_mid_storm_prefill_lets_go_and_serves_a_new_decode(clusters, e2e_env, tmp_path, record):
    key = "pd-tp1-decode-killed"
    c = clusters(key, switches={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
                                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}, tag="-decode-killed")
    try:
        storm = subprocess.Popen(
            [str(e2e_env.bin / "dsv4-sm120"), "storm-client", "--base-url", c.front, "--model", "tiny",
             "--sessions", "80", "--rounds", "1", "--cancel-after", "20", "--prompt-words", "300",
             "--storm-max-tokens", "2048", "--deadline", "30", "--out", str(tmp_path / "storm.json")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(8)
        c.decode.kill9()
        killed_at = time.monotonic()
        prefill_health = checks.health(c)["prefill"]
        left = checks.settle(c, timeout=150, only=[c.prefill])
        released_s = round(time.monotonic() - killed_at, 1)
        log = c.prefill.log.read_text(errors="replace")
        reasons = sorted({line.split("]", 1)[-1].strip()[:160] for line in log.splitlines()
                          if "Failed" in line or "failed" in line or "abort" in line.lower()})[-8:]
        storm.wait(120)
        c.decode.start()
        c.decode.wait_ready("/health", cluster_mod.STARTUP_S)
        deadline, after = time.monotonic() + 180, 0
        while time.monotonic() < deadline and after != 200:
            after = chat(c.front, timeout=30)[0]
            time.sleep(2)
        health = checks.health(c)
        left_end = checks.settle(c)
        record("e: decode killed", results.suite_fix(), prefill_health_after_kill=prefill_health, prefill_leftovers=left,
               prefill_released_after_s=released_s, prefill_log_lines=reasons, request_after_new_decode=after,
               health=health, leaks_end=left_end)
        assert prefill_health == 200
        assert left == {}, f"the prefill still holds after the decode died: {left}"
        assert after == 200 and set(health.values()) == {200}, (after, health)
        assert left_end == {}, left_end
    finally:
        clusters.discard(key)

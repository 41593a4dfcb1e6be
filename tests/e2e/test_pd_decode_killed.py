"""Scenario (e): ``kill -9`` of the whole decode server in the middle of a storm, then a new decode.

The prefill must let go of every room the dead decode held (read from its own
/metrics), keep a truthful /health (the prefill itself is fine: 200), and serve
again through the router once a new decode comes up on the same address.
"""

from __future__ import annotations

import pytest

from harness import cluster as cluster_mod
from harness.decode_kill import kill_decode_mid_storm
from tests.e2e import results

CLIENT = ("--cancel-after", "20", "--prompt-words", "300", "--storm-max-tokens", "2048", "--deadline", "30")


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a set of its own to start: minutes on a loaded 2-core machine
def test_decode_killed_mid_storm_prefill_lets_go_and_serves_a_new_decode(clusters, e2e_env, tmp_path, record):
    key = "pd-tp1-decode-killed"
    c = clusters(key, switches={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
                                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}, tag="-decode-killed")
    try:
        seen = kill_decode_mid_storm(e2e_env.cli_argv, c, tmp_path / "storm.json", CLIENT, kill_after_s=8,
                                     startup_s=cluster_mod.STARTUP_S)
        record("e: decode killed", results.suite_fix(), **seen)
        assert seen["prefill_health_after_kill"] == 200
        assert seen["prefill_leftovers"] == {}, f"the prefill still holds after the decode died: {seen['prefill_leftovers']}"
        assert seen["prefill_released_after_s"] is not None  # when it let go, not when the wait gave up
        assert seen["request_after_new_decode"] == 200 and set(seen["health"].values()) == {200}, seen
        assert seen["leaks_end"] == {}, seen["leaks_end"]
    finally:
        clusters.discard(key)

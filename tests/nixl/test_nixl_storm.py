"""Abort storms over the real loopback pair: no wedged round, no leaked room, byte-exact recovery."""

from __future__ import annotations

import pytest

from dsv4_sm120.loopback.abort_storm import run_storm


def _assert_storm_clean(summary, rounds, fresh):
    assert summary["wedged_rounds"] == 0, summary["per_round"]
    assert summary["leaked_rooms"] == 0, summary["per_round"]
    assert summary["thread_alive"]
    # Every post-storm session concluded Success on both sides and matched byte for byte.
    assert summary["completed_after_storm"] == fresh * rounds
    assert summary["recover_s_max"] is not None and summary["recover_s_max"] < 2.0
    assert summary["aborted"] == summary["sessions"] * rounds


def test_abort_storm_80_sessions_x2(pd):
    before = pd.hardening.rejects.snapshot()  # the pair is shared: count only what this storm did
    summary = run_storm(sessions=80, rounds=2, fresh=8, harness=pd, seed=3)
    _assert_storm_clean(summary, 2, 8)
    after = pd.hardening.rejects.snapshot()
    # The storm really exercised the dangerous paths.
    assert after["late_frames_dropped"] > before["late_frames_dropped"]
    assert after["frames_rejected"] - before["frames_rejected"] >= 2  # one foreign frame per round


@pytest.mark.slow
def test_abort_storm_80_sessions_x20(pd):
    summary = run_storm(sessions=80, rounds=20, fresh=8, harness=pd, seed=4)
    _assert_storm_clean(summary, 20, 8)

"""``storm-client`` against the fake server: it must call a wedged server wedged, and a healthy or slow one healthy."""

from __future__ import annotations

import json

from dsv4_sm120 import cli


def _storm(server, capsys, *extra: str) -> tuple[int, dict]:
    rc = cli.main(["storm-client", "--base-url", server.url + "/v1", "--model", "fake-dsv4", "--probe-interval", "0.2", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_healthy_server_recovers_and_every_session_was_cut_mid_stream(server, capsys, monkeypatch):
    # Every switch away from its default: the report must record what is in force, not the defaults.
    in_force = {"DSV4_SM120_ALLOW_PIN_MISMATCH": "1", "DSV4_SM120_INDEX_K_DTYPE": "fp8",
                "DSV4_SM120_INDEX_K_SELECT": "two_stage", "DSV4_SM120_INDEX_K_CHECKSUM": "1",
                "DSV4_SM120_NIXL_HARDENING": "0", "DSV4_SM120_COLLECTIVE_GUARD": "0"}
    for env, value in in_force.items():
        monkeypatch.setenv(env, value)
    server.reset(token_delay_s=0.05)
    rc, out = _storm(server, capsys, "--sessions", "40", "--cancel-after", "2", "--deadline", "5", "--probe-interval", "10")
    assert rc == 0 and out["verdict"] == "healthy"
    [r] = out["rounds"]
    # Every session was in flight at the cancel (on a loaded machine a few may still wait for a first frame).
    assert r["streaming_at_cancel"] + r["waiting_at_cancel"] == 40 and r["streaming_at_cancel"] > 0
    assert r["finished_before_cancel"] == r["failed_before_cancel"] == 0
    assert 0 < out["recovery_s"] < 5
    # The cancel closed every connection, as a killed agent does: the server saw each stream it had
    # started cut (one fresh request only: the next would have been sent 10 s later, so none of ours).
    assert r["streaming_at_cancel"] <= server.aborts <= 40
    assert out["switches_in_force"] == in_force


def test_server_that_never_answers_after_the_storm_is_wedged(server, capsys):
    server.reset(token_delay_s=0.05, wedge_after_aborts=20)
    rc, out = _storm(server, capsys, "--sessions", "40", "--cancel-after", "2", "--deadline", "3")
    assert rc == 1 and out["verdict"] == "wedged"
    assert out["recovery_s"] is None and out["rounds"][0]["recovery_s"] is None
    # The fake really was wedged by the storm, and the fresh requests reached it and hung there.
    assert server.aborts >= 20
    assert out["rounds"][0]["probes_sent"] >= 2 and server.hung >= 2


def test_slow_stream_is_not_called_wedged(server, capsys):
    # Each fresh request is 12 frames 100 ms apart (>= 1.2 s): slow, but it completes within the deadline.
    server.reset(token_delay_s=0.1)
    rc, out = _storm(server, capsys, "--sessions", "10", "--cancel-after", "0.5", "--deadline", "8")
    assert rc == 0 and out["verdict"] == "healthy"
    assert out["recovery_s"] >= 1.2 and out["baseline_probe_s"] >= 1.2


def test_server_that_refuses_for_a_while_then_serves_is_healthy_after_that_while(server, capsys):
    server.reset(token_delay_s=0.01, unavailable_after_aborts=5, unavailable_for_s=1.5)
    rc, out = _storm(server, capsys, "--sessions", "5", "--cancel-after", "1", "--deadline", "6")
    assert rc == 0 and out["verdict"] == "healthy"
    [r] = out["rounds"]
    assert out["recovery_s"] >= 1.4 and r["probes_failed"] >= 3 and "recovering from the storm" in r["probe_errors"][0]
    assert server.refused == r["probes_failed"]


def test_server_wedged_before_the_storm_is_reported_as_such(server, capsys):
    server.reset(wedge_after_aborts=0)
    rc, out = _storm(server, capsys, "--sessions", "5", "--cancel-after", "0.5", "--deadline", "1")
    assert rc == 2 and out["verdict"] == "unhealthy_before_storm" and out["rounds"] == []
    assert "Timeout" in out["baseline_error"]


def test_rounds_stop_at_the_first_wedge(server, capsys):
    server.reset(token_delay_s=0.05, wedge_after_aborts=15)
    rc, out = _storm(server, capsys, "--sessions", "10", "--cancel-after", "1", "--deadline", "1.5", "--rounds", "3")
    assert rc == 1
    assert [r["recovery_s"] is None for r in out["rounds"]] == [False, True]

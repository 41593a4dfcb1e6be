"""The abort-storm scenario (a) as one call, shared by the default, TP=2 and pin-behaviour tests."""

from __future__ import annotations

import json

import checks
from cluster import chat

SESSIONS, ROUNDS = 80, 3


def _storm(env, cluster, out_path) -> dict:
    proc = env.cli("storm-client", "--base-url", cluster.front, "--model", "tiny", "--sessions", str(SESSIONS),
                   "--rounds", str(ROUNDS), "--cancel-after", "4", "--prompt-words", "300",
                   "--storm-max-tokens", "512", "--deadline", "150", "--probe-interval", "3",
                   "--device", "CPU (2 cores), tiny dummy Llama, PD over NIXL", "--out", str(out_path),
                   timeout=900)
    assert out_path.exists(), f"storm-client wrote nothing (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out_path.read_text())


def run_and_check(env, cluster, tmp_path, record, fix: str) -> None:
    before = checks.dsv4_counters(cluster)
    storm = _storm(env, cluster, tmp_path / "storm.json")
    fresh = chat(cluster.front, timeout=120)[0]
    health = checks.health(cluster)
    left = checks.settle(cluster)
    rounds = storm.get("rounds", [])
    record("a: abort storm", fix, tp=cluster.tp, sessions=SESSIONS, rounds=len(rounds), verdict=storm["verdict"],
           recovery_s=[r.get("recovery_s") for r in rounds],
           streaming_at_cancel=[r.get("streaming_at_cancel") for r in rounds],
           waiting_at_cancel=[r.get("waiting_at_cancel") for r in rounds],
           fresh_request_status=fresh, health=health, leaks=left,
           metric_deltas=checks.delta(before, checks.dsv4_counters(cluster)))
    assert storm["verdict"] == "healthy", json.dumps(storm, indent=1)[:3000]
    assert len(rounds) == ROUNDS
    assert sum(r["streaming_at_cancel"] + r["waiting_at_cancel"] for r in rounds) > 0, "nothing was in flight at a cancel"
    assert fresh == 200
    assert set(health.values()) == {200}, health
    assert left == {}, f"left behind after the storm: {left}"

"""The abort-storm scenario (a) as one call, shared by the default, TP=2 and pin-behaviour tests and by the
GPU host's ``pd`` set (``bench/gpu_server/pd.py``, with its own storm-client options)."""

from __future__ import annotations

import json
import subprocess

from harness import checks
from harness.cluster import chat

SESSIONS, ROUNDS = 80, 3
# storm-client's options on the CPU sets (2 shared cores): short prompts, a generous recovery deadline
CPU_CLIENT = ("--cancel-after", "4", "--prompt-words", "300", "--storm-max-tokens", "512", "--deadline", "150",
              "--probe-interval", "3", "--device", "CPU (2 cores), tiny dummy Llama, PD over NIXL")


def _storm(cli: list[str], cluster, out_path, client: tuple, timeout: float) -> dict:
    proc = subprocess.run([*cli, "storm-client", "--base-url", cluster.front, "--model", "tiny",
                           "--sessions", str(SESSIONS), "--rounds", str(ROUNDS), *client, "--out", str(out_path)],
                          capture_output=True, text=True, timeout=timeout)
    assert out_path.exists(), f"storm-client wrote nothing (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out_path.read_text())


def run_and_check(cli: list[str], cluster, tmp_path, record, fix: str, client: tuple = CPU_CLIENT,
                  timeout: float = 900) -> None:
    """The storm by ``cli`` (the ``dsv4-sm120`` command) through the front, recorded, then checked."""
    before = checks.dsv4_counters(cluster)
    storm = _storm(cli, cluster, tmp_path / "storm.json", client, timeout)
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

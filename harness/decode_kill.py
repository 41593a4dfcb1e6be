"""Scenario (e) as one call: ``kill -9`` of the whole decode server in the middle of a storm, then a new decode.

Shared by the CPU test (``test_pd_decode_killed.py``) and the GPU host's ``pd`` set
(``bench/gpu_server/pd.py``), each with its own storm-client options and bounds.
"""

from __future__ import annotations

import subprocess
import time

from harness import checks
from harness.cluster import wait_serving
from harness.servers import ServerFailed


def kill_decode_mid_storm(cli: list[str], c, out_path, client: tuple, kill_after_s: float, startup_s: float,
                          release_s: float = 150.0, storm_s: float = 120.0, serve_s: float = 180.0) -> dict:
    """An 80-session storm (one round, storm-client options ``client``) by ``cli`` through the front; the decode
    killed ``kill_after_s`` in; then, each wait bounded: the prefill letting go of everything (``release_s``),
    the storm client's end (``storm_s``), the same decode started again (``startup_s``) and a chat through the
    front (``serve_s``; the answer 200, or why none came). The figures; nothing is asserted.
    ``prefill_released_after_s`` is when the prefill was first seen holding nothing (polled every 2 s), None
    when it still held something at ``release_s`` (``prefill_leftovers`` then says what)."""
    storm = subprocess.Popen([*cli, "storm-client", "--base-url", c.front, "--model", "tiny", "--sessions", "80",
                              "--rounds", "1", *client, "--out", str(out_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(kill_after_s)
        c.decode.kill9()
        killed_at = time.monotonic()
        prefill_health = checks.health(c)["prefill"]
        left, released_s = checks.released(c, killed_at, release_s, only=[c.prefill])
        log = c.prefill.log.read_text(errors="replace")
        reasons = sorted({line.split("]", 1)[-1].strip()[:160] for line in log.splitlines()
                          if "Failed" in line or "failed" in line or "abort" in line.lower()})[-8:]
        storm.wait(storm_s)
    finally:
        if storm.poll() is None:
            storm.kill()
            storm.wait()
    c.decode.start()
    c.decode.wait_ready("/health", startup_s)
    try:
        wait_serving(c, serve_s)
        after = 200
    except ServerFailed as exc:  # recorded, not raised: the caller asserts on it
        after = str(exc)[:400]
    return {"prefill_health_after_kill": prefill_health, "prefill_leftovers": left,
            "prefill_released_after_s": released_s, "prefill_log_lines": reasons, "request_after_new_decode": after,
            "health": checks.health(c), "leaks_end": checks.settle(c)}

"""The instruments are reachable as ``dsv4-sm120`` subcommands and as ``python -m bench.serving.*`` from a checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120 import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "wrapper, prog",
    [("bench_serving", "bench-serving"), ("storm_client", "storm-client"), ("toolcall_check", "toolcall-check"),
     ("agent_bench", "agent-bench")],
)
def test_checkout_wrappers_run(wrapper, prog):
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.serving.{wrapper}", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: dsv4-sm120 {prog}") and "--base-url" in proc.stdout


def test_subcommands_reach_the_live_server(server, capsys):
    rc = cli.main(["storm-client", "--base-url", server.url, "--model", "fake-dsv4", "--sessions", "3",
                   "--cancel-after", "0.5", "--deadline", "3", "--launch-flags", "launch --model-impl dsv4"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["verdict"] == "healthy" and out["launch_flags"] == ["launch --model-impl dsv4"]
    rc = cli.main(["toolcall-check", "--base-url", server.url, "--model", "fake-dsv4", "--concurrency", "1",
                   "--sessions", "1", "--turns", "2"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["levels"][0]["tool_call"] == 2


def test_unreachable_server_is_unhealthy_not_a_traceback(capsys):
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    rc = cli.main(["storm-client", "--base-url", "http://127.0.0.1:9", "--model", "m", "--deadline", "2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and out["verdict"] == "unhealthy_before_storm" and "Connect" in out["baseline_error"]

"""The package's clients against a real PD set: ``toolcall-check`` must report what a random model returns.

The tiny model has random weights and the servers run no tool-call parser, so
no turn can be a structured tool call: the honest verdict is "inconclusive"
(nothing measured, exit 2), never "clean" (a pass) or "corrupted" (a fail).
"""

from __future__ import annotations

import json

from harness import checks, scrape


def test_toolcall_check_on_a_random_model_is_inconclusive(pd, e2e_env, tmp_path, record):
    out = tmp_path / "toolcall.json"
    proc = e2e_env.cli("toolcall-check", "--base-url", pd.front, "--model", "tiny", "--concurrency", "1", "4",
                       "--sessions", "4", "--turns", "2", "--max-tokens", "16", "--request-timeout", "120",
                       "--level-timeout", "300", "--out", str(out), timeout=700)
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    kinds = [{k: level[k] for k in ("tool_call", "content", "corrupted", "request_errors")} for level in report["levels"]]
    record("toolcall-check", "default", verdict=report["verdict"], exit=proc.returncode, kinds=kinds)
    assert report["verdict"] == "inconclusive" and proc.returncode == 2, json.dumps(report)[:2000]
    assert all(k["tool_call"] == 0 and k["corrupted"] == 0 for k in kinds), kinds
    assert sum(k["content"] for k in kinds) > 0, f"no turn was answered at all: {kinds}"


def test_agent_bench_through_the_router_reads_the_prefill_cache_hits_and_leaves_nothing(pd, e2e_env, tmp_path, record):
    out = tmp_path / "agent.json"
    proc = e2e_env.cli("agent-bench", "--base-url", pd.front, "--model", "tiny", "--metrics-url", pd.prefill.url,
                       "--sessions", "6", "--groups", "2", "--concurrency", "3", "--turns", "2", "--prefix-words", "120",
                       "--turn-words", "20", "--max-tokens", "8", "--cut-fraction", "0.25", "--out", str(out),
                       timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    level = json.loads(out.read_text())["levels"][0]
    record("agent-bench", "default", **{k: level[k] for k in ("served", "cut", "failed", "server_cache_hit")})
    assert proc.returncode == 0 and level["failed"] == 0 and level["served"] + level["cut"] == 12, level
    assert level["prompt_tokens"] > 0 and level["server_cache_hit"] > 0, level  # the groups' shared prefixes
    assert checks.settle(pd) == {}  # the cut streams' requests are gone on both sides
    # what the fixes cost where they run, on both servers' /metrics: the NIXL hardening's and the guard's hooks
    # were called on each scheduler's loop and timed
    for proc in (pd.prefill, pd.decode):
        samples = scrape.metrics(proc.url)
        for fix in ("nixl", "guard"):
            calls = scrape.total(samples, "sglang:dsv4_hook_calls_total", fix=fix, thread="main")
            seconds = scrape.total(samples, "sglang:dsv4_hook_seconds_total", fix=fix, thread="main")
            assert calls > 0 and seconds > 0, (proc.name, fix, calls, seconds)

"""``toolcall-check`` against the fake server: it counts leaked markup and bad arguments per concurrency, and nothing else."""

from __future__ import annotations

import json

from dsv4_sm120 import cli


def _check(server, capsys, *extra: str) -> tuple[int, dict]:
    rc = cli.main(["toolcall-check", "--base-url", server.url, "--model", "fake-dsv4", "--turns", "4", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_healthy_server_is_clean_at_every_level(server, capsys):
    rc, out = _check(server, capsys, "--concurrency", "1", "4")
    assert rc == 0 and out["verdict"] == "clean"
    for level in out["levels"]:
        # 8 sessions x (2 tool calls, then 2 plain answers): the fake model's script.
        assert (level["tool_call"], level["content"], level["corrupted"]) == (16, 16, 0)
        assert level["corruption_rate"] == 0.0 and level["examples"] == [] and level["request_errors"] == 0


def test_dsml_markup_in_content_is_counted_with_examples(server, capsys):
    server.reset(markup_when_inflight=1)  # every tool call leaks as text, in 5-character frames
    rc, out = _check(server, capsys, "--concurrency", "2", "--examples", "3")
    assert rc == 1 and out["verdict"] == "corrupted"
    [level] = out["levels"]
    assert level["corrupted"] == level["turns"] == 32 and level["tool_call"] == 0
    assert level["corruption_rate"] == 1.0 and level["reasons"] == {"markup_in_content": 32}
    assert len(level["examples"]) == 3
    assert all("<｜DSML｜tool_calls>" in ex["excerpt"] for ex in level["examples"])


def test_corruption_that_needs_load_shows_only_at_high_concurrency(server, capsys):
    # The production shape: clean at C=1, markup leaks once >= 3 requests are in flight.
    server.reset(markup_when_inflight=3, token_delay_s=0.005)
    rc, out = _check(server, capsys, "--concurrency", "1", "6", "--turns", "2")
    assert rc == 1
    low, high = out["levels"]
    assert low["corrupted"] == 0 and low["corruption_rate"] == 0.0
    assert high["corrupted"] > 0 and high["corruption_rate"] > 0
    assert 3 <= server.max_inflight <= 6  # the level really ran concurrently, never above its C


def test_unparsable_arguments_are_corrupted(server, capsys):
    server.reset(bad_arguments_when_inflight=1)
    rc, out = _check(server, capsys, "--concurrency", "1", "--sessions", "2")
    assert rc == 1
    [level] = out["levels"]
    # The harness answers a bad call with a tool error, as an agent would; the fake model then
    # counts it as a tool result: 2 sessions x (2 corrupted calls, then 2 plain answers).
    assert (level["corrupted"], level["content"]) == (4, 4)
    assert level["reasons"] == {"unparsable_arguments": 4}
    assert level["examples"][0]["excerpt"].startswith('list_dir({"path": "src/ma')


def test_slow_streams_are_clean_and_whole_replies_are_checked_too(server, capsys):
    server.reset(token_delay_s=0.02)
    rc, out = _check(server, capsys, "--concurrency", "2", "--sessions", "2")
    assert rc == 0 and out["levels"][0]["tool_call"] == 4
    server.reset(markup_when_inflight=1)
    rc, out = _check(server, capsys, "--concurrency", "2", "--sessions", "2", "--no-stream")
    assert rc == 1 and out["levels"][0]["reasons"] == {"markup_in_content": 8}


def test_a_model_that_never_calls_tools_is_inconclusive(server, capsys):
    server.reset(tool_turns=0)
    rc, out = _check(server, capsys, "--concurrency", "1", "--sessions", "1")
    assert rc == 2 and out["verdict"] == "inconclusive"
    assert out["levels"][0]["content"] == 4 and out["levels"][0]["corruption_rate"] is None


def test_request_errors_are_not_corruption(server, capsys):
    server.reset(wedge_after_aborts=0)  # every request hangs: each times out
    rc, out = _check(server, capsys, "--concurrency", "2", "--sessions", "2", "--request-timeout", "0.5")
    assert rc == 2
    [level] = out["levels"]
    assert level["request_errors"] == 2 and level["turns"] == 0 and "TimeoutError" in level["error_examples"][0]

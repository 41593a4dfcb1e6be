"""``dsv4-sm120 agent-bench`` against the fake OpenAI server: the same prompts whatever the replies, sessions that
come back in turn, cut streams counted apart, the ABBA order of repetitions, and clear failures."""

from __future__ import annotations

import argparse
import json

import pytest

from dsv4_sm120 import cli
from dsv4_sm120.instruments import agent_bench


def _args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    agent_bench.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--model", "m"])
    vars(args).update(over)
    return args


def test_a_session_sends_the_same_history_whatever_came_back_and_starts_over_when_too_long():
    args = _args(sessions=4, groups=2, prefix_words=20, turn_words=10, max_history_words=25)
    a, b = agent_bench.sessions(args), agent_bench.sessions(args)
    assert a[0].system == a[2].system != a[1].system  # a group shares its prefix
    for _ in range(2):
        for s in (a[0], b[0]):
            s.advance(args.turn_words, args.max_history_words, args.seed)
    assert a[0].messages() == b[0].messages() and len(a[0].messages()) == 2 + 4
    assert a[0].messages()[3]["role"] == "tool" and len(a[0].messages()[3]["content"].split()) == 10
    a[0].advance(args.turn_words, args.max_history_words, args.seed)  # 30 words > 25: a new task
    assert a[0].history == [] and a[0].task_no == 1 and "Task 1 " in a[0].messages()[1]["content"]


def test_levels_serve_every_turn_count_cuts_apart_and_repeat_in_abba_order(server, tmp_path, capsys):
    out = tmp_path / "agent.json"
    rc = cli.main(["agent-bench", "--base-url", server.url, "--model", "fake-dsv4", "--sessions", "6", "--groups", "2",
                   "--concurrency", "2", "3", "--turns", "2", "--prefix-words", "30", "--turn-words", "10",
                   "--max-tokens", "8", "--cut-fraction", "0.3", "--repetitions", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and json.loads(capsys.readouterr().out) == record
    levels = record["levels"]
    assert [(lv["repetition"], lv["concurrency"]) for lv in levels] == [(1, 2), (1, 3), (2, 3), (2, 2)]
    for lv in levels:
        assert lv["turns"] == 12 and lv["served"] + lv["cut"] == 12 and lv["failed"] == 0 and lv["not_started"] == 0
        assert lv["ttft_p50_s"] > 0 and lv["itl_p50_s"] > 0 and lv["output_tokens"] >= lv["served"]
        assert lv["ttft_p50_s"] <= lv["ttft_max_s"] <= lv["latency_max_s"]
        assert lv["ttft_p50_s"] < lv["latency_p50_s"] <= lv["latency_p90_s"] <= lv["latency_max_s"]
        assert lv["latency_max_s"] <= lv["latency_sum_s"] <= lv["duration_s"] * int(lv["concurrency"])
        assert lv["server_cache_hit"] is None  # the fake server has no /metrics
    assert sum(lv["cut"] for lv in levels) > 0
    assert record["workload"]["cut_fraction"] == 0.3 and record["tool"] == "dsv4-sm120 agent-bench"


def test_an_unreachable_server_fails_every_turn_and_exits_1(capsys):
    rc = cli.main(["agent-bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--sessions", "2",
                   "--concurrency", "1", "--turns", "1"])
    level = json.loads(capsys.readouterr().out)["levels"][0]
    assert rc == 1 and level["failed"] == 2 and level["served"] == 0 and "Connect" in level["errors"][0]


def test_a_cut_fraction_out_of_range_is_a_clear_error():
    with pytest.raises(SystemExit, match="--cut-fraction 1.0 must be in"):
        cli.main(["agent-bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--cut-fraction", "1"])

"""The ``pd`` set's own code on the CPU, against stand-in processes, so a GPU host's time is not spent finding its bugs.

No DeepSeek-V4 forward, NIXL transfer or PD router runs here: each server and router is ``pd_standin.py`` (test
infrastructure), started with the launch line the set builds for the real one. What is real: ``run.py``'s
``run pd`` from arguments to JSON, the pairs' launch lines and switches, the process handling (started at once,
health, a router after its pair, ``kill -9`` of a decode and the same decode started again, every process
stopped), the storm by the package's own ``storm-client``, the hostile frames over ZMQ to the socket the
bootstrap server names, the e2e suite's checks, the scenarios' order, bounds and records. The tokenizer the
servers get is checked against sglang's own DeepSeek-V4 chat encoding.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench.gpu_server import agents, incident, pd, run
from bench.gpu_server.servers import ServerSpec

STANDIN = Path(__file__).resolve().parent / "pd_standin.py"


@pytest.fixture
def standins(monkeypatch):
    """Every server and router of the set is a stand-in process; scenario sizes and waits are cut to seconds."""
    real_argv, real_router = ServerSpec.argv, pd.cluster.pd_router

    def argv(self, models_root, port):
        return [sys.executable, str(STANDIN), *real_argv(self, models_root, port)[3:]]

    def router(*a, **kw):
        proc = real_router(*a, **kw)
        proc.argv = [sys.executable, str(STANDIN), *proc.argv[3:]]
        return proc

    monkeypatch.setattr(ServerSpec, "argv", argv)
    monkeypatch.setattr(pd.cluster, "pd_router", router)
    monkeypatch.setattr(run, "host_facts", lambda: {"device": "CPU stand-ins"})
    monkeypatch.setattr(pd, "patch_sglang", lambda: {"stand-in": "the patch command is tested on a copy of sglang"})
    monkeypatch.setattr(pd.hostile, "frames", lambda rng: {"foreign tag": [[b"HELLO"]], "short": [[b"a", b"b"]]})
    monkeypatch.setattr(pd.hostile, "TRAFFIC_BEFORE_S", 0.2)
    monkeypatch.setattr(pd.hostile, "TRAFFIC_AFTER_S", 0.2)
    monkeypatch.setattr(pd, "STORM_CLIENT", ("--cancel-after", "0.5", "--prompt-words", "5",
                                             "--storm-max-tokens", "100", "--deadline", "5", "--probe-interval", "0.2"))
    monkeypatch.setattr(pd, "KILL_CLIENT", ("--cancel-after", "1", "--prompt-words", "5", "--storm-max-tokens", "100",
                                            "--deadline", "1"))
    monkeypatch.setattr(pd, "KILL_AFTER_S", 0.5)
    monkeypatch.setattr(pd, "LONG_REQUESTS", 4)
    monkeypatch.setattr(pd, "HARDENING_OFF_TIMEOUT_S", 1.0)


def test_run_pd_records_every_scenario_on_standins(standins, tmp_path):
    t0 = time.monotonic()
    out = tmp_path / "pd.json"
    assert run.main(["pd", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    res, servers = record["results"], record["servers"]
    assert list(res) == ["patch", "budget_s", "a_abort_storm", "b_hostile_frames", "c_pd_checksum", "d_decode_killed",
                         "b_hostile_frames_hardening_off"]
    assert not any("error" in r or "skipped" in r for r in res.values() if isinstance(r, dict)), res

    storm = res["a_abort_storm"]
    assert storm["verdict"] == "healthy" and len(storm["recovery_s"]) == 3 and storm["leaks"] == {}
    assert storm["fresh_request_status"] == 200 and set(storm["health"].values()) == {200}
    hostile = res["b_hostile_frames"]
    assert hostile["later_requests"]["completed"] == 8 and hostile["rejected_by_reason"] == {"unknown tag": 2.0}
    assert hostile["prefill_log_errors"] == []
    checksum = res["c_pd_checksum"]
    assert checksum["completed"] == 4
    assert checksum["deltas"]["sglang:dsv4_index_k_pd_pages_checked_total"] == 24
    assert checksum["deltas_since_serving"]["sglang:dsv4_index_k_pd_pages_checked_total"] > 24
    killed = res["d_decode_killed"]
    assert killed["prefill_health_after_kill"] == 200 and killed["request_after_new_decode"] == 200
    assert killed["dead_after"] == [] and set(killed["health"].values()) == {200}
    off = res["b_hostile_frames_hardening_off"]
    assert off["fix"] == "DSV4_SM120_NIXL_HARDENING=0"
    assert off["later_requests"]["completed"] == 0 and off["bootstrap_threads_alive"] == 0  # the stand-in's "wedge"
    assert off["prefill_log_errors"] == ["Exception in thread bootstrap (stand-in): AssertionError"]

    assert set(servers) == {"prefill", "decode", "router", "prefill_hardening_off", "decode_hardening_off",
                            "router_hardening_off"}
    for name in ("prefill", "decode", "prefill_hardening_off", "decode_hardening_off"):
        line = servers[name]["launch"]
        mode = name.split("_")[0]
        assert f"--disaggregation-mode {mode}" in line and "--disaggregation-transfer-backend nixl" in line
        assert "--model-impl dsv4" in line and "--tokenizer-path" in line and "--skip-tokenizer-init" not in line
        assert "DSV4_SM120_INDEX_K_CHECKSUM=1" in line and "SGLANG_HOST_IP=127.0.0.1" in line
        assert ("DSV4_SM120_NIXL_HARDENING=0" in line) == name.endswith("hardening_off")
        assert servers[name]["healthy_after_s"] is not None
    boot = {n: servers[n]["launch"].split("--disaggregation-bootstrap-port ")[1].split()[0] for n in servers
            if not n.startswith("router")}
    assert boot["prefill"] == boot["decode"] != boot["prefill_hardening_off"] == boot["decode_hardening_off"]
    assert f" {boot['prefill']} --decode http://127.0.0.1:" in servers["router"]["launch"]
    assert (tmp_path / "logs_pd.tar.xz").exists()
    assert time.monotonic() - t0 < 60


def test_a_run_of_the_decode_kill_alone_starts_one_pair_and_records_its_room_releases(standins, monkeypatch, tmp_path):
    monkeypatch.setattr(pd, "ONLY", {"d_decode_killed"})
    out = tmp_path / "pd.json"
    assert run.main(["pd", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    assert set(record["servers"]) == {"prefill", "decode", "router"}  # no idle hardening-off pair on the GPU
    killed = record["results"]["d_decode_killed"]
    assert killed["request_after_new_decode"] == 200 and isinstance(killed["prefill_room_releases"], dict)
    assert record["results"]["b_hostile_frames_hardening_off"] == {"skipped": "not in DSV4_GPU_PD_SCENARIOS"}


def test_a_scenario_that_raises_is_recorded_and_one_without_time_is_skipped():
    pair = pd.Pair("", "default", [], pd.cluster.Cluster(pd.processes.ServerSet(), front=""))
    out: dict = {}
    pd._scenario(out, "a_abort_storm", pair, time.monotonic() + 1000, lambda res: res.update(x=1) or 1 / 0)
    pd._scenario(out, "d_decode_killed", pair, time.monotonic() + 10, lambda res: res.update(ran=True))
    assert out["a_abort_storm"]["x"] == 1 and out["a_abort_storm"]["error"].startswith("ZeroDivisionError")
    assert "ran" not in out["d_decode_killed"]
    assert f"needs {pd.NEEDS_S['d_decode_killed']}" in out["d_decode_killed"]["skipped"]


def test_only_the_named_scenarios_run(monkeypatch):
    pair = pd.Pair("", "default", [], pd.cluster.Cluster(pd.processes.ServerSet(), front=""))
    monkeypatch.setattr(pd, "ONLY", {"b_hostile_frames_hardening_off"})
    out: dict = {}
    pd._scenario(out, "a_abort_storm", pair, time.monotonic() + 1000, lambda res: res.update(ran=True))
    pd._scenario(out, "b_hostile_frames_hardening_off", pair, time.monotonic() + 1000, lambda res: res.update(ran=True))
    assert out["a_abort_storm"] == {"skipped": "not in DSV4_GPU_PD_SCENARIOS"}
    assert out["b_hostile_frames_hardening_off"]["ran"]


def test_mem_fraction_reaches_every_server_of_a_set(monkeypatch, tmp_path):
    seen = []

    def refuse(spec, models_root, log_dir):
        seen.append(spec.mem_fraction)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(run, "start", refuse)
    assert run.main(["cost", "--out", str(tmp_path / "c.json"), "--mem-fraction", "0.55"]) == 1
    assert seen == [0.55]  # the first start refused; the spec it got carried the share
    assert "no GPU here" in json.loads((tmp_path / "c.json").read_text())["error"]


def test_the_servers_tokenizer_renders_a_storm_prompt_past_2048_tokens_in_dsv4s_chat_encoding(tmp_path):
    import argparse

    from sglang.srt.parser.deepseek_recipe_renderer import IMAGE_TOKEN, DeepSeekRecipe
    from transformers import AutoTokenizer

    from harness import dsv4_checkpoints
    from dsv4_sm120.instruments import storm_client

    tok = AutoTokenizer.from_pretrained(str(pd.write_tokenizer(tmp_path / "tok")))
    cfg = dsv4_checkpoints.config("tiny")
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert pd.DSV4_IMAGE_TOKEN == IMAGE_TOKEN
    recipe = DeepSeekRecipe.from_hf_tokenizer("dsv4", tok)  # what sglang builds at startup for a DeepseekV4 model
    storm_args = argparse.Namespace(prompt_words=pd.PROMPT_WORDS, model="tiny", storm_max_tokens=8, ignore_eos=True)
    for messages in (storm_client._storm_payload(storm_args, 0, 1)["messages"],
                     [{"role": "user", "content": pd.long_text(0)}]):
        for thinking in (False, True):
            ids = recipe.encode({"messages": messages, "thinking": thinking})
            assert 2048 < len(ids) < 4096 and max(ids) < cfg["vocab_size"]


def test_run_incident_records_kills_multi_turn_and_leftovers_for_every_pair(standins, monkeypatch, tmp_path):
    monkeypatch.setattr(incident, "KILLS", 2)
    monkeypatch.setattr(incident, "KILL_AFTER_S", 0.5)
    monkeypatch.setattr(incident, "FIRST_REQUESTS_S", 1.0)  # the stand-ins' gauges stay 0
    monkeypatch.setattr(incident, "MULTI_TURN_S", 2.0)
    monkeypatch.setattr(incident, "SETTLE_S", 5.0)
    monkeypatch.setattr(incident, "AGENT", ("--prefix-words", "20", "--turn-words", "5", "--max-tokens", "8"))
    out = tmp_path / "incident.json"
    assert run.main(["incident", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    pairs, servers = record["results"]["pairs"], record["servers"]
    assert set(pairs) == {"_default", "_checksum", "_fixes_off"}
    for tag, res in pairs.items():
        assert "error" not in res, res
        assert [k["round"] for k in res["kills"]] == [1, 2]
        assert all(k["fresh"]["status"] == 200 and set(k["health"].values()) == {200} for k in res["kills"])
        multi = res["multi_turn"]
        assert multi["served"] > 0 and multi["failed"] == 0 and multi["concurrency"] == incident.MULTI_TURN_SESSIONS
        assert res["leftovers"] == {} and res["dead_after"] == [] and res["fresh_after"]["status"] == 200
    prefill, decode = servers["prefill"]["launch"], servers["decode"]["launch"]
    assert "--enable-hierarchical-cache" in prefill and "--cuda-graph-backend-decode disabled" in prefill
    assert "--cuda-graph-bs-decode 1 8 64 80" in decode and "--enable-hierarchical-cache" not in decode
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" not in prefill + decode  # sglang's default timeouts
    assert "DSV4_SM120_INDEX_K_CHECKSUM=1" in servers["prefill_checksum"]["launch"]
    assert "DSV4_SM120_INDEX_K_CHECKSUM" not in prefill
    assert "DSV4_SM120_COLLECTIVE_GUARD=0" in servers["decode_fixes_off"]["launch"]


def _small_agents(monkeypatch, **settings) -> None:
    """The agents set with a workload the stand-ins serve in seconds, one start unless told, and these of its module
    settings (``REPETITIONS``, ``PROFILED``, ``TARGETS``, ``STARTS``)."""
    monkeypatch.setattr(agents, "AGENT", ("--sessions", "4", "--groups", "2", "--prefix-words", "10", "--turns", "1",
                                          "--max-tokens", "4"))
    for name, value in {"STARTS": 1, **settings}.items():
        monkeypatch.setattr(agents, name, value)


def test_run_agents_visits_every_target_in_shuffled_abba_rounds_and_summarizes(standins, monkeypatch, tmp_path):
    _small_agents(monkeypatch, REPETITIONS=2, PROFILED=())  # the stand-ins have no profiler
    out = tmp_path / "agents.json"
    assert run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    res = json.loads(out.read_text())["results"]
    targets = set(agents.DEFAULT_TARGETS)
    assert [o.split(":")[0] for o in res["order"]] == ["r0"] * 14 + ["r1"] * 14 + ["r2"] * 14
    # the warm-up visits every level of every target: no timed level is the first to meet its shapes
    assert {o.split(":", 1)[1] for o in res["order"] if o.startswith("r0")} == {
        f"{t}:C{c}" for t in targets for c in agents.CONCURRENCY}
    assert {o.split(":")[1] for o in res["order"] if o.startswith("r1")} == targets
    r1 = [o for o in res["order"] if o.startswith("r1")]
    assert r1[0].endswith(":C4") and r1[1].endswith(":C64")  # ascending in odd rounds
    r2 = [o for o in res["order"] if o.startswith("r2")]
    assert r2[0].endswith(":C64") and r2[1].endswith(":C4")
    # ABBA: the even round visits the targets and their levels in the odd one's exact reverse, so no target is
    # always visited first
    assert [o.split(":", 1)[1] for o in r2] == [o.split(":", 1)[1] for o in r1][::-1]
    assert not [r for r in res["runs"] if "error" in r["level"] or r["level"]["failed"]], res["runs"][:2]
    assert set(res["table"]) == targets and res["table"]["pd"]["64"]["output_tokens_per_s"]["n"] == 2
    assert res["ratios"]["checksum_throughput"]["4"]["n"] == 2
    assert res["ratios_of_medians"]["checksum_throughput"]["4"]["n"] == [2, 2]  # each server's two rounds
    assert agents.summarize(res["runs"], rounds=(2,))["ratios"]["checksum_throughput"]["4"]["n"] == 1
    assert res["ratios"]["same_config_throughput"]["64"]["n"] == 2  # the panel's own floor
    servers = json.loads(out.read_text())["servers"]
    assert "DSV4_SM120_INDEX_K_CHECKSUM=1" in servers["hc_bf16_checksum"]["launch"]
    assert "--enable-hierarchical-cache" not in servers["hc_off"]["launch"]
    assert "DSV4_SM120_INDEX_K_DTYPE=fp8" in servers["hc_fp8"]["launch"]
    assert "DSV4_SM120_NIXL_HARDENING=0" in servers["decode_pd_fixes_off"]["launch"]


def test_the_agents_sets_pd_pairs_run_alone_started_in_the_order_named(standins, monkeypatch, tmp_path):
    """On an 80 GB GPU the PD pairs run without the singles (``DSV4_GPU_AGENT_TARGETS=pd,pd_fixes_off``): the run
    starts no single server, visits both pairs and gives the fixes' ratio and the prefills' own pace. The pairs
    start in the order named, so that a second run can start them the other way round."""
    _small_agents(monkeypatch, REPETITIONS=1, PROFILED=(), TARGETS=["pd_fixes_off", "pd"])
    out = tmp_path / "agents.json"
    assert run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    res = record["results"]
    assert {o.split(":")[1] for o in res["order"]} == {"pd", "pd_fixes_off"} and len(res["order"]) == 8
    assert not [r for r in res["runs"] if "error" in r["level"] or r["level"]["failed"]], res["runs"][:2]
    assert res["ratios"]["pd_fixes_on_vs_off_throughput"]["64"]["n"] == 1
    assert set(res["server_side"]["prefill"]) == {"pd", "pd_fixes_off"}
    # each fix's share of the loops' time, from both servers' /metrics (the stand-ins: 1 ms a second per fix on),
    # over the level's own duration: at least the two fixes' 2 ms a second, more for the scrapes' wider window
    for role in ("prefill", "decode"):
        assert 0.002 <= res["hook_time"]["pd"]["64"][role]["fixes"]["median"] < 0.05, res["hook_time"]
        assert 2000 <= res["hook_time"]["pd"]["64"][role]["fixes_calls_per_s"]["median"] < 50000, res["hook_time"]
        assert res["hook_time"]["pd_fixes_off"]["64"][role]["fixes"]["median"] == 0.0, res["hook_time"]
        # the bound adds what timing costs those calls on this host, measured in the run
        cell, added = res["hook_time"]["pd"]["64"][role], res["hook_wrapper_ns"]["around"]["added_ns"]["median"]
        assert added > 0 and cell["fixes_bound"]["median"] == pytest.approx(
            cell["fixes"]["median"] + cell["fixes_calls_per_s"]["median"] * added * 1e-9, rel=0.2), cell
    assert not set(record["servers"]) & set(agents.SINGLES)
    assert res["start_order"] == [["pd_fixes_off", "pd"]]
    trees = {f"{t}:{role}" for t in ("pd", "pd_fixes_off") for role in ("prefill", "decode", "router")}
    assert all(set(r["cpu_s"]) == trees for r in res["runs"])  # every server's CPU during every level
    assert set(res["cpu_cores_busy"]) == trees and res["host_cpus"] >= 1
    assert [n for n in record["servers"] if n.startswith("prefill")] == ["prefill_pd_fixes_off", "prefill_pd"]
    assert "DSV4_SM120_COLLECTIVE_GUARD=0" not in record["servers"]["prefill_pd"]["launch"]


def test_the_agents_set_started_twice_starts_the_pairs_the_other_way_round(standins, monkeypatch, tmp_path):
    """``STARTS=2``: after the first start's rounds every server is stopped and the targets started again in the
    reverse order, with a warm-up and rounds of their own, and their logs in a folder of their own; a bar's
    per-round ratios span both starts."""
    _small_agents(monkeypatch, REPETITIONS=1, PROFILED=(), TARGETS=["pd", "pd_fixes_off"], STARTS=2)
    out = tmp_path / "agents.json"
    assert run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    res = record["results"]
    assert res["start_order"] == [["pd", "pd_fixes_off"], ["pd_fixes_off", "pd"]]
    assert agents.started_both_ways(res["start_order"], "pd", "pd_fixes_off")
    assert sorted({(r["start"], r["round"]) for r in res["runs"]}) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [o for o in res["order"] if o.startswith("s2:r1:")] and not [o for o in res["order"] if o.startswith("s1:")]
    assert not [r for r in res["runs"] if "error" in r["level"] or r["level"]["failed"]], res["runs"][:2]
    assert res["ratios"]["pd_fixes_on_vs_off_throughput"]["64"]["n"] == 2  # one timed round of each start
    assert set(res["server_side"]["prefill"]) == {"pd", "pd_fixes_off"}
    assert {"prefill_pd", "prefill_pd@start2", "router_pd_fixes_off@start2"} <= set(record["servers"])
    logs = tarfile.open(tmp_path / "logs_agents.tar.xz").getnames()
    assert {"logs_agents/start1/prefill_pd.log", "logs_agents/start2/prefill_pd.log"} <= set(logs)


def test_alone_each_start_starts_one_pair_in_abba_order_and_a_ratio_pairs_a_block(standins, monkeypatch, tmp_path):
    """``ALONE``: no pair shares the host with another; the starts take the targets in turn (A B B A) and a ratio
    pairs the two starts of a block, the clients' and the prefills' on the same batch alike."""
    assert [names for _, names in agents.starts_plan(["a", "b"], 8, alone=True)] == [
        ["a"], ["b"], ["b"], ["a"], ["a"], ["b"], ["b"], ["a"]]
    assert [block for block, _ in agents.starts_plan(["a", "b"], 4, alone=True)] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="a multiple of 4"):
        agents.starts_plan(["a", "b"], 2, alone=True)
    _small_agents(monkeypatch, REPETITIONS=1, PROFILED=(), TARGETS=["pd", "pd_fixes_off"], STARTS=4, ALONE=True)
    out = tmp_path / "agents.json"
    assert run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["start_order"] == [["pd"], ["pd_fixes_off"], ["pd_fixes_off"], ["pd"]]
    assert agents.started_both_ways(res["start_order"], "pd", "pd_fixes_off")
    assert not agents.started_both_ways([["pd"], ["pd_fixes_off"], ["pd"], ["pd_fixes_off"]], "pd", "pd_fixes_off")
    assert not [r for r in res["runs"] if "error" in r["level"] or r["level"]["failed"]], res["runs"][:2]
    assert res["ratios"]["pd_fixes_on_vs_off_throughput"]["64"]["n"] == 2  # one timed round of each block
    assert {(r["start"], r["block"]) for r in res["runs"]} == {(1, 1), (2, 1), (3, 2), (4, 2)}
    assert res["workload"]["alone"] is True


def test_each_pd_fix_has_a_pair_of_its_own_and_pd_a_twin(monkeypatch):
    """Each fix's own price (one switch off) and the pairs' floor (``pd_again``) are named targets; the default
    panel stays the singles and the two pairs."""
    assert agents.PAIRS["pd_guard_off"] == {"DSV4_SM120_COLLECTIVE_GUARD": "0"}
    assert agents.PAIRS["pd_hardening_off"] == {"DSV4_SM120_NIXL_HARDENING": "0"}
    assert agents.PAIRS["pd_again"] == agents.PAIRS["pd"] == {}
    ratios = {name: (num, den) for name, num, den, _ in agents.RATIOS}
    assert ratios["pd_guard_throughput"] == ("pd", "pd_guard_off")
    assert ratios["pd_hardening_throughput"] == ("pd", "pd_hardening_off")
    assert ratios["same_config_pd_throughput"] == ("pd_again", "pd")
    assert agents.PAIRS["pd_checksum"] == {"DSV4_SM120_INDEX_K_CHECKSUM": "1"}
    assert ratios["pd_checksum_throughput"] == ratios["pd_checksum_ttft_p50"] == ("pd_checksum", "pd")
    assert agents.DEFAULT_TARGETS == [*agents.SINGLES, "pd", "pd_fixes_off"]


def test_the_ratio_of_two_servers_medians_comes_with_its_bootstrap_interval():
    """A server 6% slower in every round of a drifting host reads 0.94, inside its interval (each server's rounds
    resampled on their own, so five rounds that drift by more than 6% give a wide one); identical rounds give a
    zero-width interval; a server with no rounds gives no ratio."""
    fast = [100.0, 112.0, 95.0, 120.0, 104.0]
    slow = [v * 0.94 for v in fast]
    got = agents.medians_ratio(slow, fast)
    assert abs(got["ratio"] - 0.94) < 1e-9 and got["n"] == [5, 5]
    assert got["low"] <= got["ratio"] <= got["high"]
    assert agents.medians_ratio([2.0, 2.0], [1.0, 1.0]) == {"ratio": 2.0, "low": 2.0, "high": 2.0, "n": [2, 2]}
    assert agents.medians_ratio([], [1.0]) == {"ratio": None}


def test_a_timed_level_that_waited_on_a_compile_is_run_again_and_only_the_repeat_counts(standins, monkeypatch,
                                                                                         tmp_path):
    """A server that compiles a kernel during a timed level (the JIT caches gain a file) slowed that level alone
    (an H100's pair level took 43 s against 11): the level is run once more, and the table and the ratios take
    the repeat, naming the level left out."""
    _small_agents(monkeypatch, REPETITIONS=1, PROFILED=(), TARGETS=["hc_bf16", "hc_bf16_checksum"])
    cache = tmp_path / "cache"
    (cache / "deep_gemm" / "old").mkdir(parents=True)
    (cache / "deep_gemm" / "old" / "kernel.cubin").write_bytes(b"loaded")  # a loaded cache: old file times
    os.utime(cache / "deep_gemm" / "old" / "kernel.cubin", (0, 0))
    monkeypatch.setenv("DSV4_CACHE_ROOT", str(cache))
    level = agents.agent

    def compiling_in_one_level(front, metrics_url, concurrency, out, *args, **kwargs):
        result = level(front, metrics_url, concurrency, out, *args, **kwargs)
        if out.name == "agent_hc_bf16_r1_c64.json":
            (cache / "triton" / "HASH").mkdir(parents=True)
            (cache / "triton" / "HASH" / "_new_kernel.cubin").write_bytes(b"compiled")
            (cache / "deep_gemm" / "old" / ".committed").write_bytes(b"")  # a marker is not a compile
        return result

    monkeypatch.setattr(agents, "agent", compiling_in_one_level)
    out = tmp_path / "agents.json"
    assert run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["order"].count("r1:hc_bf16:C64") == 2 and res["order"].count("r1:hc_bf16_checksum:C64") == 1
    hit = [r for r in res["runs"] if r["round"] and r["compiled"]["files"]]
    assert [(r["target"], r["concurrency"], r["compiled"]["triton_kernels"]) for r in hit] == [
        ("hc_bf16", 64, ["_new_kernel"])]
    assert res["left_out_compiling"] == ["r1:hc_bf16:C64 (triton 1 files compiled)"]
    repeat = [r for r in res["runs"] if (r["round"], r["target"], r["concurrency"]) == (1, "hc_bf16", 64)][-1]
    assert repeat["compiled"]["files"] == 0
    assert res["table"]["hc_bf16"]["64"]["output_tokens_per_s"] == {
        "median": repeat["level"]["output_tokens_per_s"], "min": repeat["level"]["output_tokens_per_s"],
        "max": repeat["level"]["output_tokens_per_s"], "n": 1}
    assert res["ratios"]["checksum_throughput"]["64"]["n"] == 1


def test_a_stopped_agents_run_keeps_the_levels_it_measured(standins, monkeypatch, tmp_path):
    _small_agents(monkeypatch, PROFILED=())
    level, done = agents.agent, []

    def stopped_after_fifteen(*args):  # the run's SIGTERM handler raises SystemExit where the run is
        if len(done) == 15:
            raise SystemExit("stopped by signal 15")
        done.append(1)
        return level(*args)

    monkeypatch.setattr(agents, "agent", stopped_after_fifteen)
    out = tmp_path / "agents.json"
    run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"])
    record = json.loads(out.read_text())
    res = record["results"]
    assert "stopped by signal 15" in record["error"]
    assert len(res["runs"]) == 15 and len(res["order"]) == 15  # the 14 warm levels and 1 of round 1
    assert sum(c["output_tokens_per_s"]["n"] for t in res["table"].values() for c in t.values()) == 1


def test_a_level_that_does_not_end_is_recorded_and_the_set_goes_on(tmp_path):
    level = pd.agent_level(["--base-url", "http://127.0.0.1:9", "--model", "m", "--sessions", "1"],
                           tmp_path / "level.json", 0.01)
    assert "did not end within" in level["error"]


@pytest.mark.parametrize("setname", ["incident", "agents"])
def test_the_sets_agent_turns_render_in_dsv4s_chat_encoding_within_the_servers_context(setname, tmp_path):
    import argparse

    from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe
    from transformers import AutoTokenizer

    from dsv4_sm120.instruments import agent_bench

    module = {"incident": incident, "agents": agents}[setname]
    recipe = DeepSeekRecipe.from_hf_tokenizer("dsv4", AutoTokenizer.from_pretrained(str(pd.write_tokenizer(tmp_path))))
    parser = argparse.ArgumentParser()
    agent_bench.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:1", "--model", "m", *module.AGENT])
    session, lengths = agent_bench.sessions(args)[0], []
    for _ in range(args.turns if setname == "agents" else 12):  # the incident's agents run until killed
        payload = agent_bench._payload(args, session)
        lengths.append(len(recipe.encode({"messages": payload["messages"], "tools": payload["tools"], "thinking": False})))
        session.advance(args.turn_words, args.max_history_words, args.seed)
    assert 4096 < lengths[0] and max(lengths) < module.PAIR_SHAPE["prefill"][0]["context_length"], lengths


def test_a_release_is_timed_when_it_happens_and_not_when_the_wait_gives_up(monkeypatch):
    from harness import checks

    held = iter([{"rooms@prefill": 2.0}, {"rooms@prefill": 1.0}, {}])
    monkeypatch.setattr(checks, "leftovers", lambda cluster, only=None: next(held))
    monkeypatch.setattr(checks.time, "sleep", lambda s: None)
    left, after = checks.released(None, time.monotonic() - 5.0, timeout=60.0)
    assert left == {} and after is not None and after >= 5.0

    monkeypatch.setattr(checks, "leftovers", lambda cluster, only=None: {"rooms@prefill": 1.0})
    left, after = checks.released(None, time.monotonic(), timeout=0.0)
    assert left == {"rooms@prefill": 1.0} and after is None


def test_an_agents_run_of_some_targets_starts_only_those(standins, monkeypatch, tmp_path):
    _small_agents(monkeypatch, REPETITIONS=1, TARGETS=["hc_bf16", "hc_bf16_checksum"])
    monkeypatch.setattr(agents, "PROFILE_TIMEOUT_S", 1.0)  # the stand-ins write no trace: each profile says so
    out = tmp_path / "agents.json"
    assert run.main(["agents", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    assert set(record["servers"]) == {"hc_bf16", "hc_bf16_checksum"}  # no PD pair on the GPU
    assert {o.split(":")[1] for o in record["results"]["order"]} == {"hc_bf16", "hc_bf16_checksum"}
    assert record["results"]["ratios"]["checksum_throughput"]["64"]["n"] == 1
    assert record["results"]["workload"]["targets"] == ["hc_bf16", "hc_bf16_checksum"]
    assert set(record["results"]["server_side"]["prefill"]) == {"hc_bf16", "hc_bf16_checksum"}
    assert set(record["results"]["profiles"]) == {"hc_bf16", "hc_bf16_checksum"}
    assert all("error" in p for p in record["results"]["profiles"].values())


def test_the_abort_safety_lane_alone_starts_no_graph_decode_and_still_compares_its_probes(standins, monkeypatch,
                                                                                          tmp_path):
    from bench.gpu_server import abort_safety

    for name, value in {"LANE_ONLY": True, "ONLY": ["control", "defaults"], "LANE_ROUNDS": 1, "PROBES_PER_ROUND": 2,
                        "PROBE_TOKENS": 8, "PROBE_NEW": 3, "VICTIMS": 1, "VICTIM_WAIT_S": 0.3, "CUT_AFTER_S": 0.1,
                        "SELECTIVE_FROM": 0}.items():
        monkeypatch.setattr(abort_safety, name, value)
    out = tmp_path / "abort_safety.json"
    assert run.main(["abort_safety", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    targets, servers = record["results"]["targets"], record["servers"]
    assert set(targets) == {"control", "defaults"}
    assert {n for n in servers if n.startswith(("decode", "router"))} == {
        "decode_topk_control", "decode_topk_defaults", "decode_reference"}
    assert all("error" not in res and "kills" not in res for res in targets.values()), targets
    assert [(p["round"], p["i"]) for p in targets["control"]["probes_differing"]] == [(1, 0)]
    assert targets["defaults"]["probes_differing"] == [] and targets["defaults"]["topk_vs_reference"]["requests"] == 2


def test_run_abort_safety_records_every_target_with_two_prefills_and_the_fault_on_the_first(standins, monkeypatch,
                                                                                               tmp_path):
    from bench.gpu_server import abort_safety

    for name, value in {"KILL_AFTER_S": 0.5, "FIRST_REQUESTS_S": 1.0,
                        "AGENT": ("--prefix-words", "20", "--turn-words", "5", "--max-tokens", "8")}.items():
        monkeypatch.setattr(incident, name, value)
    for name, value in {"KILLS": 2, "STREAM_S": 2.0, "MULTI_TURN_S": 2.0, "SETTLE_S": 5.0, "LANE_ROUNDS": 2,
                        "PROBES_PER_ROUND": 3, "PROBE_TOKENS": 8, "PROBE_NEW": 3, "VICTIMS": 2,
                        "VICTIM_WAIT_S": 0.3, "CUT_AFTER_S": 0.1, "SELECTIVE_FROM": 0}.items():
        monkeypatch.setattr(abort_safety, name, value)
    out = tmp_path / "abort_safety.json"
    assert run.main(["abort_safety", "--out", str(out), "--bundle", str(tmp_path), "--startup-timeout", "30"]) == 0
    record = json.loads(out.read_text())
    targets, servers = record["results"]["targets"], record["servers"]
    assert set(targets) == set(abort_safety.TARGETS)
    for tag, res in targets.items():
        assert "error" not in res, res
        assert [k["round"] for k in res["kills"]] == [1, 2]
        assert res["stream"]["served"] > 0 and res["multi_turn"]["served"] > 0
        assert res["leftovers"] == {} and res["dead_after"] == []
        slow, other = servers[f"prefill_slow_{tag}"]["launch"], servers[f"prefill_b_{tag}"]["launch"]
        assert "DSV4_TEST_FAULT=slow_send" in slow and "DSV4_TEST_FAULT" not in other
        assert all("DSV4_SM120_INDEX_K_CHECKSUM=1" in servers[f"{role}_{tag}"]["launch"]
                   for role in ("prefill_slow", "prefill_b", "decode"))
        router = servers[f"router_{tag}"]["launch"]
        assert router.count("--prefill ") == 2
    assert "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0" in servers["decode_control"]["launch"]
    assert "DSV4_SM120_NIXL_HARDENING=0" in servers["decode_fixes_off"]["launch"]
    # the top-k lane (two rows of its own a probe: 3 new tokens): a probe right after each round's abort differs from the reference where the decode frees
    # the victims' pages at once (the stand-in's model of a late write); the others' equal it
    for tag, res in targets.items():
        lane = servers[f"decode_topk_{tag}"]["launch"]
        assert "--enable-return-indexer-topk" in lane and "--cuda-graph-backend-decode disabled" in lane
        assert ("DSV4_SM120_INDEX_K_CHECKSUM=1" in lane) == abort_safety.LANE_CHECKED[tag]
        assert res["probes"] == 6 and res["topk_vs_reference"]["requests"] == 6
        assert [r["round"] for r in res["lane_rounds"]] == [1, 2]
    assert [(p["round"], p["i"]) for p in targets["control"]["probes_differing"]] == [(1, 0), (2, 0)]
    assert targets["defaults"]["probes_differing"] == [] and targets["fixes_off"]["probes_differing"] == []
    defaults = targets["defaults"]["topk_vs_reference"]
    assert defaults["rows"] == defaults["rows_equal"] == 6 * 2 and defaults["requests_equal"] == 6
    assert record["results"]["reference"]["probes"] == 6 and "--enable-return-indexer-topk" in \
        servers["decode_reference"]["launch"]
    assert "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=1" in servers["decode_defaults"]["launch"]

"""The GPU serving run's client side on the CPU, against loopback HTTP servers that answer like sglang.

No DeepSeek-V4 forward runs on a CPU, so the servers here are stand-ins (test infrastructure): each
answers ``/generate`` for a batch of ``input_ids`` with greedy-looking tokens derived from the prompt, and
``meta_info.indexer_topk`` as sglang encodes it. What is real is the run's own code: prompts, batching,
the grid, the comparisons, the top-k overlap and the log-line check, so a GPU host's time is not spent
finding a client bug.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from bench.gpu_server import hicache, scenarios, traffic
from harness import dsv4_checkpoints, faults


def _serve(tokens_of, topk_of, stall_after=None, step_s=0.0, meta_of=None):
    """A stand-in sglang on a free loopback port: ``/generate`` answers ``tokens_of(ids, n)`` per prompt (streamed
    a token every ``step_s``, or whole, with ``meta_of(ids)``'s fields in ``meta_info``), the indexer's selections
    ``topk_of(ids)`` when asked, nothing after ``stall_after`` requests; ``/metrics`` a counter that grows."""
    calls = {"n": 0}
    stalled = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # /metrics: pages checked grow with every /generate answered
            data = (f"sglang:dsv4_index_k_page_checks_total {48.0 * calls['n']}\n"
                    f'sglang:dsv4_index_k_pages_quarantined{{tp_rank="0"}} 0.0\n').encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = body["sampling_params"]["max_new_tokens"]
            if body.get("stream"):  # sglang's batch stream: one chunk per prompt and token, tagged with its index
                prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
                self.send_response(200)
                self.end_headers()
                try:
                    for done in range(1, n + 1):
                        for index, ids in enumerate(prompts):
                            chunk = {"index": index, "output_ids": tokens_of(ids, done),
                                     "meta_info": {"completion_tokens": done}}
                            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                        time.sleep(step_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):  # a client gone mid-stream
                    pass
                return
            if stall_after is not None and calls["n"] >= stall_after:  # a scheduler that stopped making progress
                stalled.wait(5)
                return
            calls["n"] += 1
            if isinstance(body["input_ids"][0], int):
                body["input_ids"] = [body["input_ids"]]
            out = []
            for ids in body["input_ids"]:
                item = {"output_ids": tokens_of(ids, n), "meta_info": meta_of(ids) if meta_of else {}}
                if body.get("return_indexer_topk"):
                    item["meta_info"]["indexer_topk"] = base64.b64encode(topk_of(ids).tobytes()).decode()
                out.append(item)
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _tokens(salt):
    return lambda ids, n: [(sum(ids[-8:]) + salt + i) % 1000 for i in range(n)]


def _topk(shift, model="tiny"):
    layers, k = dsv4_checkpoints.c4_layers(model), dsv4_checkpoints.config(model)["index_topk"]

    def topk_of(ids):
        rows = len(ids) + 1
        base = np.arange(k, dtype=np.int32)[None, None, :] + shift
        return np.broadcast_to(base, (rows, layers, k)).astype(np.int32).copy()
    return topk_of


@pytest.fixture
def small_grid(monkeypatch):
    monkeypatch.setattr(scenarios, "GRID", [(1, 64), (4, 300)])
    monkeypatch.setattr(scenarios, "OVERLAP_CONTEXTS", [2400])


def test_serve_compares_tokens_and_selections_and_finds_the_build_line(small_grid):
    salts = {"sglang_graph": 0, "dsv4_graph": 1, "dsv4fp8_graph": 0, "sglang_eager": 0, "dsv4_eager": 1}
    shifts = {"sglang_eager": 0, "dsv4_eager": 128}
    started = {name: _serve(_tokens(salt), _topk(shifts.get(name, 0))) for name, salt in salts.items()}
    try:
        urls = {name: url for name, (_, url) in started.items()}
        line = "[2026-12-02] dsv4-sm120: built DeepseekV4ForCausalLMSM120 with bf16 index keys: ..."
        logs = {name: (lambda n=name: line if n.startswith("dsv4") else "no plugin") for name in urls}
        res = scenarios.run_serve(urls, logs)
    finally:
        for server, _ in started.values():
            server.shutdown()
    assert all(res["a_served"].values())
    assert res["b_fp8_equals_upstream"]["equal"] == res["b_fp8_equals_upstream"]["requests"] == 15
    assert res["b_bf16_vs_upstream"]["equal"] == 0
    assert res["eager_vs_graph"]["sglang"]["equal"] == 15
    overlap = res["b_topk_overlap_bf16_vs_fp8"][2400]
    assert overlap["mean"] == pytest.approx(384 / 512) and overlap["rows"] > 0
    assert res["f_model_built_lines"]["dsv4_graph"] == [line] and res["f_model_built_lines"]["sglang_graph"] == []
    assert set(res["e_first_over_steady"]["dsv4_graph"]) == {"1x64", "4x300"}


def test_prompts_are_the_same_for_a_seed_and_share_a_prefix():
    a = traffic.prompts(7, 3, 50, 1024, prefix=[5] * 40)
    assert a == traffic.prompts(7, 3, 50, 1024, prefix=[5] * 40)
    assert all(len(p) == 50 and p[:40] == [5] * 40 for p in a) and len({tuple(p) for p in a}) == 3
    assert min(min(p) for p in traffic.prompts(1, 2, 500, 64)) >= traffic.FIRST_TOKEN


def test_cost_visits_every_server_in_shuffled_rounds_and_reads_a_profile(monkeypatch, tmp_path):
    import gzip

    monkeypatch.setattr(scenarios, "DECODE_POINTS", [(2, 300)])
    monkeypatch.setattr(scenarios, "PREFILL_POINTS", [200])
    monkeypatch.setattr(scenarios, "DECODE_STEPS", 6)
    monkeypatch.setattr(scenarios, "DECODE_ROUNDS", 2)
    monkeypatch.setattr(scenarios, "PREFILL_ROUNDS", 2)
    visits = []
    monkeypatch.setattr(scenarios.traffic, "prompt", lambda seed, n, vocab: [2] * n)
    real_generate, real_stream = traffic.generate, traffic.stream_token_times

    def counted(url, ids, n, **kw):
        visits.append(("generate", url))
        return real_generate(url, ids, n, **kw)

    def streamed(url, ids, n, **kw):
        visits.append(("stream", url))
        return real_stream(url, ids, n, **kw)

    monkeypatch.setattr(scenarios.traffic, "generate", counted)
    monkeypatch.setattr(scenarios.traffic, "stream_token_times", streamed)
    steps = {"dsv4_bf16": 0.04, "sglang_tilelang": 0.02, "sglang_deepgemm": 0.02}  # seconds a decode step
    started = {name: _serve(_tokens(0), _topk(0), step_s=step) for name, step in steps.items()}
    try:
        urls = {name: url for name, (_, url) in started.items()}
        res = scenarios.run_cost(urls)
    finally:
        for server, _ in started.values():
            server.shutdown()
    # after each server cached the prefix, met every shape once untimed (one prefill, one decode point here)
    # and the prefill visits (2 shuffled rounds), each decode visit is one streamed batch
    start = len(urls) + 2 * len(urls) + 2 * len(urls)  # the prefix cached, each shape once, 2 prefill rounds
    assert [u for _, u in visits[len(urls):3 * len(urls)]] == [url for url in urls.values() for _ in range(2)]
    assert set(res["first_ms"]) == set(urls)
    assert set(res["first_ms"]["dsv4_bf16"]) == {"prefill 200", "decode 2x300"}
    # each shape's first request against the same request's timed visits
    assert set(res["first_vs_steady"]["dsv4_bf16"]) == {"prefill 200", "decode 2x300"}
    assert len(res["decode"]["2x300"]["dsv4_bf16"]["long_visits_ms"]) == 2
    rounds = [res["visit_order"][f"decode 2x300 round {r}"] for r in range(2)]
    assert all(sorted(r) == sorted(urls) for r in rounds)  # every server once a round, in that round's order
    assert visits[start:] == [("stream", urls[n]) for r in rounds for n in r]
    assert res["visit_order"]["decode 2x300 round 0"] == scenarios._visit_order(list(urls), "decode 2x300", 0)
    assert rounds[1] == rounds[0][::-1]  # ABBA: no server is always visited first
    assert len(res["decode"]["2x300"]["dsv4_bf16"]["visits_ms"]) == 2
    assert res["decode"]["2x300"]["dsv4_bf16"]["server_step_ms"] is None  # no logs given: no server measure
    # the step is read off the stream: each server's own step, whatever its prefill took
    for name, step in steps.items():
        assert res["decode"]["2x300"][name]["step_ms"] == pytest.approx(step * 1e3, rel=0.25)
    assert res["ratios"]["dsv4_bf16/sglang_tilelang"]["decode 2x300"] == pytest.approx(2.0, rel=0.3)
    assert set(res["ratios"]) == {"dsv4_bf16/sglang_tilelang", "dsv4_bf16/sglang_deepgemm",
                                  "dsv4_bf16/sglang_tilelang server", "dsv4_bf16/sglang_deepgemm server"}
    assert res["ratios"]["dsv4_bf16/sglang_tilelang server"] == {} and res["measures_disagree"] == {}

    trace = tmp_path / "x.trace.json.gz"
    events = [{"cat": "kernel", "name": "_logits_kernel", "dur": 30.0},
              {"cat": "kernel", "name": "topk_transform_paged", "dur": 10.0},
              {"cat": "kernel", "name": "gemm", "dur": 60.0}, {"cat": "cpu_op", "name": "aten::mm", "dur": 99.0}]
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    shares = scenarios.kernel_shares(trace)
    assert shares["logits_share"] == 0.3 and shares["topk_share"] == 0.1 and shares["kernel_us"] == 100.0


def _small_storm(monkeypatch, started: dict, **sizes) -> dict:
    """``hicache.run`` over stand-in servers (name -> (server, url)) with a storm small enough for a CPU."""
    for name, value in {"SESSIONS": 8, "GROUPS": 4, "ROUNDS": 2, "WAVE": 4, "PREFIX_TOKENS": 100,
                        "CANCEL_EVERY_S": 0.01, **sizes}.items():
        monkeypatch.setattr(hicache, name, value)
    try:
        urls = {name: url for name, (_, url) in started.items()}
        return hicache.run(urls, {name: (lambda: "") for name in urls})
    finally:
        for server, _ in started.values():
            server.shutdown()


def test_hicache_storm_compares_waves_with_hicache_off_and_reads_the_counters(monkeypatch):
    res = _small_storm(monkeypatch, {"hc_kernel_layer_first": _serve(_tokens(0), _topk(0)),
                                     "off": _serve(_tokens(0), _topk(0)), "hc_direct": _serve(_tokens(3), _topk(0))})
    storm = res["storms"]["hc_kernel_layer_first"]
    assert storm["requests"] == 16 and storm["failed_waves"] == []
    # round 0 in two waves of 4, round 1 all 8 sessions at once: 3 waves answered during the storm
    assert storm["metrics"]["index_k_page_checks_total"] == 48.0 * 3
    assert res["outputs_vs_off"]["hc_kernel_layer_first"] == {"equal": 16, "compared": 16}
    assert res["outputs_vs_off"]["hc_direct"]["equal"] == 0


def test_a_server_gone_after_its_storm_keeps_the_counts_of_its_last_answered_wave(monkeypatch):
    """Control (a) can take its server down; the counters scraped after each wave survive it."""
    real, calls = hicache.scrape, []

    def scrape(url):
        calls.append(url)
        if len(calls) > 3:  # before the storm and after its first two waves; then the server is gone
            raise traffic.RequestFailed("connection refused")
        return real(url)

    monkeypatch.setattr(hicache, "scrape", scrape)
    server, url = _serve(_tokens(0), _topk(0))
    try:
        for name, value in {"SESSIONS": 8, "GROUPS": 4, "ROUNDS": 2, "WAVE": 4, "PREFIX_TOKENS": 100}.items():
            monkeypatch.setattr(hicache, name, value)
        storm = hicache.storm(url)
    finally:
        server.shutdown()
    assert storm["requests"] == 16 and storm["metrics_at_last_wave"] is True
    assert storm["metrics"]["index_k_page_checks_total"] == 48.0 * 2


def test_hicache_probes_compare_own_forward_selections_and_cost_runs_abba(monkeypatch):
    """The top-k probe: the fence-in control's selections equal the reference's, the unfenced control's not;
    the cost phase visits the integrity pair in ABBA order and reports both ratios."""
    monkeypatch.setattr("bench.gpu_server.hicache.SELECTIVE_FROM", 0)
    monkeypatch.setattr("bench.gpu_server.hicache.PROBES", 2)
    monkeypatch.setattr("bench.gpu_server.hicache.PROBE_PREFIX_TOKENS", 40)
    monkeypatch.setattr("bench.gpu_server.hicache.COST_SESSIONS", 4)
    res = _small_storm(monkeypatch, {
        "eager_off": _serve(_tokens(0), _topk(0, "hicache")),
        "control_fence_in_delayed": _serve(_tokens(0), _topk(0, "hicache")),
        "control_no_fence_delayed_unchecked": _serve(_tokens(0), _topk(5, "hicache")),
        "hc_kernel_layer_first": _serve(_tokens(0), _topk(0)),
        "hc_kernel_layer_first_checksum": _serve(_tokens(0), _topk(0)),
        "off": _serve(_tokens(0), _topk(0))})
    fenced, unfenced = res["topk_vs_off"]["control_fence_in_delayed"], res["topk_vs_off"]["control_no_fence_delayed_unchecked"]
    assert fenced["requests"] == fenced["requests_equal"] == 2 and fenced["rows"] == fenced["rows_equal"] > 0
    assert unfenced["requests"] == 2 and unfenced["requests_equal"] == 0 and unfenced["rows_equal"] == 0
    assert res["probe_summary"]["eager_off"] == {"requests": 2, "failed_500": 0, "errors": 0}
    cost = res["cost"]
    assert [len(v) for v in cost["visits"].values()] == [2 * hicache.COST_ROUNDS] * 2
    assert cost["summary"]["throughput_on_over_off"] > 0 and cost["summary"]["ttft_p50_on_over_off"] > 0
    pairs = cost["summary"]["throughput_on_over_off_pairs"]
    assert pairs["min"] <= pairs["median"] <= pairs["max"]


def test_the_cost_pairs_hold_each_visit_against_the_others_same_fresh_turns(monkeypatch):
    """ABBA order; the k-th visit of both servers sends the same turns, never a turn an earlier visit cached."""
    sent = []
    monkeypatch.setattr(hicache, "cost_visit", lambda url, seed: sent.append((url, seed)) or
                        {"output_tok_s": 100.0 if url == "on" else 200.0, "ttft_p50_s": 1.0})
    res = hicache.cost({"on": "on", "off": "off"}, "on", "off")
    assert [u for u, _ in sent[:8]] == ["off", "on", "on", "off", "on", "off", "off", "on"]
    for name in ("on", "off"):
        seeds = [s for u, s in sent if u == name]
        assert seeds == sorted(set(seeds)) and len(seeds) == 2 * hicache.COST_ROUNDS
    assert [s for u, s in sent if u == "on"] == [s for u, s in sent if u == "off"]
    assert res["summary"]["throughput_on_over_off"] == 0.5
    assert res["summary"]["throughput_on_over_off_pairs"] == {"median": 0.5, "min": 0.5, "max": 0.5}


def test_a_cost_visit_that_waited_on_a_compile_is_made_again_and_a_pair_still_compiling_is_left_out(monkeypatch,
                                                                                                   tmp_path):
    """A visit during which the JIT caches gained a file is made once more on fresh turns; the repeat stands in
    for it, and a pair whose repeat compiled too is left out of the ratios."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSV4_CACHE_ROOT", str(cache))
    sent = []

    def visit(url, seed):
        sent.append((url, seed))
        if (url, seed) in {("on", 700), ("on", 702), ("on", 1702)}:  # a compile inside these visits
            (cache / "tilelang" / str(seed)).mkdir(parents=True)
            (cache / "tilelang" / str(seed) / "executable.so").write_bytes(b"compiled")
            return {"output_tok_s": 1.0, "ttft_p50_s": 30.0}
        return {"output_tok_s": 100.0 if url == "on" else 200.0, "ttft_p50_s": 1.0}

    monkeypatch.setattr(hicache, "cost_visit", visit)
    res = hicache.cost({"on": "on", "off": "off"}, "on", "off")
    assert sent[:3] == [("off", 700), ("on", 700), ("on", 1700)]
    on = res["visits"]["on"]
    assert len(on) == 2 * hicache.COST_ROUNDS and on[0]["instead_of"]["compiled"]["by_cache"] == {"tilelang": 1}
    assert on[0]["compiled"]["files"] == 0 and on[2]["compiled"]["files"] == 1  # the repeat of visit 2 compiled
    pairs = res["summary"]["throughput_on_over_off_pairs"]
    assert pairs == {"median": 0.5, "min": 0.5, "max": 0.5} and res["summary"]["on"]["ttft_p50_s"]["max"] == 1.0


def test_a_server_that_stalls_mid_storm_is_named_and_its_answered_waves_still_compared(monkeypatch):
    res = _small_storm(monkeypatch, {"hc_kernel_layer_first": _serve(_tokens(0), _topk(0)),
                                     "off": _serve(_tokens(0), _topk(0), stall_after=2)}, WAVE_TIMEOUT_S=1.0)
    off = res["storms"]["off"]
    assert off["stalled"] == {"round": 1, "wave": 0, "after_s": off["stalled"]["after_s"]}  # round 0: 2 waves
    assert off["waves_answered"] == 2 and off["metrics"]["index_k_page_checks_total"] == 96.0
    assert res["storms"]["hc_kernel_layer_first"]["waves_answered"] == 3  # round 1 is one wave of all 8
    assert res["outputs_vs_off"]["hc_kernel_layer_first"] == {"equal": 8, "compared": 8}


def test_the_fault_plugin_is_found_by_sglangs_plugin_group_only_on_its_path():
    import os
    import subprocess
    import sys

    probe = ("import importlib.metadata as m; "
             "print(sorted(e.name for e in m.entry_points(group='sglang.srt.plugins')))")
    env = {**os.environ, "PYTHONPATH": faults.pythonpath()}
    with_faults = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    assert "dsv4_test_faults" in with_faults and "dsv4" in with_faults
    assert "dsv4_test_faults" not in plain


def test_run_after_waits_for_the_file_and_says_when_it_never_came(tmp_path):
    # --after: the scenarios of a run on a GPU another job shares wait until that job leaves a file
    import threading

    from bench.gpu_server.run import wait_for_file

    flag = tmp_path / "quiet"
    threading.Timer(1.5, flag.touch).start()
    assert 1.0 <= wait_for_file(flag, timeout=30) < 10
    with pytest.raises(TimeoutError, match="did not appear within 1s"):
        wait_for_file(tmp_path / "never", timeout=1)


def test_a_stream_step_skips_the_first_tokens_and_reads_coalesced_chunks():
    # prompt 0: a 5 s prefill then 10 ms steps, two tokens coalesced into one chunk; prompt 1 alike
    times = [{1: 5.0, 2: 5.01, 4: 5.03, 5: 5.04, 6: 5.05}, {1: 5.0, 3: 5.02, 4: 5.03, 6: 5.05}]
    assert traffic.step_seconds(times, skip=2) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="no prompt streamed"):
        traffic.step_seconds([{1: 1.0}], skip=2)


def test_log_counts_reads_distinct_pages_and_failed_requests_from_a_server_log():
    log = "\n".join([
        "[t] index-K checksum mismatch at read: pool=p layer=0 host_page=5 device_page=1 (the page ...)",
        "[t] index-K checksum mismatch at read: pool=p layer=0 host_page=5 device_page=2 (the page ...)",
        "[t] index-K checksum mismatch at read: pool=p layer=1 host_page=5 device_page=2 (the page ...)",
        "[t] index-K checksum mismatch fails request rid=ab12: pool=p layer=0 host_page=5 device_page=1",
        "[t] index-K checksum mismatch fails request rid=ab12: pool=p layer=1 host_page=5 device_page=2",
        '[t] INFO:     127.0.0.1:1 - "POST /generate HTTP/1.1" 500 Internal Server Error',
    ])
    assert hicache.log_counts(log) == {"mismatch_lines": 3, "distinct_pages": 2, "requests_failed": 1, "http_500": 1}


def test_the_cost_profile_sums_host_ops_runtime_calls_and_kernels_by_name(tmp_path):
    import gzip
    import json

    events = [{"cat": "cpu_op", "name": "aten::index_select", "dur": 5.0},
              {"cat": "cpu_op", "name": "aten::index_select", "dur": 7.0},
              {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "dur": 900.0},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 3.0},
              {"cat": "kernel", "name": "_check_kernel", "dur": 2.5}, {"cat": "python_function", "name": "x", "dur": 1},
              {"cat": "python_function", "name": "dsv4_sm120/index_k/integrity.py(190): check_reads", "dur": 40.0},
              {"cat": "user_annotation", "name": "step[EXTEND bs=5 toks=253]", "dur": 9000.0},
              {"cat": "gpu_user_annotation", "name": "step[EXTEND bs=5 toks=253]", "dur": 30000.0},
              {"cat": "user_annotation", "name": "step[DECODE bs=6]", "dur": 2000.0},
              {"cat": "user_annotation", "name": "scheduler.run_batch", "dur": 5.0}]
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    top = hicache.host_and_gpu_top(trace)
    assert top["cpu_op"] == {"total_us": 12.0, "top": [("aten::index_select", 12.0, 2)]}
    assert top["cuda_runtime"]["top"][0] == ("cudaEventSynchronize", 900.0, 1)
    assert top["kernel"]["total_us"] == 2.5
    assert top["package"] == [("dsv4_sm120/index_k/integrity.py(190): check_reads", 40.0, 1)]
    assert top["steps"] == {"EXTEND": {"steps": 1, "host_ms": 9.0, "gpu_ms": 30.0},
                            "DECODE": {"steps": 1, "host_ms": 2.0, "gpu_ms": 0.0}}


def test_the_record_names_the_package_that_ran_the_bundles_wheel_or_a_checkout_before_it(tmp_path):
    from bench.gpu_server import run

    bundle = tmp_path / "root"
    record = {"commit": "54feba8", "bundle": {"project": {"commit": "23481761b96d"}},
              "versions": {"dsv4_sm120_path": f"{bundle}/site/dsv4_sm120/__init__.py"}}
    assert run.package_commit(record, bundle) == "2348176"
    record["versions"]["dsv4_sm120_path"] = "/tmp/ck/src/dsv4_sm120/__init__.py"
    assert run.package_commit(record, bundle) == "54feba8"


def test_a_profile_started_first_covers_the_works_first_steps_without_the_stack(monkeypatch, tmp_path):
    """The agents set's profile is asked for before its level's traffic (its steps are the burst's prefills), and
    without sglang's Python stack recording."""
    order = []
    monkeypatch.setattr(traffic, "request", lambda url, path, body, timeout: order.append((path, body["with_stack"])))
    trace = tmp_path / "x.trace.json.gz"

    def work():
        order.append("work")
        trace.write_bytes(b"")

    assert traffic.profile_window("http://127.0.0.1:1", tmp_path, work, wait_s=0.0, steps=3, activities=["GPU"],
                                  name="p", timeout=5.0, with_stack=False) == trace
    assert order == [("/start_profile", False), "work"]


def test_a_profile_whose_work_ends_before_its_steps_is_stopped_and_kept(monkeypatch, tmp_path):
    """A profiled level that runs fewer forward steps than asked (its turns answer one token each) leaves sglang's
    profiler running: it is stopped once the work has ended, which writes the trace of the steps it saw."""
    asked = []
    trace = tmp_path / "x.trace.json.gz"

    def answer(url, path, body, timeout):
        asked.append(path)
        if path == "/stop_profile":
            trace.write_bytes(b"")

    monkeypatch.setattr(traffic, "request", answer)
    monkeypatch.setattr(traffic, "STOP_AFTER_S", 0.0)
    assert traffic.profile_window("http://127.0.0.1:1", tmp_path, lambda: None, wait_s=0.0, steps=30,
                                  activities=["GPU"], name="p", timeout=10.0, with_stack=False) == trace
    assert asked == ["/start_profile", "/stop_profile"]


def test_the_agents_sets_profiled_level_answers_one_token_a_turn(monkeypatch, tmp_path):
    """Every profiled step of the agents set is a prefill batch, the steps integrity mode checks: its turns
    answer one token each (with the set's 32 a turn, decode steps took 28 of 30 profiled steps)."""
    from bench.gpu_server import agents

    levels = []
    monkeypatch.setattr(agents.pd, "agent_level", lambda args, out, timeout: levels.append(args) or {})
    monkeypatch.setattr(agents.hicache, "profiled", lambda url, out_dir, work, name, **kw: work() or {})
    agents.profile("http://127.0.0.1:1", "http://127.0.0.1:1", tmp_path, "hc_bf16")
    agents.agent("http://127.0.0.1:1", "http://127.0.0.1:1", 64, tmp_path / "level.json")
    profiled, timed = levels
    assert profiled[profiled.index("--max-tokens") + 1] == "1"
    assert timed[timed.index("--max-tokens") + 1] == "32"



def test_every_two_servers_are_met_in_each_order_in_at_least_two_of_the_five_rounds():
    names = [s.name for s in scenarios.cost_specs()]
    points = [f"prefill {n}" for n in scenarios.PREFILL_POINTS] + [f"decode {b}x{c}" for b, c in scenarios.DECODE_POINTS]
    for point in points:
        orders = [scenarios._visit_order(names, point, r) for r in range(scenarios.DECODE_ROUNDS)]
        assert all(sorted(o) == sorted(names) for o in orders), orders
        for a in names:
            for b in names:
                if a != b:
                    first = sum(o.index(a) < o.index(b) for o in orders)
                    assert first >= 2, f"{point}: {a} before {b} in {first} of {len(orders)} rounds: {orders}"

"""The cost set's server-side measure: sglang's decode log lines read as step times, and profiles as kernel tables.

The log lines are sglang 0.5.23's own format (``metrics_reporter.py``), as an H200 cost run wrote them."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.gpu_server import step_log

VISIT = """\
[2026-12-02 21:53:36] Decode batch, #running-req: 8, #full token: 36608, full token usage: 0.09, #swa token: 4096, swa token usage: 0.02, cuda graph: True, gen throughput (token/s): 27.72, #queue-req: 0
[2026-12-02 21:53:36] INFO:     127.0.0.1:40772 - "POST /generate HTTP/1.1" 200 OK
[2026-12-02 21:53:36] Decode batch, #running-req: 8, #full token: 36608, full token usage: 0.09, #swa token: 4096, swa token usage: 0.02, cuda graph: True, gen throughput (token/s): 2303.97, #queue-req: 0
[2026-12-02 21:53:36] Decode batch, #running-req: 8, #full token: 36672, full token usage: 0.09, #swa token: 4096, swa token usage: 0.02, cuda graph: True, gen throughput (token/s): 2285.71, #queue-req: 0
[2026-12-02 21:53:37] Decode batch, #running-req: 3, #full token: 36700, full token usage: 0.09, #swa token: 4096, swa token usage: 0.02, cuda graph: True, gen throughput (token/s): 900.00, #queue-req: 0
"""


def test_a_visits_step_is_the_median_of_its_clean_windows():
    # the first window reaches back over the idle gap (27.72 tok/s); the last decoded 3 of the 8 requests
    assert step_log.window_steps_ms(VISIT, 8) == [pytest.approx(8e3 / 2303.97), pytest.approx(8e3 / 2285.71)]
    assert step_log.visit_step_ms(VISIT, 8) == pytest.approx((8e3 / 2303.97 + 8e3 / 2285.71) / 2, abs=1e-4)
    assert step_log.visit_step_ms(VISIT.splitlines()[0], 8) is None  # a visit that logged one line: no figure


def test_kernel_tables_per_step_and_their_difference_kernel_by_kernel(tmp_path):
    def trace(name, kernels):
        path = tmp_path / f"{name}.trace.json.gz"
        events = [{"cat": "kernel", "name": k, "dur": d} for k, d in kernels] + [{"cat": "cpu_op", "name": "x", "dur": 9}]
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)
        return path

    ours = step_log.kernel_table(trace("ours", [("_logits_kernel", 30.0), ("_logits_kernel", 30.0),
                                                ("_store_kernel", 8.0), ("gemm", 100.0), ("gemm", 100.0)]), steps=2)
    theirs = step_log.kernel_table(trace("theirs", [("tl_paged_mqa_logits", 50.0), ("tl_paged_mqa_logits", 50.0),
                                                    ("gemm", 98.0), ("gemm", 98.0)]), steps=2)
    assert ours[0] == {"name": "gemm", "launches_per_step": 1.0, "us_per_step": 100.0, "package": False}
    assert {k["name"]: k["package"] for k in ours} == {"gemm": False, "_logits_kernel": True, "_store_kernel": True}
    diff = step_log.kernel_diff(ours, theirs)
    assert diff["delta_us_per_step"] == pytest.approx(134.0 - 148.0)
    assert [r["name"] for r in diff["kernels"]] == ["tl_paged_mqa_logits", "_logits_kernel", "_store_kernel", "gemm"]
    assert diff["ours_only_us"] == 34.0 and diff["theirs_only_us"] == 50.0
    assert diff["kernels"][-1] == {"name": "gemm", "ours_us": 100.0, "theirs_us": 98.0, "delta_us": 2.0,
                                   "ours_launches": 1.0, "theirs_launches": 1.0, "side": "both"}


def test_the_cost_servers_log_a_decode_line_often_enough_for_clean_windows():
    from bench.gpu_server import scenarios

    for spec in scenarios.cost_specs():
        args = spec.argv(__import__("pathlib").Path("/m"), 1)
        assert args[args.index("--decode-log-interval") + 1] == str(scenarios.DECODE_LOG_INTERVAL)
    # a visit's steps hold several windows past the first
    assert (scenarios.DECODE_SHORT + scenarios.DECODE_STEPS) // scenarios.DECODE_LOG_INTERVAL >= 4


def test_the_two_measures_are_said_to_disagree_past_half_a_percent():
    from bench.gpu_server import scenarios

    table = {"dsv4_bf16/sglang_tilelang": {"decode 8x4096": 0.99, "decode 1x4096": 1.02},
             "dsv4_bf16/sglang_tilelang server": {"decode 8x4096": 1.028, "decode 1x4096": 1.022}}
    assert scenarios.disagreements(table) == {"sglang_tilelang decode 8x4096": {"client": 0.99, "server": 1.028}}


PREFILL_LOG = """\
[2026-12-06 04:07:14] Prefill batch, #new-seq: 1, #new-token: 128, #cached-token: 0, full token usage: 0.00, swa token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 287.94
[2026-12-06 04:09:40] Prefill batch, #new-seq: 2, #new-token: 1000, #cached-token: 4000, full token usage: 0.50, swa token usage: 0.20, #running-req: 3, #queue-req: 12, #pending-token: 9000, cuda graph: False, input throughput (token/s): 10000.00
[2026-12-06 04:09:40] Prefill batch, #new-seq: 1, #new-token: 600, #cached-token: 2000, full token usage: 0.55, swa token usage: 0.20, #running-req: 5, #queue-req: 11, #pending-token: 8000, cuda graph: False, input throughput (token/s): 2000.00
[2026-12-06 04:09:45] Prefill batch, #new-seq: 1, #new-token: 500, #cached-token: 2000, full token usage: 0.55, swa token usage: 0.20, #running-req: 5, #queue-req: 3, #pending-token: 8000, cuda graph: False, input throughput (token/s): 100.00
"""


def test_the_prefill_pace_counts_only_batches_with_a_queue_behind_them():
    # the first line has no queue (warm-up, idle before it); the last one's gap (5 s) spans idle time
    pace = step_log.prefill_pace(step_log.busy_batches(PREFILL_LOG))
    assert pace["batches"] == 2
    assert pace["ms_per_batch"] == pytest.approx(1e3 * (0.1 + 0.3) / 2)
    assert pace["new_tokens_per_s"] == pytest.approx(1600 / 0.4)
    assert pace["cached_per_new"] == pytest.approx(6000 / 1600, abs=1e-3)
    assert step_log.prefill_pace(step_log.busy_batches("")) == {"batches": 0}


WARM_UP_BATCH = ("[2026-12-06 04:07:30] Prefill batch, #new-seq: 1, #new-token: 4000, #cached-token: 0, full token "
                 "usage: 0.10, swa token usage: 0.05, #running-req: 0, #queue-req: 40, #pending-token: 9000, cuda "
                 "graph: False, input throughput (token/s): 5000.00\n")  # 0.8 s: it compiled a kernel


def test_the_agents_set_holds_its_bars_on_the_prefills_pace_in_its_timed_levels(tmp_path):
    """Only batches logged within a timed, compile-free level count: not the warm-up round's (it compiles
    kernels on whichever server meets a shape first) nor a level that compiled; a ratio takes the levels both
    targets ran."""
    from bench.gpu_server import agents

    slower = PREFILL_LOG.replace("input throughput (token/s): 10000.00", "input throughput (token/s): 5000.00")
    (tmp_path / "a.log").write_text(WARM_UP_BATCH + PREFILL_LOG)
    (tmp_path / "b.log").write_text(slower + PREFILL_LOG.splitlines(keepends=True)[1].replace("04:09:40", "04:12:00"))
    (tmp_path / "c.log").write_text(PREFILL_LOG)
    logs = {"hc_bf16": tmp_path / "a.log", "hc_bf16_checksum": tmp_path / "b.log", "hc_bf16_again": tmp_path / "c.log",
            "hc_fp8": tmp_path / "missing.log"}
    warm, timed = ["2026-12-06 04:07:00", "2026-12-06 04:08:00"], ["2026-12-06 04:09:30", "2026-12-06 04:09:50"]
    runs = [{"target": t, "round": r, "concurrency": 64, "level": {}, "span": span}
            for t in logs for r, span in ((0, warm), (1, timed))]
    runs.append({"target": "hc_bf16_again", "round": 2, "concurrency": 64, "level": {},  # a stopped run's last round
                 "span": ["2026-12-06 04:10:00", "2026-12-06 04:11:00"]})
    runs.append({"target": "hc_bf16_checksum", "round": 2, "concurrency": 4, "level": {},  # it compiled: left out
                 "span": ["2026-12-06 04:11:30", "2026-12-06 04:12:30"], "compiled": {"files": 3}})
    side = agents.server_side({1: logs}, runs)
    assert side["prefill"]["hc_fp8"] == {}
    assert side["prefill"]["hc_bf16"]["batches"] == 2  # the warm-up's batch is not one of them
    assert side["prefill"]["hc_bf16"]["new_tokens_per_s"] == pytest.approx(1600 / 0.4)
    assert side["prefill"]["hc_bf16_checksum"]["batches"] == 2  # nor the compiling level's
    assert side["new_tokens_per_s_ratios"] == {"checksum_throughput": pytest.approx(1600 / 0.5 / (1600 / 0.4), abs=1e-4),
                                               "same_config_throughput": 1.0}
    assert side["compared_levels"] == {"checksum_throughput": ["r1:C64"], "same_config_throughput": ["r1:C64"]}
    assert side["matched_ratios"] == {"checksum_throughput": None, "same_config_throughput": None}  # too few to fit


def test_the_prefills_pace_over_two_starts_takes_each_starts_log_within_its_own_levels(tmp_path):
    """A set started twice keeps a log per start; each start's batches count within that start's levels only."""
    from bench.gpu_server import agents

    second = PREFILL_LOG.replace("04:09:40", "05:00:10").replace("04:09:45", "05:00:15")
    for k, text in ((1, PREFILL_LOG), (2, second)):
        (tmp_path / f"a{k}.log").write_text(text)
        (tmp_path / f"b{k}.log").write_text(text)
    logs = {k: {"pd": tmp_path / f"a{k}.log", "pd_fixes_off": tmp_path / f"b{k}.log"} for k in (1, 2)}
    spans = {1: ["2026-12-06 04:09:30", "2026-12-06 04:09:50"], 2: ["2026-12-06 05:00:00", "2026-12-06 05:00:12"]}
    runs = [{"start": k, "target": t, "round": 1, "concurrency": 64, "level": {}, "span": spans[k]}
            for k in (1, 2) for t in ("pd", "pd_fixes_off")]
    side = agents.server_side(logs, runs)
    assert side["prefill"]["pd"]["batches"] == 4  # two of each start's log, within that start's span
    assert side["compared_levels"]["pd_fixes_on_vs_off_throughput"] == ["r1:C64", "s2:r1:C64"]
    assert side["new_tokens_per_s_ratios"]["pd_fixes_on_vs_off_throughput"] == 1.0


def test_alone_the_prefills_are_compared_within_a_block_of_starts(tmp_path):
    """Each start ran one target alone (A B B A): a ratio pairs the two starts of a block, each start's batches
    taken from its own log within its own levels."""
    from bench.gpu_server import agents

    times = {1: ("04:09:40", "04:09:45"), 2: ("04:20:40", "04:20:45"), 3: ("04:30:40", "04:30:45"),
             4: ("04:40:40", "04:40:45")}
    logs, runs = {}, []
    for k, target in ((1, "pd"), (2, "pd_fixes_off"), (3, "pd_fixes_off"), (4, "pd")):
        (tmp_path / f"{k}.log").write_text(PREFILL_LOG.replace("04:09:40", times[k][0]).replace("04:09:45", times[k][1]))
        logs[k] = {target: tmp_path / f"{k}.log"}
        minute = times[k][0][:5]
        runs.append({"start": k, "block": (k + 1) // 2, "target": target, "round": 1, "concurrency": 64, "level": {},
                     "span": [f"2026-12-06 {minute}:30", f"2026-12-06 {minute}:50"]})
    side = agents.server_side(logs, runs)
    assert side["prefill"]["pd"]["batches"] == 4  # two of each of its starts
    assert side["compared_levels"]["pd_fixes_on_vs_off_throughput"] == ["r1:C64", "s2:r1:C64"]
    assert side["new_tokens_per_s_ratios"]["pd_fixes_on_vs_off_throughput"] == 1.0


def _batches(seconds_of, mix, n=60, seed=1):
    """n busy batches of ``mix`` (mean new, mean cached tokens) timed by ``seconds_of(new, cached)`` plus noise."""
    import random

    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        new, cached = rnd.randint(mix[0] // 2, mix[0] * 3 // 2), rnd.randint(mix[1] // 2, mix[1] * 3 // 2)
        out.append((new, cached, seconds_of(new, cached) * rnd.uniform(0.97, 1.03)))
    return out


def test_two_prefills_are_compared_on_the_same_batch_not_on_what_their_batches_held():
    """Same cost per new and per cached token, different batch mixes: their new tokens a second differ by 30%,
    their speed on the same batch does not; a prefill 8% slower a batch shows as such, with an interval."""
    cost = lambda new, cached: 0.010 + 40e-6 * new + 7e-6 * cached  # noqa: E731 (a server's batch time)
    light, heavy = _batches(cost, (4000, 20000)), _batches(cost, (3000, 40000), seed=2)
    pace = lambda bs: sum(b[0] for b in bs) / sum(b[2] for b in bs)  # noqa: E731
    assert pace(heavy) / pace(light) < 0.75  # what the paces say
    same = step_log.matched_ratio(heavy, light)
    assert same["ratio"] == pytest.approx(1.0, abs=0.02) and same["low"] < 1.0 < same["high"]
    slower = step_log.matched_ratio(_batches(lambda n, c: 1.08 * cost(n, c), (3000, 40000), seed=3), light)
    assert slower["ratio"] == pytest.approx(1 / 1.08, abs=0.02) and slower["high"] < 1.0
    assert step_log.matched_ratio(light[:5], light) is None  # too few batches to fit

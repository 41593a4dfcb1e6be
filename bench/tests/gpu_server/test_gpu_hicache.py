"""The bars of the HiCache integrity run on real figures: ``python -m bench.gpu_server run hicache``.

On a CUDA host with the pin this runs the set (about ten minutes) and asserts on its record;
``DSV4_GPU_HICACHE_JSON=<record>`` asserts on a record a run wrote instead (``bench.tests.gpu_server.gpu_record``).
Selected with ``-m gpu``; without a CUDA device and no record it fails.
"""

from __future__ import annotations

import pytest

from bench.tests.gpu_server import gpu_record

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def run() -> dict:
    return gpu_record.results("DSV4_GPU_HICACHE_JSON", "hicache")


def _metrics(run, name):
    return run["metrics_after_probes"][name]


def test_a_without_any_fence_the_read_side_check_counts_and_fails_and_the_topk_differs(run):
    checked = _metrics(run, "control_no_fence_delayed")
    if "error" in checked:  # upstream's load accounting can take this server down: its log has the counts
        logged = run["from_logs"]["control_no_fence_delayed"]
        assert logged["distinct_pages"] > 0 and logged["requests_failed"] > 0, logged
    else:
        assert checked["index_k_mismatches_total"] > 0 and checked["index_k_requests_failed_total"] > 0
    storm_500 = [w for w in run["storms"]["control_no_fence_delayed"]["failed_waves"] if " 500" in w["error"][:200]]
    assert storm_500 or run["probe_summary"]["control_no_fence_delayed"]["failed_500"] > 0
    unchecked = run["topk_vs_off"]["control_no_fence_delayed_unchecked"]
    assert unchecked["requests"] > 0 and unchecked["requests_equal"] < unchecked["requests"]


def test_b_with_the_fence_and_the_same_delay_nothing_mismatches_and_every_topk_is_equal(run):
    fenced = _metrics(run, "control_fence_in_delayed")
    assert fenced["index_k_page_checks_total"] > 0 and fenced["index_k_mismatches_total"] == 0
    assert fenced["index_k_key_writes_lost_total"] == 0
    topk = run["topk_vs_off"]["control_fence_in_delayed"]
    assert topk["requests"] > 0 and topk["requests_equal"] == topk["requests"] and topk["rows_equal"] == topk["rows"]


def test_c_the_planted_page_is_caught_and_its_request_failed(run):
    planted = _metrics(run, "control_planted_page")
    assert planted["index_k_mismatches_total"] >= 1 and planted["index_k_requests_failed_total"] >= 1
    assert any("layer=" in line for line in run["mismatch_lines"]["control_planted_page"])


def test_shipped_configuration_serves_the_storm_like_hicache_off(run):
    layouts = ("hc_kernel_layer_first", "hc_kernel_page_first", "hc_direct")
    for name in layouts + tuple(f"{n}_checksum" for n in layouts) + ("hc_kernel_layer_first_fp8",):
        storm = run["storms"][name]
        assert storm["requests"] > 0 and not storm["failed_waves"] and storm["stalled"] is None, name
        assert storm["metrics"]["load_back_tokens_total"] > 0, name
        same = run["outputs_vs_off"][name]
        assert same["equal"] == same["compared"] > 0, (name, same)
    for name in layouts:
        checked = _metrics(run, f"{name}_checksum")
        assert checked["index_k_page_checks_total"] > 0 and checked["index_k_mismatches_total"] == 0, name
        assert checked["index_k_key_writes_checked_total"] > 0 and checked["index_k_key_writes_lost_total"] == 0


def test_integrity_mode_costs_at_most_3pct_throughput_and_5pct_ttft(run):
    summary = run["cost"]["summary"]
    assert summary["throughput_on_over_off"] >= 0.97, summary
    assert summary["ttft_p50_on_over_off"] <= 1.05, summary

"""The one record of the GPU serving scenarios, composed from the committed H200 runs: every scenario present, each held against its bar."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_server import compose

RESULTS = Path(__file__).resolve().parents[2] / "results"
SERVE = RESULTS / "gpu_serving" / "gpu_serving_h200_2026-12-02_serve_7c781db.json"
COST = RESULTS / "gpu_serving" / "gpu_serving_h200_2026-12-02_cost_warm_65d0812.json"
EAGER = RESULTS / "kernels" / "indexer_h200_2026-12-02_eager_65d0812.json"


def test_compose_puts_a_to_f_side_by_side_with_their_sources_and_bars(tmp_path):
    out = tmp_path / "gpu_serving.json"
    assert compose.main(["--serve", str(SERVE), "--cost", str(COST), "--eager", str(EAGER), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert {"a_served", "b_fp8_equals_upstream", "b_topk_overlap_bf16_vs_fp8", "c_cost", "d_eager_host",
            "e_first_over_steady", "f_model_built_lines"} <= set(record)
    assert record["sources"]["d"]["commit"] == "65d0812" and record["sources"]["c"]["file"].endswith(COST.name)
    assert all(record["a_served"].values())
    # d: every shape of that run adds at most 13.9 us
    assert record["d_eager_host"]["worst_host_added_us"] < 14 and record["d_eager_host"]["meets_bar"] is True
    # c: that run's decode of 8 and 64 rows came out of the old method (a negative step): the bar is not met
    assert record["c_cost"]["meets_decode_bar"] is False
    # e: with the shape warmup every package server's first request of a shape is within 1.34x of its steady state
    e = record["e_first_over_steady"]
    assert e["worst_package"] == 1.34 and e["meets_bar"] is True

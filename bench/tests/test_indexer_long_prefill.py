"""bench/indexer/two_stage.py on the CPU (Triton's interpreter, tiny shapes, no peer): a row per key count with
every timer's median, the ratios that have both sides, and the rows where two-stage selects what bf16 does."""

from __future__ import annotations

import torch

from bench import _gpu_common as g
from bench.indexer import cases, two_stage
from bench.indexer.cases import D, PAGE


def test_the_long_prefill_section_times_each_path_and_checks_the_selection(monkeypatch):
    monkeypatch.setattr(cases, "DEV", "cpu")
    monkeypatch.setitem(cases.SIZES, "long_rows", 4)
    monkeypatch.setitem(cases.SIZES, "long_keys", (1100,))
    monkeypatch.setitem(g._DRY, "on", True)
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn((40, PAGE, D), generator=gen).to(torch.bfloat16)
    (row,) = two_stage.long_prefill_section([], pool, gen, rounds=1)
    assert row["keys"] == 1100 and row["context_tokens"] == 4400
    assert all(row[f"{k}_ms"] > 0 for k in ("ours", "two_stage", "topk_transform"))
    assert row["two_stage_vs_ours"] == row["two_stage_ms"] / row["ours_ms"]
    assert row["two_stage_rows_equal_to_bf16"] == "4/4" and row["check_bf16"]["top512_identical"]
    assert "two-stage/bf16" in two_stage.row_text(row)

"""``dsv4-sm120 doctor --json`` reports the index-K layout the settings in force select."""

from __future__ import annotations

import json

import pytest

from dsv4_sm120 import cli


@pytest.mark.parametrize("dtype, per_token, row", [("bf16", 256, 16384), ("fp8", 132, 8448)])
def test_doctor_json_has_index_k(monkeypatch, capsys, dtype, per_token, row):
    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", dtype)
    cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["index_k"] == {"dtype": dtype, "bytes_per_token": per_token, "page_row_bytes": row}


def test_default_is_bf16(monkeypatch):
    from dsv4_sm120.index_k.report import doctor_section

    monkeypatch.delenv("DSV4_SM120_INDEX_K_DTYPE", raising=False)
    assert doctor_section().data["dtype"] == "bf16"


def test_bad_switch_value_fails_the_row(monkeypatch):
    from dsv4_sm120.index_k.report import doctor_section

    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", "fp16")
    section = doctor_section()
    assert section.rows[0].status == "fail" and "bf16, fp8" in section.rows[0].detail

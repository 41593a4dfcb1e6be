"""``dsv4-sm120 doctor --model-path``: the verdict for one checkpoint, read by the pin's real ``ModelConfig``."""

from __future__ import annotations

import json

import pytest

from dsv4_sm120 import cli
from tests.tiny_checkpoints import write_tiny_dsv4, write_tiny_dsv41


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"v41": str(write_tiny_dsv41(root / "v41")), "v4": str(write_tiny_dsv4(root / "v4"))}


def _doctor(capsys, *args) -> tuple[int, dict]:
    code = cli.main(["doctor", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_v41_with_bf16_keys_fails_with_the_refusal_and_the_pieces(paths, capsys, monkeypatch):
    monkeypatch.delenv("DSV4_SM120_INDEX_K_DTYPE", raising=False)
    code, report = _doctor(capsys, "--model-path", paths["v41"])
    model = report["model"]
    assert code == 1 and report["ok"] is False
    assert model["model_type"] == "deepseek_v41" and model["served_by_model_impl_dsv4"] is False
    assert "--model-impl sglang" in model["refusal"] and "DSV4_SM120_INDEX_K_DTYPE=fp8" in model["refusal"]
    assert [p["piece"] for p in model["v41_pieces"] if not p["holds"]] == [
        "V4.1 KV layouts V41 / V41_NEW / V41_FP4",
        "PD integrity mode on HIP's split fp4 index pools",
        "bf16 C4 indexer inside a V4.1 forward",
    ]


def test_v41_with_fp8_keys_is_served_as_upstream(paths, capsys, monkeypatch):
    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", "fp8")
    code, report = _doctor(capsys, "--model-path", paths["v41"])
    assert code == 0 and report["model"]["served_by_model_impl_dsv4"] is True
    assert cli.main(["doctor", "--model-path", paths["v41"]]) == 0
    assert "serves it with fp8 index keys, as upstream" in capsys.readouterr().out


def test_v4_is_served_with_bf16_keys(paths, capsys, monkeypatch):
    monkeypatch.delenv("DSV4_SM120_INDEX_K_DTYPE", raising=False)
    code, report = _doctor(capsys, "--model-path", paths["v4"])
    assert code == 0 and report["model"]["served_by_model_impl_dsv4"] is True
    assert "v41_pieces" not in report["model"]


def test_unreadable_checkpoint_says_what_to_pass(tmp_path, capsys):
    code, report = _doctor(capsys, "--model-path", str(tmp_path / "missing"))
    assert code == 1 and "served_by_model_impl_dsv4" not in report["model"]
    assert cli.main(["doctor", "--model-path", str(tmp_path / "missing")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "config.json" in out and "Hugging Face model id" in out


def test_without_model_path_there_is_no_model_section(capsys):
    assert "model" not in _doctor(capsys)[1]

"""``bench-serving`` builds upstream's command line and really runs ``python -m sglang.benchmark.serving``.

The upstream bench needs a tokenizer; there is no hub here, so the test builds a
tiny word-level one with ``tokenizers`` and saves it as a transformers tokenizer
directory (what upstream's ``--tokenizer`` accepts). ``HF_HUB_OFFLINE=1`` makes
upstream's chat-template probe of ``--model`` fail at once instead of trying the network.
"""

from __future__ import annotations

import json
import shlex

import pytest

from dsv4_sm120 import cli
from dsv4_sm120.instruments import serving


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"word{k}": k + 1 for k in range(300)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return str(path)


def _parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_upstream_command_line_for_low_and_high_concurrency(capsys):
    args = _parse("--base-url", "http://10.0.0.5:30000/v1/", "--model", "deepseek-ai/DeepSeek-V4-Flash", "--dry-run",
                  "--", "--pd-separated", "--flush-cache")  # fmt: skip
    assert serving.run(args) == 0
    low, high = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    for argv, c, n in ((low, "1", "16"), (high, "64", "256")):
        assert argv[1:3] == ["-m", "sglang.benchmark.serving"]
        opts = dict(zip(argv[3::2], argv[4::2]))
        assert opts["--base-url"] == "http://10.0.0.5:30000" and opts["--backend"] == "sglang-oai-chat"
        assert opts["--max-concurrency"] == c and opts["--num-prompts"] == n
        assert argv[-2:] == ["--pd-separated", "--flush-cache"]


def test_bad_base_url_is_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse("--base-url", "10.0.0.5:30000", "--model", "m")
    assert exit_.value.code == 2
    assert "http://10.0.0.5:30000" in capsys.readouterr().err


def test_runs_upstream_against_the_fake_server(server, tiny_tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DSV4_SM120_INDEX_K_CHECKSUM", "1")
    rc = cli.main(
        ["bench-serving", "--base-url", server.url, "--model", "fake-dsv4", "--tokenizer", tiny_tokenizer,
         "--concurrency", "2", "--num-prompts", "4", "--dataset-name", "random-ids",
         "--random-input-len", "16", "--random-output-len", "6", "--out-dir", str(tmp_path), "--tag", "fixes-on",
         "--launch-flags", "python -m sglang.launch_server --model-impl dsv4 --disaggregation-mode prefill", "--device", "cpu test",
         "--", "--random-range-ratio", "1", "--warmup-requests", "1"]
    )  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert rc == 0, printed
    [path] = tmp_path.glob("serving_*_fixes-on.json")
    record = json.loads(path.read_text())
    [level] = record["levels"]
    assert level["returncode"] == 0 and level["argv"][-2:] == ["--warmup-requests", "1"]
    result = level["result"]
    # Upstream's own JSON: 4 requests done at concurrency 2 with 6 output tokens each.
    assert result["completed"] == 4 and result["max_concurrency"] == 2 and result["tag"] == "fixes-on"
    assert result["total_output_tokens"] == 24 and result["server_info"] == {"fake": True, "internal_states": []}
    assert server.completed == 5  # 1 warmup + 4 measured
    assert record["switches_in_force"]["DSV4_SM120_INDEX_K_CHECKSUM"] == "1"
    assert record["launch_flags"] == ["python -m sglang.launch_server --model-impl dsv4 --disaggregation-mode prefill"]
    assert record["device"] == "cpu test" and record["date_utc"] and record["sglang_version_client"] == "0.5.23"
    assert printed["summary"][0]["completed"] == 4 and printed["file"] == str(path)


@pytest.mark.slow
def test_each_level_is_one_upstream_run_and_a_failed_level_keeps_upstreams_words(
    server, tiny_tokenizer, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = ["--base-url", server.url, "--model", "fake-dsv4", "--num-prompts", "6", "--dataset-name", "random-ids",
              "--random-input-len", "8", "--random-output-len", "3", "--out-dir", str(tmp_path)]  # fmt: skip
    server.reset(token_delay_s=0.01)
    assert cli.main(["bench-serving", *common, "--tokenizer", tiny_tokenizer, "--concurrency", "1", "3", "--tag", "two"]) == 0
    [path] = tmp_path.glob("serving_*_two.json")
    record = json.loads(path.read_text())
    assert [lv["result"]["max_concurrency"] for lv in record["levels"]] == [1, 3]
    assert [row["completed"] for row in record["summary"]] == [6, 6]
    assert server.max_inflight == 3

    missing = str(tmp_path / "no-such-tokenizer")
    assert cli.main(["bench-serving", *common, "--tokenizer", missing, "--concurrency", "2", "--tag", "bad"]) == 1
    [level] = json.loads(next(tmp_path.glob("serving_*_bad.json")).read_text())["levels"]
    assert level["result"] is None and level["returncode"] != 0
    assert "no-such-tokenizer" in level["error"]
    capsys.readouterr()

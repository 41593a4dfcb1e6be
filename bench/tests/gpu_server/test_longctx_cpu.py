"""The ``longctx`` set's client side on the CPU: point lists, visit order, ratios of medians with their
intervals and the bars' verdicts, the server's prefill read from its log, the analytic indexer share, the
``flash_share`` checkpoint, and one whole run against the loopback stand-ins of ``test_scenarios_cpu.py``
(test infrastructure: no DeepSeek-V4 forward runs on a CPU), their logs planted as sglang writes them."""

from __future__ import annotations

import itertools
import random

import pytest

from bench.gpu_server import longctx, run, scenarios
from bench.tests.gpu_server.test_scenarios_cpu import _serve, _tokens, _topk
from harness import dsv4_checkpoints

NAMES = ["dsv4_bf16", "sglang_tilelang", "sglang_deepgemm"]


def test_the_set_is_registered_with_three_servers_sized_for_256k(monkeypatch):
    assert run.SETS["longctx"] == (longctx.specs, longctx.run)
    monkeypatch.setenv("DSV4_GPU_LONGCTX_MODEL", "flash_share")
    specs = longctx.specs()
    assert [s.name for s in specs] == NAMES and {s.model for s in specs} == {"flash_share"}
    assert [(s.impl, s.upstream_indexer) for s in specs][1:] == [("sglang", "tilelang"), ("sglang", "deepgemm")]
    for s in specs:
        assert s.context_length >= 262144 + longctx.DECODE_SHORT + longctx.DECODE_STEPS
        assert s.max_total_tokens >= 262144 + 32 * (longctx.TAIL + longctx.DECODE_SHORT + longctx.DECODE_STEPS)
        assert s.chunked_prefill == 16384 and s.graph_batches == (1, 8, 32)
    monkeypatch.delenv("DSV4_GPU_LONGCTX_MODEL")
    monkeypatch.setenv("DSV4_GPU_LONGCTX_CHUNK", "8192")
    assert {(s.model, s.chunked_prefill) for s in longctx.specs()} == {("flash12", 8192)}


def test_the_two_stage_server_joins_by_name_and_a_bad_list_is_refused(monkeypatch):
    monkeypatch.setenv("DSV4_GPU_LONGCTX_SERVERS", "dsv4_bf16,dsv4_two_stage,sglang_deepgemm")
    specs = {s.name: s for s in longctx.specs()}
    assert list(specs) == ["dsv4_bf16", "dsv4_two_stage", "sglang_deepgemm"]
    assert specs["dsv4_two_stage"].impl == "dsv4"
    assert specs["dsv4_two_stage"].extra_env == {"DSV4_SM120_INDEX_K_SELECT": "two_stage"}
    assert specs["dsv4_bf16"].extra_env == {} and specs["sglang_deepgemm"].upstream_indexer == "deepgemm"
    for bad in ("dsv4_bf16,sglang_fp4", "dsv4_bf16", "sglang_deepgemm"):
        with pytest.raises(ValueError, match="DSV4_GPU_LONGCTX_SERVERS"):
            longctx.server_names({"DSV4_GPU_LONGCTX_SERVERS": bad})
    planted = {"16384": _planted({"dsv4_bf16": 110.0, "dsv4_two_stage": 100.0, "sglang_deepgemm": 100.0}, 0.002)}
    rows = longctx.ratio_rows(planted, {})["prefill 16384"]
    assert set(rows) == {"dsv4_bf16/sglang_deepgemm", "dsv4_two_stage/sglang_deepgemm"}
    assert rows["dsv4_two_stage/sglang_deepgemm"]["client"]["ratio"] == pytest.approx(1.0, rel=0.01)
    assert longctx.bars({"prefill 16384": rows}, "dsv4_two_stage")["client"] == {"shown": ["prefill 16384"]}


def test_a_bundle_finished_before_flash_share_gets_its_config_written(tmp_path):
    dsv4_checkpoints.write("flash12", tmp_path)
    assert run.ensure_checkpoints({"flash12", "flash_share"}, tmp_path) == ["flash_share"]
    import json
    assert json.loads((tmp_path / "flash_share" / "config.json").read_text()) == dsv4_checkpoints.config("flash_share")
    assert run.ensure_checkpoints({"flash12", "flash_share"}, tmp_path) == []
    assert run.ensure_checkpoints({"flash12"}, tmp_path / "no-bundle") == [] and not (tmp_path / "no-bundle").exists()


def test_the_points_come_from_the_defaults_or_the_environment():
    pts = longctx.points({})
    assert pts["prefill"] == [16384, 32768, 65536, 131072, 262144] and pts["rounds"] == 5
    assert len(pts["decode"]) == 12 and pts["decode"][0] == (1, 262144) and pts["decode"][-1] == (32, 16384)
    cut = longctx.points({"DSV4_GPU_LONGCTX_PREFILL": "16384, 64k", "DSV4_GPU_LONGCTX_DECODE": "64k,8x256k",
                          "DSV4_GPU_LONGCTX_BATCHES": "1,32", "DSV4_GPU_LONGCTX_ROUNDS": "3"})
    assert cut == {"prefill": [16384, 65536], "decode": [(8, 262144), (1, 65536), (32, 65536)], "rounds": 3}
    with pytest.raises(ValueError, match="ROUNDS"):
        longctx.points({"DSV4_GPU_LONGCTX_ROUNDS": "1"})
    with pytest.raises(ValueError, match="context length"):
        longctx.points({"DSV4_GPU_LONGCTX_PREFILL": "512k"})


def test_the_visit_order_is_balanced_at_every_point():
    """Each round visits every server once; over five rounds each server comes before each other two or three
    times, and no server is first in every round."""
    pts = longctx.points({})
    keys = [f"prefill {n}" for n in pts["prefill"]] + [f"decode {b}x{d}" for b, d in pts["decode"]]
    for key in keys:
        rounds = [scenarios._visit_order(NAMES, key, r) for r in range(longctx.ROUNDS)]
        assert all(sorted(r) == sorted(NAMES) for r in rounds)
        for a, b in itertools.permutations(NAMES, 2):
            before = sum(r.index(a) < r.index(b) for r in rounds)
            assert before in (2, 3), (key, a, b, rounds)
        assert len({r[0] for r in rounds}) >= 2


def _planted(ms: dict, noise: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {n: {"visits_ms": [m * (1 + rng.uniform(-noise, noise)) for _ in range(5)],
                "server_visits_ms": [m * (1 + rng.uniform(-noise, noise)) for _ in range(5)]} for n, m in ms.items()}


def test_the_ratio_of_medians_its_interval_and_the_bars_verdicts_on_planted_numbers():
    """Level with DeepGEMM: the bar shown; 10% slower than TileLang: failed; 2% slower with visits 6% apart:
    the interval crosses the 1.02 bar, not shown. The ratio is that of the two medians."""
    prefill = {"16384": _planted({"dsv4_bf16": 100.0, "sglang_tilelang": 100 / 1.10, "sglang_deepgemm": 100.0}, 0.002)}
    decode = {"8x65536": _planted({"dsv4_bf16": 10.2, "sglang_tilelang": 10.0, "sglang_deepgemm": 10.0}, 0.06, seed=3)}
    rows = longctx.ratio_rows(prefill, decode)
    level = rows["prefill 16384"]["dsv4_bf16/sglang_deepgemm"]
    med = lambda v: sorted(v)[2]  # noqa: E731
    p = prefill["16384"]
    ratio = med(p["dsv4_bf16"]["visits_ms"]) / med(p["sglang_deepgemm"]["visits_ms"])
    assert level["client"]["ratio"] == pytest.approx(ratio, abs=1e-4)
    assert level["client"]["low"] <= level["client"]["ratio"] <= level["client"]["high"]
    assert level["client_verdict"] == level["server_verdict"] == "shown" and level["bar"] == 1.03
    assert level["bar_of_the_issue"] and not rows["prefill 16384"]["dsv4_bf16/sglang_tilelang"]["bar_of_the_issue"]
    slow = rows["prefill 16384"]["dsv4_bf16/sglang_tilelang"]
    assert slow["client"]["ratio"] == pytest.approx(1.10, rel=0.01) and slow["client_verdict"] == "failed"
    noisy = rows["decode 8x65536"]["dsv4_bf16/sglang_deepgemm"]
    assert noisy["bar"] == 1.02 and noisy["client"]["low"] < 1.02 < noisy["client"]["high"]
    assert noisy["client_verdict"] == "not shown"
    assert longctx.bars(rows)["client"] == {"shown": ["prefill 16384"], "not shown": ["decode 8x65536"]}
    assert longctx.verdict({"ratio": None}, 1.02) == "no figure"


def test_a_prefill_visit_by_the_servers_log_is_its_lines_after_the_first():
    """Each line's new tokens over its throughput is the time since the line before: the first reaches back
    before the visit; the others (the prompt's later chunks and the marker) sum to the visit."""
    log = ("[2026-12-07 10:00:00] Prefill batch, #new-seq: 1, #new-token: 16384, #cached-token: 0, token usage: 0.01, "
           "#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 10.00\n"
           "[2026-12-07 10:00:01] Decode batch, #running-req: 1, gen throughput (token/s): 5.0\n"
           "[2026-12-07 10:00:01] Prefill batch, #new-seq: 1, #new-token: 16384, #cached-token: 16384, "
           "#running-req: 0, #queue-req: 0, cuda graph: False, input throughput (token/s): 32768.00\n"
           "[2026-12-07 10:00:02] Prefill batch, #new-seq: 1, #new-token: 16, #cached-token: 0, #running-req: 0, "
           "#queue-req: 0, cuda graph: False, input throughput (token/s): 16.00\n")
    assert longctx.visit_prefill_ms(log) == pytest.approx(500.0 + 1000.0)
    assert longctx.visit_prefill_ms(log.splitlines()[0]) is None


def _hand_decode_share(t: int) -> float:
    """Flash's indexer share of one decode step at depth t, written out term by term."""
    h, heads, hd, q, o, groups, vocab = 4096, 64, 512, 1024, 1024, 8, 129280
    attn = h * q + h * hd + q * heads * hd + heads * hd * o + groups * o * h
    router, active = h * 256, (6 + 1) * 3 * h * 2048
    comp4, comp128 = h * 2 * 2 * hd, h * 2 * hd
    indexer = q * 64 * 128 + h * 64 + h * 2 * 2 * 128
    window = min(t, 128)
    per_key = heads * 2 * (hd + hd)
    score = 2 * 64 * 128 * (t // 4)
    swa = 2 * (attn + router + active) + per_key * window
    c4 = 2 * (attn + comp4 + indexer + router + active) + per_key * (window + min(512, t // 4)) + score
    c128 = 2 * (attn + comp128 + router + active) + per_key * (window + t // 128)
    total = 2 * swa + 21 * c4 + 20 * c128 + 2 * h * vocab
    return 21 * score / total


def test_the_analytic_share_grows_with_the_length_and_matches_a_hand_computation():
    flash = dsv4_checkpoints.FLASH
    assert dsv4_checkpoints.c4_layers("tiny") == 2 and sum(r == 4 for r in flash["compress_ratios"][:43]) == 21
    assert longctx.indexer_share(flash, 16384, "decode") == pytest.approx(_hand_decode_share(16384), rel=1e-12)
    assert longctx.indexer_share(flash, 262144, "decode") == pytest.approx(_hand_decode_share(262144), rel=1e-12)
    for kind in ("prefill", "decode"):
        shares = [longctx.indexer_share(flash, n, kind) for n in (4096, 16384, 65536, 262144)]
        assert shares == sorted(shares) and shares[0] < shares[-1] < 1
    # a prefill sums its rows: two rows' share is their summed terms' share
    assert longctx.indexer_share(flash, 8, "prefill") == pytest.approx(
        21 * 2 * 64 * 128 * (0 + 0 + 0 + 1 + 1 + 1 + 1 + 2)
        / longctx._row_flops({**dsv4_checkpoints._COMMON, **flash}, list(range(1, 9)))[1])
    shares = longctx.analytic_shares([16384], [(8, 65536)], "flash_share")
    assert set(shares) == {"prefill 16384", "decode 8x65536"}
    assert 0 < shares["decode 8x65536"]["served"] < shares["decode 8x65536"]["full"]  # 9 of 20 layers C4, not 21 of 43


def test_flash_share_fills_three_servers_in_sixty_percent_of_80_gb():
    layers, experts = dsv4_checkpoints.flash_share_counts()
    cfg = dsv4_checkpoints.config("flash_share")
    assert (layers, experts) == (cfg["num_hidden_layers"], cfg["n_routed_experts"]) == (20, 8)
    budget = 0.6 * 80e9
    assert 3 * dsv4_checkpoints.weight_bytes(cfg) <= budget
    more = {**cfg, "num_hidden_layers": 22, "compress_ratios": dsv4_checkpoints.layer_pattern(22)}
    assert 3 * dsv4_checkpoints.weight_bytes(more) > budget
    assert cfg["compress_ratios"] == [0, 0] + [4, 128] * 9 + [0] and dsv4_checkpoints.c4_layers("flash_share") == 9
    assert dsv4_checkpoints.layer_pattern(12) == dsv4_checkpoints.config("flash12")["compress_ratios"]
    for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "o_lora_rank", "o_groups", "num_experts_per_tok",
                "moe_intermediate_size", "vocab_size"):
        assert cfg[key] == dsv4_checkpoints.FLASH[key]
    # the full model in bf16: Flash's 284B parameters
    assert 280e9 < dsv4_checkpoints.weight_bytes(dsv4_checkpoints.FLASH) / 2 < 290e9


def test_a_run_on_stand_in_servers_fills_every_figure(monkeypatch):
    """Two prefill lengths and one decode point over two rounds on loopback stand-ins whose logs get sglang's
    lines as each request is answered: DeepGEMM's prefill 10% faster by its log, every step read from the
    stream and from the decode lines."""
    monkeypatch.setenv("DSV4_GPU_LONGCTX_MODEL", "tiny")
    monkeypatch.setenv("DSV4_GPU_LONGCTX_PREFILL", "200,300")
    monkeypatch.setenv("DSV4_GPU_LONGCTX_DECODE", "2x300")
    monkeypatch.setenv("DSV4_GPU_LONGCTX_ROUNDS", "2")
    monkeypatch.setattr(longctx, "DECODE_STEPS", 6)
    server_prefill_ms = {"dsv4_bf16": 100.0, "sglang_tilelang": 100.0, "sglang_deepgemm": 100 / 1.1}
    step_ms = {"dsv4_bf16": 8.0, "sglang_tilelang": 8.0, "sglang_deepgemm": 8.0}
    started = {n: _serve(_tokens(0), _topk(0), step_s=0.004) for n in NAMES}
    urls = {n: url for n, (_, url) in started.items()}
    by_url = {url: n for n, url in urls.items()}
    text = {n: "" for n in NAMES}
    real_generate, real_stream = longctx.traffic.generate, longctx.traffic.stream_token_times

    def generate(url, ids, n, **kw):
        out = real_generate(url, ids, n, **kw)
        name = by_url[url]
        thr = len(ids[0]) / (server_prefill_ms[name] / 1e3)  # each line's gap: the planted prefill
        text[name] += (f"Prefill batch, #new-seq: 1, #new-token: {len(ids[0])}, #cached-token: 0, #running-req: 0, "
                       f"#queue-req: 0, cuda graph: False, input throughput (token/s): {thr:.2f}\n")
        return out

    def stream(url, ids, n, **kw):
        out = real_stream(url, ids, n, **kw)
        name = by_url[url]
        text[name] += "".join(f"Decode batch, #running-req: {len(ids)}, #token: 9, gen throughput (token/s): "
                              f"{len(ids) * 1e3 / step_ms[name]:.2f}\n" for _ in range(3))
        return out

    monkeypatch.setattr(longctx.traffic, "generate", generate)
    monkeypatch.setattr(longctx.traffic, "stream_token_times", stream)
    try:
        res = longctx.run(urls, {n: (lambda n=n: text[n]) for n in NAMES})
    finally:
        for server, _ in started.values():
            server.shutdown()
    assert res["model"] == "tiny" and res["rounds"] == 2
    assert res["points"] == {"prefill": [200, 300], "decode": ["2x300"]}
    assert set(res["first_ms"]["dsv4_bf16"]) == {"prefill 200", "prefill 300", "decode 2x300"}
    assert res["visit_order"]["prefill 300 round 1"] == res["visit_order"]["prefill 300 round 0"][::-1]
    for n in NAMES:
        assert len(res["prefill"]["200"][n]["visits_ms"]) == 2
        assert res["prefill"]["300"][n]["server_ms"]["median"] == pytest.approx(server_prefill_ms[n], rel=1e-3)
        assert res["decode"]["2x300"][n]["server_step_ms"]["median"] == pytest.approx(8.0, rel=1e-3)
        assert res["decode"]["2x300"][n]["step_ms"]["median"] > 0
    row = res["ratios"]["prefill 300"]["dsv4_bf16/sglang_deepgemm"]
    assert row["server"]["ratio"] == pytest.approx(1.1, rel=1e-3) and row["server_verdict"] == "failed"
    assert res["ratios"]["decode 2x300"]["dsv4_bf16/sglang_tilelang"]["server_verdict"] == "shown"
    assert res["bar_verdicts"]["dsv4_bf16"]["server"]["failed"] == ["prefill 200", "prefill 300"]
    assert set(res["analytic_indexer_share"]) == {"prefill 200", "prefill 300", "decode 2x300"}
    assert row["analytic_indexer_share"] == res["analytic_indexer_share"]["prefill 300"]

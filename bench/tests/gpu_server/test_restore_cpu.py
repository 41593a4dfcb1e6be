"""The ``restore`` set's client on the CPU, against loopback stand-ins that answer ``/generate`` as sglang does
with a prefix cache: ``meta_info.cached_tokens`` the longest prefix of the prompt among those it still holds (every
earlier prompt with a host tier, the last one without), answered after a time that grows with what was not
cached. Real: the visit (session, filler, returning turn), the order, the figures and the ratios."""

from __future__ import annotations

import time

import pytest

from bench.gpu_server import restore, run
from bench.tests.gpu_server.test_scenarios_cpu import _serve

TOKENS = 8 * restore.POOL_MARGIN


def _cached(ids: list[int], held: list[list[int]]) -> int:
    best = 0
    for old in held:
        n = 0
        for a, b in zip(ids, old):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def _stand_in(host_tier: bool):
    held: list[list[int]] = []

    def meta_of(ids):
        cached = _cached(ids, held)
        if not host_tier:
            held.clear()  # the device pool holds one session
        held.append(ids)
        time.sleep((len(ids) - cached) * 1e-6)
        return {"cached_tokens": cached}

    return _serve(lambda ids, n: [1] * n, None, meta_of=meta_of)


def test_the_set_is_registered_and_sizes_each_pool_for_one_session(monkeypatch):
    assert run.SETS["restore"] == (restore.specs, restore.run)
    monkeypatch.setenv("DSV4_GPU_RESTORE_TOKENS", str(TOKENS))
    specs = {s.name: s for s in restore.specs()}
    assert list(specs) == list(restore.SERVERS)
    assert {s.max_total_tokens for s in specs.values()} == {TOKENS + restore.TURN_TOKENS + restore.POOL_MARGIN}
    assert "--enable-hierarchical-cache" in specs["restore_bf16"].extra_args
    assert "--enable-hierarchical-cache" in specs["restore_fp8"].extra_args
    assert "--enable-hierarchical-cache" not in specs["recompute_bf16"].extra_args
    assert (specs["restore_fp8"].impl, specs["restore_fp8"].upstream_indexer) == ("sglang", "deepgemm")
    with pytest.raises(ValueError, match="DSV4_GPU_RESTORE_TOKENS"):
        restore.session_tokens({"DSV4_GPU_RESTORE_TOKENS": "4096"})


def test_a_run_on_stand_ins_finds_the_prefix_on_host_and_times_every_visit(monkeypatch):
    monkeypatch.setenv("DSV4_GPU_RESTORE_TOKENS", str(TOKENS))
    monkeypatch.setenv("DSV4_GPU_RESTORE_ROUNDS", "2")
    monkeypatch.setenv("DSV4_GPU_RESTORE_MODEL", "tiny")
    started = {"restore_bf16": _stand_in(True), "restore_fp8": _stand_in(True), "recompute_bf16": _stand_in(False)}
    try:
        res = restore.run({n: url for n, (_, url) in started.items()})
    finally:
        for server, _ in started.values():
            server.shutdown()
    assert res["session_tokens"] == TOKENS and res["rounds"] == 2
    assert res["visit_order"]["round 1"] == res["visit_order"]["round 0"][::-1]
    for n in restore.SERVERS:
        assert len(res["visits"][n]) == 2 and all(v["ttft_ms"] > 0 for v in res["visits"][n])
    assert res["servers"]["restore_bf16"]["cached_tokens_median"] == TOKENS
    assert res["servers"]["recompute_bf16"]["cached_tokens_median"] == 0
    assert set(res["ratios"]) == {"restore_bf16/restore_fp8", "restore_bf16/recompute_bf16"}
    assert res["ratios"]["restore_bf16/recompute_bf16"]["ratio"] < 0.5

"""Pure pieces of the guard: the snapshot digest, the reconciliation plan, the startup warning."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

from dsv4_sm120.guard import hooks, reconcile, snapshot


def test_digest_is_order_sensitive_and_fits_a_negatable_int64():
    a, b = snapshot.digest(["r1", "r2"]), snapshot.digest(["r2", "r1"])
    assert a != b  # upstream pairs reduced poll states by position: order must agree too
    assert snapshot.digest(["r1r2"]) != snapshot.digest(["r1", "r2"])
    assert 0 <= a < 2**62 and -a >= -(2**63)


def test_plan_keeps_what_every_rank_holds_in_rank0_order_and_names_the_holders():
    gathered = [
        {"queues": {"bootstrap": ["a", "b", "c"], "waiting": ["x"]}, "ipc": {"a": None, "b": "w1"}},
        {"queues": {"bootstrap": ["c", "a"], "waiting": ["x", "b"]}, "ipc": {}},
    ]
    p = reconcile.plan(gathered)
    assert p.keep == {"bootstrap": ["a", "c"], "waiting": ["x"]}
    assert p.orphans == {"bootstrap": {"b": [0]}, "waiting": {"b": [1]}}
    assert p.ipc["b"] == "w1"


def test_plan_without_keeping_common_requests_retires_every_one_where_held():
    gathered = [{"queues": {"running": ["a", "b"]}, "ipc": {}}, {"queues": {"running": ["a"]}, "ipc": {}}]
    p = reconcile.plan(gathered, keep_common=False)
    assert p.keep == {"running": []}
    assert p.orphans == {"running": {"a": [0, 1], "b": [0]}}


def test_batch_vector_changes_with_everything_that_shapes_the_forward():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    def batch(rids, mode=ForwardMode.EXTEND, extend=8, seq=8):
        return SimpleNamespace(reqs=[SimpleNamespace(rid=r) for r in rids], forward_mode=mode,
                               extend_num_tokens=extend, seq_lens_sum=seq)

    base = snapshot.batch_vector(batch(["a", "b"]))
    assert len(base) == len(snapshot.BATCH_FIELDS) and snapshot.batch_vector(None) == [0] * len(base)
    for other in (batch(["b", "a"]), batch(["a"]), batch(["a", "b"], ForwardMode.DECODE), batch(["a", "b"], extend=4),
                  batch(["a", "b"], seq=9)):
        assert snapshot.batch_vector(other) != base


def test_reason_says_what_happened_and_that_a_retry_is_safe():
    text = reconcile.reason("decode", "transfer", [2, 3], 4)
    assert "4 tensor-parallel ranks" in text and "transfer queue" in text and "[2, 3]" in text
    assert "Retrying it is safe" in text


def _fake_loaded_loops(monkeypatch, patched: bool):
    for name in ("prefill", "decode"):
        mod = types.ModuleType(f"sglang.srt.disaggregation.{name}")
        if patched:
            mod._dsv4_collective_guard = object()
        monkeypatch.setitem(sys.modules, mod.__name__, mod)


def test_pd_scheduler_startup_warns_loudly_when_the_patch_is_missing(monkeypatch, caplog):
    _fake_loaded_loops(monkeypatch, patched=False)
    sched = SimpleNamespace(disaggregation_mode=SimpleNamespace(value="decode"), tp_rank=1)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120.guard"):
        assert hooks.warn_if_unpatched("r", sched) == "r"
    assert "NOT applied" in caplog.text and "dsv4-sm120 patch apply" in caplog.text


def test_no_warning_when_patched_or_not_pd(monkeypatch, caplog):
    _fake_loaded_loops(monkeypatch, patched=True)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120.guard"):
        hooks.warn_if_unpatched(None, SimpleNamespace(disaggregation_mode=SimpleNamespace(value="prefill")))
        _fake_loaded_loops(monkeypatch, patched=False)
        hooks.warn_if_unpatched(None, SimpleNamespace(disaggregation_mode=SimpleNamespace(value="null")))
    assert caplog.text == ""


def test_counters_reach_prometheus_when_upstream_metrics_are_on():
    from prometheus_client import REGISTRY

    from dsv4_sm120.guard.counters import Counters

    c = Counters()
    c.enable_metrics("decode")
    c.add("divergences_seen")
    c.add("requests_aborted", 3)
    assert REGISTRY.get_sample_value("sglang:dsv4_guard_divergences_seen_total", {"loop": "decode"}) == 1
    assert REGISTRY.get_sample_value("sglang:dsv4_guard_requests_aborted_total", {"loop": "decode"}) == 3
    assert c.line() == "seen=1 reconciled=0 aborted=3 fail_fasts=0"

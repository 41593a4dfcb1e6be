"""Pure pieces of the guard: the snapshot digest, the reconciliation plan, the startup warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
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
    # In a process of its own: metrics.enable creates the collectors once per process (as in a scheduler).
    probe = (
        "from prometheus_client import REGISTRY\n"
        "from dsv4_sm120 import metrics\n"
        "from dsv4_sm120.guard.counters import Counters\n"
        "c = Counters(loop='decode')\n"
        "c.add('divergences_seen')\n"  # before enable: counted here, a no-op on /metrics
        "metrics.enable(0)\n"
        "c.add('divergences_seen')\n"
        "c.add('requests_aborted', 3)\n"
        "get = lambda n: REGISTRY.get_sample_value(f'sglang:dsv4_guard_{n}_total', {'tp_rank': '0', 'loop': 'decode'})\n"
        "print(get('divergences_seen'), get('requests_aborted'), c.line())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1.0 3.0 seen=2 reconciled=0 aborted=3 fail_fasts=0", out.stderr[-2000:]


def _prefill_stand_in(n: int) -> SimpleNamespace:
    reqs = [SimpleNamespace(rid=f"r{i}") for i in range(n)]
    return SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(queue=reqs[: n // 2]),
                           waiting_queue=reqs[n // 2 :], disagg_prefill_inflight_queue=[], last_batch=None,
                           running_batch=None, chunked_req=None, result_queue=[], _deferred_input_requests=[])


def test_cached_vectors_equal_fresh_snapshots_after_every_kind_of_queue_change():
    """The per-iteration vectors come from digests cached by item identity; after each change a
    queue can see (append, pop, reorder, slice assignment, an equal-id stand-in, the chunked request,
    the last batch, a new batch) they must equal what a fresh snapshot computes."""
    s = _prefill_stand_in(8)
    d = snapshot.Digests()
    extra = SimpleNamespace(rid="x")

    def same():
        assert snapshot.top_vector(s, "prefill", d) == snapshot.take(s, "prefill").vector()
        for name in snapshot.PREFILL_QUEUES:
            assert snapshot.queue_vector(s, "prefill", name, d) == snapshot.take_queue(s, "prefill", name).vector()

    changes = [
        lambda: None,
        lambda: s.waiting_queue.append(extra),
        lambda: s.waiting_queue.pop(0),
        lambda: s.waiting_queue.reverse(),
        lambda: s.disagg_prefill_bootstrap_queue.queue.__setitem__(slice(None), s.disagg_prefill_bootstrap_queue.queue[1:]),
        lambda: s.disagg_prefill_inflight_queue.extend(s.waiting_queue[:2]),
        lambda: s.waiting_queue.__setitem__(0, SimpleNamespace(rid=s.waiting_queue[0].rid)),  # same id, new object
        lambda: s.waiting_queue.__setitem__(0, SimpleNamespace(rid="other")),
        lambda: setattr(s, "chunked_req", extra),
        lambda: setattr(s, "chunked_req", s.waiting_queue[0]),
        lambda: setattr(s, "last_batch", SimpleNamespace(reqs=list(s.waiting_queue))),
        lambda: s.last_batch.reqs.pop(),
        lambda: setattr(s, "running_batch", s.last_batch),
        lambda: setattr(s, "last_batch", None),
        lambda: s.waiting_queue.clear(),
    ]
    for change in changes:
        change()
        same()
        same()  # twice: the second read comes from the cache
    a, b = SimpleNamespace(reqs=[extra, s.disagg_prefill_bootstrap_queue.queue[0]]), None
    for batch in (a, SimpleNamespace(reqs=list(reversed(a.reqs))), a, b):
        assert snapshot.batch_vector(batch, d) == snapshot.batch_vector(batch)


def _slots(world: int, width: int, counted: bool = False):
    import mmap

    from dsv4_sm120.guard import consensus

    mm = mmap.mmap(-1, 2 * world * 8 * (width + 2))
    return [consensus._Slots(mm, 0, world, width, r, [os.getpid()] * world, counted=counted) for r in range(world)]


def test_shared_memory_row_copied_mid_store_is_read_again_not_trusted():
    """A peer's row whose sequence is visible but whose payload and check word are not (a copy that
    raced its writer) is never taken for that peer's answer: the reader looks again until it is whole."""
    import threading

    me, peer = _slots(2, 4)
    peer.publish(1, [7, 7, 7, 7], 4)
    off = peer.offsets[1][1]
    me.mm[off + 16 : off + 24] = (9).to_bytes(8, "little")  # the first payload word not yet stored
    fixed = threading.Timer(0.05, lambda: peer.publish(1, [7, 7, 7, 7], 4))
    fixed.start()
    t0 = time.perf_counter()
    rows = me.exchange(1, [7, 7, 7, 7])
    assert time.perf_counter() - t0 >= 0.04
    assert [me.words(r) for r in rows] == [(7, 7, 7, 7)] * 2


def test_poll_rows_of_different_lengths_are_read_whole_and_reported():
    """Poll reductions carry their own length; a rank reducing a longer list than its peer reads the
    peer's shorter row whole (instead of waiting on stale words past its end) and sees the lengths."""
    me, peer = _slots(2, 8, counted=True)
    peer.publish(1, [2, 5, 5, 5, 5], 5)  # an earlier, longer operation of the same parity
    peer.publish(3, [1, 4], 2)
    rows = me.exchange(3, [3, 1, 2, 3], used=4)
    assert [me.words(r) for r in rows] == [(3, 1, 2, 3), (1, 4)]


def test_the_peers_hooks_go_on_only_in_a_pd_scheduler_with_tp_peers():
    """At one TP rank the guard has nothing to agree on: its per-iteration hooks stay off upstream's methods (they
    took 0.5-1.3% of a TP=1 PD pair's loops to step aside); a PD scheduler with peers puts them on when its
    disaggregation state is built. In a process of its own: applied hooks stay for the process."""
    probe = (
        "import dataclasses\n"
        "from types import SimpleNamespace\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "from dsv4_sm120 import settings\n"
        "from dsv4_sm120.guard import batch_check, consensus, hooks, queue_check\n"
        "hooks.register(dataclasses.replace(settings.load(), collective_guard=True))\n"
        "HookRegistry.apply_hooks()\n"
        "on = lambda: [t in HookRegistry._patched for t in (batch_check.PREFILL_TARGET, "
        "queue_check.DECODE_TRANSFER + '.pop_transferred')]\n"
        "prefill = SimpleNamespace(disaggregation_mode=SimpleNamespace(value='prefill'), tp_rank=0)\n"
        "before = on()\n"
        "assert hooks.on_scheduler_start('r', prefill) == 'r'\n"  # no TP group: one rank
        "alone = on()\n"
        "consensus.groups_of = lambda scheduler: ['a group of two ranks']\n"
        "hooks.on_scheduler_start('r', SimpleNamespace(disaggregation_mode=SimpleNamespace(value='null')))\n"
        "not_pd = on()\n"
        "hooks.on_scheduler_start('r', prefill)\n"
        "print(before, alone, not_pd, on())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[False, False] [False, False] [False, False] [True, True]", out.stderr[-3000:]

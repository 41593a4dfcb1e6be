"""A dead or stuck NIXL prefill thread makes the scheduler's health check go unanswered."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from dsv4_sm120.nixl import liveness
from tests.polling import wait_until

HEALTH = SimpleNamespace(rid="HEALTH_CHECK_dsv4_test")


def _scheduler_health_answered() -> bool:
    """Call the hooked Scheduler.handle_generate_request with a health check, as the scheduler's dispatcher does.

    The scheduler itself is not built (that needs a model): the stand-in has no
    attributes, so reaching upstream's handler raises AttributeError, which means
    the request went through; None means the hook held it back.
    """
    from sglang.srt.managers.scheduler import Scheduler

    try:
        return Scheduler.handle_generate_request(SimpleNamespace(), HEALTH) is not None
    except AttributeError:
        return True


def test_stuck_transfer_worker_then_dead_bootstrap_thread_fail_health(make_pd):
    pd = make_pd(seed=8)
    watch = liveness.existing_watch(pd.prefill)
    assert watch is not None and liveness.problems() == []
    assert _scheduler_health_answered()

    # A UCX transfer that never returns cannot be produced on demand on loopback:
    # this one test holds the worker inside the pin's send path with an Event.
    release = threading.Event()
    real_send = pd.prefill.send_kvcache
    pd.prefill.send_kvcache = lambda *a, **k: (release.wait(30), real_send(*a, **k))[1]
    watch.stall_after_s = 0.5
    try:
        s = pd.open()
        pd.send_metadata(s)
        # pump() plays the prefill scheduler: it queues the transfer once the room is bootstrapped.
        assert wait_until(lambda: pd.pump() >= 0 and any("transfer worker" in p for p in liveness.problems()))
        assert not _scheduler_health_answered()
        release.set()
        assert pd.run([s], 10) and pd.verify(s)
        assert wait_until(lambda: liveness.problems() == [])
        assert _scheduler_health_answered()
    finally:
        release.set()
        pd.prefill.send_kvcache = real_send

    pd.hardening.stop()  # the thread ends: whatever the reason, health must say so
    assert any("bootstrap thread is dead" in p for p in liveness.problems())
    assert not _scheduler_health_answered()
    liveness.forget(pd.prefill)
    assert liveness.problems() == []

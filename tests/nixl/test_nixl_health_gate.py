"""The health gate on the pin's real ``Scheduler`` health-check code, busy and idle.

A busy scheduler does not run a health-check request: upstream's
``handle_generate_request`` queues its reply address in ``return_health_check_ipcs`` and
``maybe_send_health_check_signal`` answers it from the loop ("ongoing requests already
carry health info"). That second path must not vouch for a dead NIXL thread either.

Upstream's methods run as the pin ships them, hooked through upstream's HookRegistry, on
an ``object.__new__(Scheduler)`` with the attributes they read. Replaced: the tokenizer
socket (a recorder: its ``send_output`` is what the method calls) and the NIXL manager
that liveness judges (a dead bootstrap thread, stated directly; the real thread dying is
tests/nixl/test_nixl_liveness.py and, on a real server, tests/e2e/test_pd_liveness.py).
"""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import pytest


class _Socket:
    def __init__(self):
        self.sent = []

    def send_output(self, output):
        self.sent.append(output)


class _Manager:  # what liveness reads of a NixlKVManager: kv_args.engine_rank, agent.name
    kv_args = SimpleNamespace(engine_rank=0)
    agent = SimpleNamespace(name="health-gate-test")


@pytest.fixture
def busy_scheduler():
    from sglang.srt.managers.scheduler import Scheduler

    from dsv4_sm120.loopback.pair import install_hooks

    install_hooks()
    sched = object.__new__(Scheduler)
    sched.rust_server = None
    sched.ipc_channels = SimpleNamespace(send_to_tokenizer=_Socket())
    sched.return_health_check_ipcs = deque(["ipc://worker-0", "ipc://worker-1"])
    return sched


@pytest.fixture
def dead_nixl_thread():
    from dsv4_sm120.nixl import liveness

    mgr = _Manager()
    watch = liveness.watch_for(mgr)
    watch.bootstrap = SimpleNamespace(thread=None, exit_reason="SystemExit: test", last_beat=0.0, busy_since=None)
    yield mgr
    liveness.forget(mgr)


def test_busy_scheduler_answers_queued_health_checks_while_nixl_is_alive(busy_scheduler):
    from sglang.srt.managers.io_struct import HealthCheckOutput

    from dsv4_sm120.nixl import liveness

    assert liveness.problems() == []
    busy_scheduler.maybe_send_health_check_signal()
    [out] = busy_scheduler.ipc_channels.send_to_tokenizer.sent
    assert isinstance(out, HealthCheckOutput) and out.http_worker_ipc == "ipc://worker-0"
    assert list(busy_scheduler.return_health_check_ipcs) == ["ipc://worker-1"]


def test_busy_scheduler_does_not_vouch_for_a_dead_nixl_thread(busy_scheduler, dead_nixl_thread):
    from dsv4_sm120.nixl import liveness

    assert any("bootstrap thread is dead" in p for p in liveness.problems())
    busy_scheduler.maybe_send_health_check_signal()
    assert busy_scheduler.ipc_channels.send_to_tokenizer.sent == []  # no answer: /health times out, 503
    assert not busy_scheduler.return_health_check_ipcs  # and the queued checks are not answered later either


def test_a_dead_transfer_worker_fails_health(busy_scheduler):
    """A transfer worker thread that ended (upstream's workers never return) is a problem, next to a live
    bootstrap thread; the worker registers from its own thread, as the ``transfer_worker`` hook does."""
    from dsv4_sm120.nixl import liveness

    mgr = _Manager()
    watch = liveness.watch_for(mgr)
    alive = threading.Event()
    bootstrap = threading.Thread(target=alive.wait, daemon=True)
    bootstrap.start()
    watch.bootstrap = SimpleNamespace(thread=bootstrap, exit_reason=None, last_beat=float("inf"), busy_since=None)
    try:
        worker = threading.Thread(target=lambda: watch.add_worker(0, liveness.ProgressQueue(deque())))
        worker.start()
        worker.join()
        assert [p for p in liveness.problems() if "health-gate-test" in p] == [
            "NIXL prefill engine_rank=0 agent=health-gate-test: transfer worker 0 is dead"]
        busy_scheduler.maybe_send_health_check_signal()
        assert busy_scheduler.ipc_channels.send_to_tokenizer.sent == []
    finally:
        alive.set()
        liveness.forget(mgr)

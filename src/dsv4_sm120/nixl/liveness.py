"""Is every NIXL prefill thread alive and making progress? The answer ``/health`` gets.

Upstream's health check (``/health`` and ``/health_generate``, sglang 0.5.23)
sends a one-token request through the scheduler with a fake bootstrap host; it
never touches the NIXL manager, so a dead bootstrap thread or a transfer worker
stuck on one chunk leaves the server green while every PD request waits out its
timeout. This module keeps a watch per hardened prefill manager:

* the bootstrap thread must be alive, and its loop must come back to poll within
  ``stall_after_s`` (it beats every 200 ms when idle);
* each transfer worker must be alive, and must not hold one chunk longer than
  ``stall_after_s`` (a :class:`ProgressQueue` sees every dequeue).

:func:`problems` lists what is wrong; the scheduler hooks in
:mod:`dsv4_sm120.nixl.hooks` drop health-check requests while it is non-empty,
so the tokenizer gets no answer and ``/health`` returns 503 after
``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) and marks the server UnHealthy.
"""

from __future__ import annotations

import threading
import time
import weakref

# A chunk legitimately takes seconds; a worker silent for 2 minutes with a chunk in hand is stuck.
STALL_AFTER_S = 120.0


class ProgressQueue:
    """Wraps a transfer queue to see when its worker takes an item and when it comes back for the next."""

    def __init__(self, queue, clock=time.monotonic):
        self._queue = queue
        self._clock = clock
        self.holding_since: float | None = None
        self.taken = 0

    def get(self):
        self.holding_since = None
        item = self._queue.get()
        self.holding_since = self._clock()
        self.taken += 1
        return item

    def __getattr__(self, name):  # put() and anything else go to the real queue
        return getattr(self._queue, name)


class ManagerWatch:
    """The threads of one hardened prefill ``NixlKVManager`` and how to judge them."""

    def __init__(self, mgr, stall_after_s: float = STALL_AFTER_S):
        self.name = f"NIXL prefill engine_rank={getattr(mgr.kv_args, 'engine_rank', '?')} agent={mgr.agent.name}"
        self.stall_after_s = stall_after_s
        self.bootstrap = None  # HardenedBootstrap, set when its thread starts
        self.manager = lambda: None  # weak reference to the manager, set by watch_for
        self.workers: dict[int, tuple[threading.Thread, ProgressQueue]] = {}
        self._lock = threading.Lock()

    def add_worker(self, index: int, queue: ProgressQueue) -> None:
        with self._lock:
            self.workers[index] = (threading.current_thread(), queue)

    def problems(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        out = []
        boot = self.bootstrap
        if boot is not None:
            if boot.thread is None or not boot.thread.is_alive():
                out.append(f"{self.name}: bootstrap thread is dead ({boot.exit_reason or 'never started'})")
            elif now - boot.last_beat > self.stall_after_s:
                held = "" if boot.busy_since is None else f", stuck in one frame for {now - boot.busy_since:.0f}s"
                out.append(f"{self.name}: bootstrap thread has not polled for {now - boot.last_beat:.0f}s{held}")
        with self._lock:
            workers = list(self.workers.items())
        for index, (thread, queue) in workers:
            if not thread.is_alive():
                out.append(f"{self.name}: transfer worker {index} is dead")
            elif queue.holding_since is not None and now - queue.holding_since > self.stall_after_s:
                out.append(f"{self.name}: transfer worker {index} has held one chunk for {now - queue.holding_since:.0f}s")
        return out


_WATCHES: "weakref.WeakKeyDictionary[object, ManagerWatch]" = weakref.WeakKeyDictionary()
_WATCHES_LOCK = threading.Lock()


def watch_for(mgr) -> ManagerWatch:
    """The watch of ``mgr``, created on first use (the workers start before the bootstrap thread)."""
    from dsv4_sm120 import metrics

    metrics.add_sampler(sample_gauges)
    with _WATCHES_LOCK:
        watch = _WATCHES.get(mgr)
        if watch is None:
            watch = _WATCHES[mgr] = ManagerWatch(mgr)
            watch.manager = weakref.ref(mgr)
        return watch


def existing_watch(mgr) -> ManagerWatch | None:
    with _WATCHES_LOCK:
        return _WATCHES.get(mgr)


def forget(mgr) -> None:
    """Stop judging ``mgr`` (its owner shut it down on purpose)."""
    with _WATCHES_LOCK:
        _WATCHES.pop(mgr, None)


def sample_gauges() -> dict:
    """The NIXL gauges of ``sglang:dsv4_*``: threads alive and stuck, health problems, rooms held."""
    with _WATCHES_LOCK:
        watches = [w for w in _WATCHES.values() if w.bootstrap is not None]
    found = [p for w in watches for p in w.problems()]
    alive = sum(1 for w in watches if w.bootstrap.thread is not None and w.bootstrap.thread.is_alive())
    stuck = sum(1 for p in found if "transfer worker" in p)
    rooms = infos = 0
    for w in watches:
        mgr = w.manager()
        if mgr is not None:
            rooms += len(mgr.request_status)
            infos += len(mgr.transfer_infos)
    return {"nixl_bootstrap_threads_alive": alive, "nixl_transfer_workers_stuck": stuck,
            "nixl_health_problems": len(found), "nixl_rooms_open": {("prefill",): rooms},
            "nixl_transfer_infos_open": infos}


def problems() -> list[str]:
    """Every reason this process's NIXL prefill side cannot serve; empty when healthy."""
    with _WATCHES_LOCK:
        watches = list(_WATCHES.values())
    # Workers of a manager left on the pin's bootstrap thread are watched but not judged.
    return [p for w in watches if w.bootstrap is not None for p in w.problems()]

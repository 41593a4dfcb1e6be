"""What each fix costs where it runs: the seconds its hooks and its loop call take in the server, per fix and thread.

Why: a fix may cost at most 1% of throughput, and two PD pairs of one configuration on one GPU host differ by
5-10% from start to start, so no throughput benchmark on one host can show a 1% price. What a fix adds is the
time its code runs on the thread that steps: a scheduler's loop runs on its process's main thread, one step
after another, so a level that took ``T`` with the fix's ``X`` seconds on that thread would take at least
``T - X`` without it, and ``X / T`` bounds the share of throughput the fix takes (loosely where the loop idles:
its idle iterations run the hooks too). Other threads (the NIXL transfer workers) only take the GIL meanwhile.

What is counted: every hook the package registers (:func:`dsv4_sm120.hooks.hook` wraps each in :func:`wrap`,
labelled with the manifest's ``fix`` of its target) and the collective guard's loop call (:func:`timed`). An
AROUND hook's own time is its whole call less the upstream call it wraps (``original``): that is upstream's
work, which would run without the package, and a hook nested inside it counts under its own fix.

How, at a price the loop does not notice: timing a call costs more than most hooks (four clock reads and an
inner function for an AROUND hook: 1.1 us a call on a Hopper host's CPU, against ~0.4 us of hook), and the loops
call these hooks tens of thousands of times a second. So each wrapped function times one call at random
intervals averaging :data:`SAMPLE_EVERY` calls, and that call's time stands for every call since the previous
timed one (``gap`` calls): the seconds are an unbiased estimate (the intervals do not depend on what the calls
cost), the calls an exact count up to the last timed call. A call not timed costs a counter decrement.
Totals are integers per thread ident, so no two threads write one total (the countdown is shared: a race there
only moves which call is timed).

Published: :data:`dsv4_sm120.metrics.SPECS` ``hook_seconds_total`` and ``hook_calls_total``, labelled ``fix`` and
``thread`` (``main`` or ``other``), by the metrics sampler once a second; a Prometheus increment per call would
cost more than most hooks do. ``bench/hook_time_cpu.py`` times what the wrapping adds per call.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from threading import get_ident
from time import perf_counter_ns

from dsv4_sm120 import metrics

SAMPLE_EVERY = 16  # the mean interval between timed calls of one wrapped function
_gaps = random.Random()  # the intervals: uniform on 1 .. 2 * SAMPLE_EVERY - 1

# per wrapped function: its fix and its totals by thread ident, [estimated nanoseconds, calls]
_counted: list[tuple[str, dict[int, list[int]]]] = []


class _Sampler:
    """One wrapped function's countdown to its next timed call, and its totals."""

    __slots__ = ("left", "gap", "cells")

    def __init__(self, fix: str):
        self.cells: dict[int, list[int]] = {}
        _counted.append((fix, self.cells))
        self.gap = self.left = self._next_gap()

    @staticmethod
    def _next_gap() -> int:
        return _gaps.randint(1, 2 * SAMPLE_EVERY - 1)

    def record(self, ns: int) -> None:
        """The timed call took ``ns``: it stands for the ``gap`` calls since the previous timed one."""
        ident = get_ident()
        cell = self.cells.get(ident)
        if cell is None:
            cell = self.cells[ident] = [0, 0]
        cell[0] += ns * self.gap
        cell[1] += self.gap
        self.gap = self.left = self._next_gap()


def timed(fix: str, fn: Callable) -> Callable:
    """``fn`` with its time counted under ``fix`` (a hook called on its own, or a loop call)."""
    sampler = _Sampler(fix)

    def call(*args, **kwargs):
        sampler.left -= 1
        if sampler.left > 0:
            return fn(*args, **kwargs)
        t0 = perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            sampler.record(perf_counter_ns() - t0)

    return _named_after(call, fn)


def timed_around(fix: str, fn: Callable) -> Callable:
    """The AROUND hook ``fn(original, *args, **kwargs)`` with its own time counted under ``fix``: its call less
    the time spent in ``original``."""
    sampler = _Sampler(fix)

    def call(original, *args, **kwargs):
        sampler.left -= 1
        if sampler.left > 0:
            return fn(original, *args, **kwargs)
        inside = [0]

        def upstream(*a, **k):
            t = perf_counter_ns()
            try:
                return original(*a, **k)
            finally:
                inside[0] += perf_counter_ns() - t

        t0 = perf_counter_ns()
        try:
            return fn(upstream, *args, **kwargs)
        finally:
            sampler.record(perf_counter_ns() - t0 - inside[0])

    return _named_after(call, fn)


def _named_after(call: Callable, fn: Callable) -> Callable:
    call.__name__, call.__qualname__, call.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    call.__wrapped__ = fn
    return call


def wrap(how: str, fix: str, fn: Callable) -> Callable:
    """The hook ``fn`` of kind ``how`` (upstream's ``HookType`` value) as it is registered: timed under ``fix``."""
    return timed_around(fix, fn) if how == "around" else timed(fix, fn)


def totals() -> dict[str, dict[tuple[str, str], float]]:
    """The counters' values so far, per (fix, ``main`` or ``other`` thread): the metrics sampler's source."""
    main = threading.main_thread().ident
    seconds: dict[tuple[str, str], float] = {}
    calls: dict[tuple[str, str], float] = {}
    for fix, cells in list(_counted):
        for ident, (ns, n) in list(cells.items()):
            key = (fix, "main" if ident == main else "other")
            seconds[key] = seconds.get(key, 0.0) + ns / 1e9
            calls[key] = calls.get(key, 0.0) + n
    return {"hook_seconds_total": seconds, "hook_calls_total": calls}


metrics.add_sampler(totals)

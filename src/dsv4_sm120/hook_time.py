"""What each fix costs where it runs: the seconds its hooks and its loop call take in the server, per fix and thread.

Why: a fix may cost at most 1% of throughput, and two servers of one configuration on one GPU host differ by
about 5% from start to start, so no throughput benchmark on one host can show a 1% price. What a fix adds to a
step is the time its code runs on the thread that steps: a scheduler's loop runs on its process's main thread,
one step after another, so that thread's seconds in a fix, over the seconds it served, bound the share of
throughput the fix can take (less where the GPU's work hides it). Other threads (the NIXL transfer workers)
only take the GIL from the loop meanwhile.

What is counted: every hook the package registers (:func:`dsv4_sm120.hooks.hook` wraps each in :func:`wrap`,
labelled with the manifest's ``fix`` of its target) and the collective guard's loop call (:func:`timed`). An
AROUND hook's own time is its whole call less the upstream call it wraps (``original``): that is upstream's
work, which would run without the package, and a hook nested inside it counts under its own fix. Time is
``perf_counter_ns`` (wall time on the calling thread, what a step waits for), in integers per thread so that
no two threads write one total.

Published: :data:`dsv4_sm120.metrics.SPECS` ``hook_seconds_total`` and ``hook_calls_total``, labelled ``fix`` and
``thread`` (``main`` or ``other``), by the metrics sampler once a second; a Prometheus increment per call would
cost more than most hooks do. What the counting itself adds per call (two clock reads, an AROUND hook's inner
function) is not in the totals; ``bench/hook_time_cpu.py`` times it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from threading import get_ident
from time import perf_counter_ns

from dsv4_sm120 import metrics

# per timed function: its fix and its totals by thread ident, [nanoseconds, calls], each written by its thread only
_counted: list[tuple[str, dict[int, list[int]]]] = []


def _cells(fix: str) -> dict[int, list[int]]:
    cells: dict[int, list[int]] = {}
    _counted.append((fix, cells))
    return cells


def timed(fix: str, fn: Callable) -> Callable:
    """``fn`` with every call's time counted under ``fix`` (a hook called on its own, or a loop call)."""
    cells = _cells(fix)

    def call(*args, **kwargs):
        t0 = perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            ns = perf_counter_ns() - t0
            cell = cells.get(get_ident())
            if cell is None:
                cell = cells[get_ident()] = [0, 0]
            cell[0] += ns
            cell[1] += 1

    return _named_after(call, fn)


def timed_around(fix: str, fn: Callable) -> Callable:
    """The AROUND hook ``fn(original, *args, **kwargs)`` with its own time counted under ``fix``: its call less
    the time spent in ``original``."""
    cells = _cells(fix)

    def call(original, *args, **kwargs):
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
            ns = perf_counter_ns() - t0 - inside[0]
            cell = cells.get(get_ident())
            if cell is None:
                cell = cells[get_ident()] = [0, 0]
            cell[0] += ns
            cell[1] += 1

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

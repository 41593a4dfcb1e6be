"""What each fix costs where it runs: every hook is timed under its manifest fix, an AROUND hook without the upstream
call it wraps, and the totals reach sglang's /metrics as counters that grow by what they gained."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_sm120 import hook_time, hooks, pin


class Clock:
    """A ``perf_counter_ns`` that moves only when the test's stand-in work says it took time."""

    def __init__(self):
        self.now = self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.now

    def work(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def clock(monkeypatch):
    """The fake clock, and every call timed (an interval of one) unless a test sets ``clock.gap``."""
    c = Clock()
    c.gap = 1
    monkeypatch.setattr(hook_time, "perf_counter_ns", c)
    monkeypatch.setattr(hook_time, "_counted", [])
    monkeypatch.setattr(hook_time._Sampler, "_next_gap", staticmethod(lambda: c.gap))
    return c


def _seconds(fix: str) -> float:
    return hook_time.totals()["hook_seconds_total"].get((fix, "main"), 0.0)


def test_an_around_hooks_own_time_leaves_out_the_upstream_call_it_wraps(clock):
    def upstream(x):
        clock.work(10_000)  # upstream's own work: it would run without the package
        return x + 1

    def around(original, x):
        clock.work(3_000)
        result = original(x)
        clock.work(2_000)
        return result * 2

    assert hook_time.wrap("around", "nixl", around)(upstream, 4) == 10
    assert _seconds("nixl") == pytest.approx(5e-6)

    def after(result, x):
        clock.work(4_000)
        return result

    assert hook_time.wrap("after", "guard", after)(7, 1) == 7
    assert _seconds("guard") == pytest.approx(4e-6)
    calls = hook_time.totals()["hook_calls_total"]
    assert calls[("nixl", "main")] == calls[("guard", "main")] == 1


def test_one_call_in_an_interval_is_timed_and_stands_for_every_call_of_it(clock):
    clock.gap = 4

    def around(original, cost):
        clock.work(cost)  # the calls cost 1..8 us: the timed 4th and 8th stand for their intervals
        return original()

    timed = hook_time.wrap("around", "guard", around)
    for cost in range(1_000, 9_000, 1_000):
        timed(lambda: clock.work(50_000), cost)
    assert hook_time.totals()["hook_calls_total"][("guard", "main")] == 8
    assert _seconds("guard") == pytest.approx((4 * 4_000 + 4 * 8_000) / 1e9)
    assert clock.reads == 2 * 4  # an AROUND hook's timed call reads the clock four times; the others never


def test_a_hook_that_raises_is_still_counted_and_its_error_passes_through(clock):
    def failing(original):
        clock.work(1_000)
        raise ValueError("the hook's own error")

    with pytest.raises(ValueError, match="the hook's own error"):
        hook_time.wrap("around", "index_k", failing)(lambda: None)
    assert _seconds("index_k") == pytest.approx(1e-6)


def test_every_hook_goes_through_the_door_timed_under_its_manifest_fix(clock):
    from sglang.srt.plugins.hook_registry import HookRegistry

    target = "sglang.srt.managers.scheduler.Scheduler.maybe_send_health_check_signal"
    assert pin.touch_for(target).fix == "nixl"

    def gate(original, scheduler):
        clock.work(7_000)
        return original(scheduler)

    hooks.hook(target, gate)
    try:
        kind, registered, _ = HookRegistry._hooks[target][-1]
        assert registered.__wrapped__ is gate and kind.value == "around"
        registered(lambda scheduler: clock.work(50_000), object())
    finally:  # leave the registry as found: an empty entry would mark the target applied, with nothing on it
        HookRegistry._hooks[target].pop()
        if not HookRegistry._hooks[target]:
            del HookRegistry._hooks[target]
    assert _seconds("nixl") == pytest.approx(7e-6)


def test_the_guards_loop_call_is_timed_under_guard():
    from dsv4_sm120.guard import loop_guard

    assert loop_guard.check_iteration.__wrapped__ is loop_guard._check_iteration
    calls = lambda: hook_time.totals()["hook_calls_total"].get(("guard", "main"), 0)  # noqa: E731
    before, scheduler = calls(), type("Scheduler", (), {"tp_rank": 0})()
    for n in range(1, 2 * hook_time.SAMPLE_EVERY):  # within one interval a call is timed, standing for all n
        loop_guard.check_iteration(scheduler, "decode")  # the guard off (no TP group): it only returns
        if calls() != before:  # the interval may have begun with calls of earlier tests
            assert before + n <= calls() < before + n + 2 * hook_time.SAMPLE_EVERY
            return
    raise AssertionError(f"no call of the guard's loop call was timed in {n}")


def test_hook_time_reaches_prometheus_as_counters_by_fix_and_thread():
    # In a process of its own: metrics.enable creates the collectors once per process (as in a scheduler).
    probe = (
        "import threading, time\n"
        "from prometheus_client import REGISTRY\n"
        "from dsv4_sm120 import hook_time, metrics\n"
        "metrics.enable(0)\n"
        "hook_time.SAMPLE_EVERY = 1\n"  # every call timed
        "busy = hook_time.wrap('before', 'guard', lambda: time.sleep(0.01))\n"
        "busy(); busy()\n"
        "t = threading.Thread(target=busy); t.start(); t.join()\n"
        "get = lambda n, th: REGISTRY.get_sample_value(f'sglang:dsv4_hook_{n}_total', "
        "{'tp_rank': '0', 'fix': 'guard', 'thread': th})\n"
        "metrics.sample_once(); metrics.sample_once()\n"  # twice: a counter gains only what its total gained
        "print(get('calls', 'main'), get('calls', 'other'), 0.02 <= get('seconds', 'main') < 1, "
        "0.01 <= get('seconds', 'other') < 1)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2.0 1.0 True True", out.stderr[-2000:]

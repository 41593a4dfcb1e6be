"""Tombstones, reject accounting and the switch: the pure parts, no NIXL needed."""

from __future__ import annotations

import dataclasses
import logging

from dsv4_sm120 import settings
from dsv4_sm120.nixl import hooks
from dsv4_sm120.nixl.rejects import FrameRejected, RejectLog
from dsv4_sm120.nixl.tombstones import Tombstones


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_tombstones_expire_and_stay_bounded():
    clock = Clock()
    graves = Tombstones(capacity=3, ttl_s=10, clock=clock)
    for room in (1, 2, 3, 4):
        graves.bury(room)
    assert 1 not in graves and all(r in graves for r in (2, 3, 4))  # oldest evicted at capacity
    assert graves.evicted == 1
    clock.t = 9.9
    assert 4 in graves
    clock.t = 10.0
    assert 4 not in graves and len(graves) == 0


def test_reburying_refreshes_expiry():
    clock = Clock()
    graves = Tombstones(capacity=8, ttl_s=10, clock=clock)
    graves.bury(7)
    clock.t = 8
    graves.bury(7)
    clock.t = 15
    assert 7 in graves


def test_rejections_are_counted_and_warnings_rate_limited(caplog):
    clock = Clock()
    log = RejectLog(interval_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120.nixl"):
        for _ in range(50):
            log.reject("peer A", FrameRejected("unknown tag", "b'X'"))
        log.reject("peer B", FrameRejected("unknown tag", "b'X'"))
        clock.t = 11
        log.reject("peer A", FrameRejected("unknown tag", "b'X'"))
    assert log.snapshot()["rejected_by_reason"] == {"unknown tag": 52}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # A once, B once, A again after the interval
    assert "peer A" in lines[0] and "unknown tag" in lines[0]
    assert "49 more like it" in lines[2]


def test_switch_off_registers_no_hook(monkeypatch):
    registered = []
    monkeypatch.setattr(hooks, "hook", lambda target, fn: registered.append(target))
    hooks.register(dataclasses.replace(settings.load(), nixl_hardening=False))
    assert registered == []
    hooks.register(dataclasses.replace(settings.load(), nixl_hardening=True))
    assert f"{hooks.NIXL_MANAGER}._start_bootstrap_thread" in registered

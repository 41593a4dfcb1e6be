"""The pin check, the manifest, and the one door for hooks, in this process on the real pin."""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from dsv4_sm120 import hooks, pin, plugin


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty HookRegistry and an unregistered plugin, restored after the test."""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(plugin, "_registered", False)
    return HookRegistry._hooks


def test_installed_sglang_is_the_pin():
    assert pin.installed_sglang_version() == pin.SGLANG_PIN == "0.5.23"


def test_wrong_pin_registers_nothing_and_says_why(fresh_registry, monkeypatch, caplog):
    monkeypatch.setattr(pin, "installed_sglang_version", lambda: "0.5.22")
    monkeypatch.delenv(pin.PIN_OVERRIDE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert plugin.register() is False
    assert dict(fresh_registry) == {}
    [line] = [r.getMessage() for r in caplog.records]
    assert "0.5.22" in line and "sglang==0.5.23" in line and pin.PIN_OVERRIDE_ENV in line


def test_wrong_pin_with_override_registers_and_warns(fresh_registry, monkeypatch, caplog):
    monkeypatch.setattr(pin, "installed_sglang_version", lambda: "0.5.24")
    monkeypatch.setenv(pin.PIN_OVERRIDE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert plugin.register() is True
    assert "sglang.srt.model_loader.utils.get_model_architecture" in fresh_registry
    assert any("overridden" in r.getMessage() for r in caplog.records)


def test_register_is_idempotent(fresh_registry):
    assert plugin.register() and plugin.register()
    assert all(len(entries) == 1 for entries in fresh_registry.values())


def test_every_registered_target_is_in_the_manifest(fresh_registry):
    plugin.register()
    listed = {t.target for t in pin.MANIFEST}
    assert set(fresh_registry) <= listed


def test_hook_refuses_a_target_missing_from_the_manifest(fresh_registry):
    with pytest.raises(KeyError, match="pin.MANIFEST"):
        hooks.hook("sglang.srt.managers.scheduler.Scheduler.run_batch_not_in_the_pin", lambda *a: None)
    assert dict(fresh_registry) == {}


def test_manifest_resolves_on_the_installed_pin():
    missing = {t.target: pin.resolve(t.target) for t in pin.MANIFEST if pin.resolve(t.target)}
    assert missing == {}


def test_manifest_lists_each_symbol_once():
    targets = [t.target for t in pin.MANIFEST]
    assert len(targets) == len(set(targets))

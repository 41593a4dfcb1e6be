"""Switches: defaults, validation, and the message a bad value gets."""

from __future__ import annotations

import pytest

from dsv4_sm120 import settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for s in settings.SWITCHES:
        monkeypatch.delenv(s.env, raising=False)


def test_defaults():
    cfg = settings.load()
    assert cfg.index_k_dtype == "bf16" and cfg.index_k_select == "exact"
    assert cfg.nixl_hardening and cfg.collective_guard
    assert not cfg.index_k_checksum and not cfg.allow_pin_mismatch


def test_each_fix_has_its_own_switch(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", "fp8")
    monkeypatch.setenv("DSV4_SM120_NIXL_HARDENING", "0")
    monkeypatch.setenv("DSV4_SM120_COLLECTIVE_GUARD", "0")
    monkeypatch.setenv("DSV4_SM120_INDEX_K_CHECKSUM", "1")
    cfg = settings.load()
    assert (cfg.index_k_dtype, cfg.nixl_hardening, cfg.collective_guard, cfg.index_k_checksum) == (
        "fp8", False, False, True)


def test_bad_value_names_variable_value_and_choices(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_NIXL_HARDENING", "yes")
    with pytest.raises(settings.SettingsError) as err:
        settings.load()
    msg = str(err.value)
    assert "DSV4_SM120_NIXL_HARDENING='yes'" in msg and "0, 1" in msg and "default (1)" in msg


def test_in_force_reports_invalid_values_without_raising(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", "int4")
    assert settings.in_force()["DSV4_SM120_INDEX_K_DTYPE"].startswith("INVALID")



def test_the_selection_switch_takes_two_stage_and_refuses_anything_else(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_INDEX_K_SELECT", "two_stage")
    assert settings.load().index_k_select == "two_stage"
    monkeypatch.setenv("DSV4_SM120_INDEX_K_SELECT", "fp8")
    with pytest.raises(settings.SettingsError, match="DSV4_SM120_INDEX_K_SELECT='fp8' is not one of exact, two_stage"):
        settings.load()

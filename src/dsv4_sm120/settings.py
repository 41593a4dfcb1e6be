"""Every switch of dsv4-sm120, read from ``DSV4_SM120_*`` environment variables.

One place so that the README table, ``dsv4-sm120 doctor`` and the code agree on
names, defaults and allowed values. Each fix has its own switch; a bad value is
refused with a message naming the variable, what it got and what it accepts,
instead of silently falling back to a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    env: str
    default: str
    choices: tuple[str, ...]
    doc: str


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "DSV4_SM120_ALLOW_PIN_MISMATCH",
        "0",
        ("0", "1"),
        "1 registers the hooks even when the installed sglang is not the pin (unsupported).",
    ),
    Switch(
        "DSV4_SM120_INDEX_K_DTYPE",
        "bf16",
        ("bf16", "fp8"),
        "C4 indexer key dtype under --model-impl dsv4; fp8 is upstream's layout byte for byte.",
    ),
    Switch(
        "DSV4_SM120_INDEX_K_SELECT",
        "exact",
        ("exact", "two_stage"),
        "two_stage: long prefill chunks scan bf16 index keys at fp8 rate, then re-score each row's best 1,024 in "
        "bf16; decode always scores exactly.",
    ),
    Switch(
        "DSV4_SM120_INDEX_K_CHECKSUM",
        "0",
        ("0", "1"),
        "1 checksums each bf16 index-K page on HiCache backup / PD send and verifies it on load / receive.",
    ),
    Switch(
        "DSV4_SM120_NIXL_HARDENING",
        "1",
        ("0", "1"),
        "NIXL: reject bad bootstrap frames, tombstone aborted rooms, liveness in /health; an aborted room's decode "
        "pages stay held until its writes drained.",
    ),
    Switch(
        "DSV4_SM120_COLLECTIVE_GUARD",
        "1",
        ("0", "1"),
        "Overlap PD event loops agree on queues and batch across TP ranks each iteration (needs `dsv4-sm120 patch apply`).",
    ),
)

_BY_ENV = {s.env: s for s in SWITCHES}

# ``--model-impl`` value that selects this package (upstream declares the flag as a free string).
MODEL_IMPL = "dsv4"


def is_dsv4_impl(model_impl) -> bool:
    """True when a ServerArgs/ModelConfig ``model_impl`` value selects this package."""
    return str(getattr(model_impl, "value", model_impl)).lower() == MODEL_IMPL


class SettingsError(ValueError):
    """A DSV4_SM120_* variable holds a value the package does not accept."""


def raw(env: str) -> str:
    """The value in force for one switch, validated."""
    switch = _BY_ENV[env]
    value = os.environ.get(env, switch.default).strip()
    if value not in switch.choices:
        raise SettingsError(
            f"{env}={value!r} is not one of {', '.join(switch.choices)}; "
            f"unset it for the default ({switch.default}) or set one of those."
        )
    return value


@dataclass(frozen=True)
class Settings:
    allow_pin_mismatch: bool
    index_k_dtype: str
    index_k_select: str
    index_k_checksum: bool
    nixl_hardening: bool
    collective_guard: bool


def load() -> Settings:
    """Read and validate every switch now (call at hook time, not import time)."""
    return Settings(
        allow_pin_mismatch=raw("DSV4_SM120_ALLOW_PIN_MISMATCH") == "1",
        index_k_dtype=raw("DSV4_SM120_INDEX_K_DTYPE"),
        index_k_select=raw("DSV4_SM120_INDEX_K_SELECT"),
        index_k_checksum=raw("DSV4_SM120_INDEX_K_CHECKSUM") == "1",
        nixl_hardening=raw("DSV4_SM120_NIXL_HARDENING") == "1",
        collective_guard=raw("DSV4_SM120_COLLECTIVE_GUARD") == "1",
    )


def in_force() -> dict[str, str]:
    """Each switch's value as the environment sets it (validation errors shown as values)."""
    out = {}
    for s in SWITCHES:
        try:
            out[s.env] = raw(s.env)
        except SettingsError as exc:
            out[s.env] = f"INVALID: {exc}"
    return out

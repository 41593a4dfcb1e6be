"""The index-K switches in force for the process, and whether bf16 index keys are in force for a model.

bf16 keys need both ``--model-impl dsv4`` and ``DSV4_SM120_INDEX_K_DTYPE=bf16``
(the default). The switches are the ones ``plugin.register`` loaded, handed here
by :func:`dsv4_sm120.index_k.hooks.register`, so every decision in one process
(planner, pool, PD tag, HiCache mirror, model) sees the same values. Anything
else leaves upstream's fp8 behaviour untouched.
"""

from __future__ import annotations

from dsv4_sm120.settings import is_dsv4_impl
from dsv4_sm120.settings import Settings

_switches: Settings | None = None


def use(cfg: Settings) -> None:
    """Decide every index-K question of this process from ``cfg`` (``plugin.register``'s one load)."""
    global _switches
    _switches = cfg


def switches() -> Settings:
    """The settings this area's hooks were registered with."""
    if _switches is None:
        raise RuntimeError("dsv4-sm120's index-K hooks were not registered in this process (plugin.register)")
    return _switches


def index_k_dtype() -> str:
    """The index-K dtype the switch selects ("bf16" or "fp8")."""
    return switches().index_k_dtype


def bf16_for(model_impl) -> bool:
    """True when ``model_impl`` is dsv4 and the switch selects bf16 keys."""
    return is_dsv4_impl(model_impl) and index_k_dtype() == "bf16"


def published_model_impl():
    """``--model-impl`` of the server args this process published, or None before publish."""
    from sglang.srt.runtime_context import get_model

    try:
        return get_model().model_impl
    except ValueError:  # the runtime context is not published (tools, tests, launcher)
        return None

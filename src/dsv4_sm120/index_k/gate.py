"""Whether bf16 index keys are in force for the process or model at hand.

bf16 keys need both ``--model-impl dsv4`` and ``DSV4_SM120_INDEX_K_DTYPE=bf16``
(the default). The switch is read when a hook runs, not when the plugin
registers, so every decision in one process (planner, pool, PD tag) sees the
same environment. Anything else leaves upstream's fp8 behaviour untouched.
"""

from __future__ import annotations

from dsv4_sm120 import settings
from dsv4_sm120.model.resolve import is_dsv4_impl


def index_k_dtype() -> str:
    """The index-K dtype the switch selects ("bf16" or "fp8")."""
    return settings.load().index_k_dtype


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

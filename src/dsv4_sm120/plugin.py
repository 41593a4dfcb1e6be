"""Entry point of the ``sglang.srt.plugins`` group: ``dsv4 = dsv4_sm120.plugin:register``.

Upstream's ``load_plugins()`` calls :func:`register` once in every sglang process
(launcher, schedulers, detokenizer, ...). It must be cheap and idempotent: it
checks the pin, validates the switches, and registers hooks by dotted path;
no upstream module is imported and no hook body runs until upstream calls it.
Hooks that only matter for DeepSeek-V4 decide at call time whether
``--model-impl dsv4`` is in force; the model-independent fixes (NIXL hardening,
collective guard) are governed by their own switches.
"""

from __future__ import annotations

import importlib
import logging

from dsv4_sm120 import pin, settings

logger = logging.getLogger("dsv4_sm120")

# Each fix area owns a ``hooks`` module with ``register(settings.Settings)``.
FIX_AREAS = (
    "dsv4_sm120.model.hooks",
    "dsv4_sm120.index_k.hooks",
    "dsv4_sm120.disagg.hooks",
    "dsv4_sm120.guard.hooks",
)

_registered: bool = False


def register() -> bool:
    """Register every hook of the package once; False (and one log line) when refused."""
    global _registered
    if _registered:
        return True
    problem = pin.pin_mismatch(pin.installed_sglang_version())
    cfg = settings.load()
    if problem is not None and not cfg.allow_pin_mismatch:
        logger.warning(problem)
        return False
    if problem is not None:
        logger.warning("%s (overridden by %s=1)", problem, pin.PIN_OVERRIDE_ENV)
    for area in FIX_AREAS:
        importlib.import_module(area).register(cfg)
    _registered = True
    logger.info("dsv4-sm120: hooks registered for sglang %s", pin.installed_sglang_version())
    return True

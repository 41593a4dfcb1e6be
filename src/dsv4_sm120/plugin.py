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

from dsv4_sm120 import metrics, pin, settings
from dsv4_sm120.hooks import hook
from dsv4_sm120.model import hooks as model_hooks

logger = logging.getLogger("dsv4_sm120")

# Each fix area owns a ``hooks`` module with ``register(settings.Settings)``.
FIX_AREAS = (
    "dsv4_sm120.index_k.hooks",
    "dsv4_sm120.nixl.hooks",
    "dsv4_sm120.guard.hooks",
)

_registered: bool = False


def register() -> bool:
    """Register every hook of the package once; False (and one log line) when the pin refuses.

    A bad ``DSV4_SM120_*`` value raises :class:`settings.SettingsError` after the model
    hook is registered (see below); later calls in the same process do nothing.
    """
    global _registered
    if _registered:
        return True
    problem = pin.pin_mismatch(pin.installed_sglang_version())
    if problem is not None and settings.raw(pin.PIN_OVERRIDE_ENV) != "1":
        logger.warning(problem)
        return False
    if problem is not None:
        logger.warning("%s (overridden by %s=1)", problem, pin.PIN_OVERRIDE_ENV)
    # The model hook goes first and validates the switches itself when --model-impl dsv4
    # loads: if settings.load() below raises, upstream's load_plugins() logs our message,
    # still applies this hook, and a dsv4 launch stops with the same clear error instead
    # of silently running as --model-impl sglang.
    _registered = True
    model_hooks.register()
    hook(metrics.SCHEDULER_HOOK, metrics.enable_for_scheduler)
    cfg = settings.load()
    for area in FIX_AREAS:
        importlib.import_module(area).register(cfg)
    logger.info("dsv4-sm120: hooks registered for sglang %s", pin.installed_sglang_version())
    return True

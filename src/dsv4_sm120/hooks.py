"""Register hooks on upstream sglang through its own ``HookRegistry``.

The one door every hook of the package goes through: it refuses targets that
are not in the pin manifest (so a hook cannot exist without being resolved by
``doctor``), maps the manifest's ``how`` onto upstream's ``HookType``, and counts
each hook's own time under the manifest's ``fix`` (:mod:`dsv4_sm120.hook_time`),
so that what every fix costs a running server is on its ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable

from dsv4_sm120 import hook_time, pin


def hook(target: str, fn: Callable) -> None:
    """Register ``fn`` on ``target`` with the hook kind the manifest names for it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    touch = pin.touch_for(target)
    if touch.how not in pin.HOOK_KINDS:
        raise ValueError(f"{target} is listed as {touch.how!r}, not as a hook, in the pin manifest")
    HookRegistry.register(target, hook_time.wrap(touch.how, touch.fix, fn), HookType(touch.how))

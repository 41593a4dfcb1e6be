"""The sglang pin and the manifest of every upstream symbol this package touches.

A pin bump must fail loudly, not silently: ``dsv4-sm120 doctor`` resolves each
manifest entry on the installed sglang, and :func:`dsv4_sm120.hooks.hook`
refuses to register a target that is not listed here. Each entry says how the
package touches the symbol and which fix owns it.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from importlib import metadata

SGLANG_PIN = "0.5.23"
PIN_OVERRIDE_ENV = "DSV4_SM120_ALLOW_PIN_MISMATCH"


@dataclass(frozen=True)
class Touch:
    target: str  # dotted path on the installed sglang
    how: str  # "around", "before", "after", "replace" (HookRegistry), "subclass", "patch", "calls"
    fix: str  # model | index_k | hicache | disagg | guard
    why: str


HOOK_KINDS = ("around", "before", "after", "replace")

MANIFEST: tuple[Touch, ...] = (
    # --- model: --model-impl dsv4 ---------------------------------------------------------
    Touch(
        "sglang.srt.model_loader.utils.get_model_architecture",
        "around",
        "model",
        "--model-impl dsv4 resolves to the package's DeepSeek-V4 class; other impls pass through.",
    ),
    Touch(
        "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM",
        "subclass",
        "model",
        "The package's model class extends upstream's and swaps in the bf16 indexer.",
    ),
    Touch(
        "sglang.srt.configs.model_config.is_deepseek_v4",
        "calls",
        "model",
        "Decides whether a checkpoint is DeepSeek-V4, as upstream does.",
    ),
)


def installed_sglang_version() -> str | None:
    """The installed sglang distribution's version, or None when sglang is absent."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def pin_mismatch(version: str | None) -> str | None:
    """One line explaining why ``version`` is not the pin, or None when it is."""
    if version == SGLANG_PIN:
        return None
    found = "no sglang installed" if version is None else f"installed sglang is {version}"
    return (
        f"dsv4-sm120: {found}, but this release is pinned to sglang=={SGLANG_PIN}; "
        f"no hooks registered. Install sglang=={SGLANG_PIN}, or set {PIN_OVERRIDE_ENV}=1 "
        f"to register anyway (unsupported)."
    )


def touch_for(target: str) -> Touch:
    """The manifest entry for ``target``; KeyError names the manifest when it is missing."""
    for touch in MANIFEST:
        if touch.target == target:
            return touch
    raise KeyError(f"{target} is not in dsv4_sm120.pin.MANIFEST; list it there before touching it")


def resolve(target: str) -> str | None:
    """Import ``target`` on the installed sglang; None when it resolves, else the error."""
    try:
        pkgutil.resolve_name(target)
    except Exception as exc:  # noqa: BLE001 - any failure to resolve is the answer
        return f"{type(exc).__name__}: {exc}"
    return None

"""Hooks of the model area: resolve ``--model-impl dsv4`` to the package's class."""

from __future__ import annotations

from dsv4_sm120.hooks import hook
from dsv4_sm120.model.resolve import resolve_model_architecture


def register() -> None:
    """Always on: the hook passes through unless ``--model-impl dsv4`` is in force."""
    hook("sglang.srt.model_loader.utils.get_model_architecture", resolve_model_architecture)

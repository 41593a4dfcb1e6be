"""Hooks of the model area: resolve ``--model-impl dsv4`` to the package's class."""

from __future__ import annotations

from dsv4_sm120.hooks import hook
from dsv4_sm120.model.resolve import resolve_model_architecture
from dsv4_sm120.model.shape_warmup import offer_warmup


def register() -> None:
    """Always on: the model hook passes through unless ``--model-impl dsv4`` is in force; the warmup runs
    only where ``--warmups dsv4_shapes`` names it."""
    hook("sglang.srt.model_loader.utils.get_model_architecture", resolve_model_architecture)
    hook("sglang.srt.entrypoints.warmup.execute_warmups", offer_warmup)

"""Hooks of this fix area (filled in by its issue)."""

from __future__ import annotations

from dsv4_sm120.settings import Settings


def register(cfg: Settings) -> None:
    """Register this area's hooks when its switch allows."""

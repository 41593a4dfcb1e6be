"""What every record starts with, a benchmark's or the e2e suite's, written one way: when it ran and which commit.

The commit is ``given`` (a ``--commit`` argument) when there is one, else ``$COMMIT`` (a copy of the tree on a
GPU host may lack ``.git`` or hold a stale one, so whoever ships it passes the commit; ``COMMIT_DIRTY=1`` marks
uncommitted changes), else this checkout's ``git rev-parse HEAD``, with ``-dirty`` when tracked files differ.
Standard library only: the air-gap tool's bare-Python steps import it too.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNKNOWN = "unknown (no git checkout here: pass --commit or COMMIT)"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def checkout() -> tuple[str | None, bool]:
    """This checkout's HEAD (None outside one) and whether its tracked files differ from it."""
    head = _git("rev-parse", "HEAD") or None
    return head, bool(head and _git("status", "--porcelain", "--untracked-files=no"))


def commit(given: str | None = None) -> str:
    """The commit a record names (see the module doc)."""
    if given:
        return given
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"] + ("-dirty" if os.environ.get("COMMIT_DIRTY") == "1" else "")
    head, dirty = checkout()
    return (head + ("-dirty" if dirty else "")) if head else UNKNOWN


def now_utc() -> str:
    """The record's date: UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write(path: Path | None, record: dict) -> None:
    """``record`` as indented JSON at ``path`` (its folder made; a value JSON lacks is written as its str), and a
    line saying so; nothing without a path."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")

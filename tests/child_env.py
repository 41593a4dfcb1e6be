"""The environment of a fresh interpreter that a test starts and that imports the suite's own modules."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repository root first on ``PYTHONPATH``, so that the child's
    ``import tests...`` finds this checkout's suite (in a mutation run, the mutated copy's), whatever its cwd."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env

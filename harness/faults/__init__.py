"""Test-only sglang plugins that a benchmark or a test loads into a server by putting this folder first on the
server's ``PYTHONPATH`` (:func:`pythonpath`): ``dsv4_test_faults`` (its doc names the faults) and its dist-info,
which registers it in the ``sglang.srt.plugins`` group. Nothing here is in the wheel."""

from __future__ import annotations

import os
from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent


def pythonpath() -> str:
    """``PYTHONPATH`` for a server that loads the faults: this folder, then this process's ``PYTHONPATH``."""
    return f"{FAULTS_DIR}:{os.environ.get('PYTHONPATH', '')}"

"""The mutation table goes to the end of the pytest report (``pytest -q`` hides test output)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mutation_engine  # noqa: E402

ROWS: list = []


def pytest_terminal_summary(terminalreporter):
    if ROWS:
        terminalreporter.section("dsv4-sm120 mutations")
        terminalreporter.write_line(mutation_engine.table(ROWS))

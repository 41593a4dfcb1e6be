"""The mutation table goes to the end of the pytest report (``pytest -q`` hides test output)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mutation_engine  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if mutation_engine.ROWS:
        terminalreporter.section("dsv4-sm120 mutations")
        terminalreporter.write_line(mutation_engine.table(mutation_engine.ROWS))

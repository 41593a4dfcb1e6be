"""The mutation table goes to the end of the pytest report (``pytest -q`` hides test output)."""

from __future__ import annotations

from tests.mutations import mutation_engine


def pytest_terminal_summary(terminalreporter):
    if mutation_engine.ROWS:
        terminalreporter.section("dsv4-sm120 mutations")
        terminalreporter.write_line(mutation_engine.table(mutation_engine.ROWS))

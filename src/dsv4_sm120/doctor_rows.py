"""The doctor's row types: what a fix area's ``report.doctor_section`` returns.

They live apart from :mod:`dsv4_sm120.doctor` so that a fix area can describe itself without importing the
doctor, which imports the model, which imports the fix areas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Row:
    """One line of the doctor's screen: ``ok``, ``warn`` (works, with a limitation the user should know) or
    ``fail`` (this install will not do what the package promises)."""

    name: str
    status: str
    detail: str


@dataclass
class Section:
    """One check: a JSON-able ``data`` dict (for ``--json``) and its rows."""

    key: str
    data: dict
    rows: list[Row] = field(default_factory=list)

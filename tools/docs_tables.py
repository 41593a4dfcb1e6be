"""Writes the switch and metric tables of docs/operating.md from the package's own tables; ``--check`` only compares.

The switches come from :data:`dsv4_sm120.settings.SWITCHES` and the metrics from
:data:`dsv4_sm120.metrics.SPECS`, read by importing those modules (neither imports sglang). Each table sits
between two marker comments in the page (``<!-- switches:begin -->`` ... ``<!-- switches:end -->``, the same
for ``metrics``); the text outside the markers is left as it is.

Run from the repository root: ``python -m tools.docs_tables`` rewrites the tables, ``python -m tools.docs_tables
--check`` exits 1 and names each stale table when the committed page differs from what the modules give.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from dsv4_sm120 import metrics, settings

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "operating.md"
PREFIX = "sglang:dsv4_"
MAX_WORDS = 25  # the switch table's "what it does" cell
# The labels every series carries (metrics.enable adds them before a spec's own).
COMMON_LABELS = ("tp_rank",)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def short(text: str, limit: int = MAX_WORDS) -> str:
    """``text`` if it has at most ``limit`` words; else its longest lead ending at a clause or sentence end within
    the limit; else its first ``limit`` words and an ellipsis."""
    words = text.split()
    if len(words) <= limit:
        return text.strip()
    lead = " ".join(words[:limit])
    cut = max(lead.rfind(". "), lead.rfind("; "))
    if cut > 0:
        return lead[: cut + 1]
    return lead.rstrip(",;:") + " …"


def switches_table() -> str:
    """One row per ``DSV4_SM120_*`` switch: name, default, accepted values, what it does."""
    rows = ["| switch | default | values | what it does |", "| --- | --- | --- | --- |"]
    for s in settings.SWITCHES:
        values = ", ".join(f"`{v}`" for v in s.choices)
        rows.append(f"| `{s.env}` | `{s.default}` | {values} | {_cell(short(s.doc))} |")
    return "\n".join(rows)


def metric_name(name: str) -> str:
    """The name a spec has on ``/metrics`` (counters keep their ``_total``), as :func:`metrics.exposed_names`."""
    return f"{PREFIX}{name}"


def metrics_table() -> str:
    """One row per ``sglang:dsv4_*`` series: full name, type, labels, meaning."""
    exposed = metrics.exposed_names()
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for name, spec in metrics.SPECS.items():
        kind, doc, labels = spec[:3]
        full = metric_name(name)
        if full not in exposed:
            raise ValueError(f"{full} is not among metrics.exposed_names()")
        label_text = ", ".join(f"`{label}`" for label in (*COMMON_LABELS, *labels))
        rows.append(f"| `{full}` | {kind} | {label_text} | {_cell(doc)} |")
    return "\n".join(rows)


TABLES = {"switches": switches_table, "metrics": metrics_table}


def _block(key: str) -> re.Pattern:
    return re.compile(rf"(<!-- {key}:begin -->\n)(.*?)(<!-- {key}:end -->)", re.S)


def stale_tables(text: str) -> list[str]:
    """The keys of :data:`TABLES` whose block in ``text`` is missing or differs from what the modules give."""
    stale = []
    for key, make in TABLES.items():
        found = _block(key).search(text)
        if found is None or found.group(2) != make() + "\n":
            stale.append(key)
    return stale


def render(text: str) -> str:
    """``text`` with every table block replaced by the table the modules give; a missing marker pair is an error."""
    for key, make in TABLES.items():
        pattern = _block(key)
        if pattern.search(text) is None:
            raise ValueError(f"no <!-- {key}:begin --> ... <!-- {key}:end --> block in the page")
        table = make()
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(3), text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_tables", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed page; exit 1 naming each stale table")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    stale = stale_tables(text)
    if args.check:
        for key in stale:
            print(f"{PAGE.relative_to(REPO)}: the {key} table is stale or its markers are missing", file=sys.stderr)
        if stale:
            print("run python -m tools.docs_tables", file=sys.stderr)
        return 1 if stale else 0
    page = render(text)
    if page != text:
        PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())

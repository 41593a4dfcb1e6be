"""Writes bench/results/README.md from each topic's ``headlines.csv``; ``--check`` only compares.

Run from the repository root: ``python -m bench.results_page`` rewrites the page, ``python -m bench.results_page
--check`` exits 1 and prints the difference when the committed page is not what the CSVs give.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = RESULTS / "README.md"
CSV_NAME = "headlines.csv"
COLUMNS = ("figure", "value", "spread", "baseline", "device", "date", "commit", "record")

INTRO = """\
# bench/results

The current headline figures of the runs under `bench/`, one table a topic folder, each row read from the
JSON record it names (the record holds the run's date, device, commit, versions and every figure it took).
A row's `spread` is the min-max of rounds or pairs, or the interval the record gives; `baseline` is what the
figure is held against.

This page is generated from `<topic>/headlines.csv` by `python -m bench.results_page` (`--check` says
whether it is stale): edit the CSVs, then run it. Superseded records, repeat runs and most log archives are
in git history only: `git log --diff-filter=D --stat -- bench/results/` lists each removed file and the
commit that removed it, and `git show <commit>:<path>` prints it from a commit that still held it. Files
here without a row are the inputs of `bench/tests/gpu_server/test_compose.py` and the logs of the `abort_safety`
runs. `serving/` is where `dsv4-sm120 bench-serving` writes your own runs; nothing there is committed.
"""


def read_rows(csv_path: Path) -> list[dict[str, str]]:
    """The rows of one topic's CSV; a header other than COLUMNS is an error."""
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{csv_path}: header {reader.fieldnames}, expected {list(COLUMNS)}")
        return list(reader)


def topic_csvs() -> list[Path]:
    return sorted(RESULTS.glob(f"*/{CSV_NAME}"))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(row: dict[str, str]) -> str:
    """A table row; the record as a link relative to the page (a record path starts with bench/results/)."""
    record = Path(row["record"])
    cells = [_cell(row[name]) for name in COLUMNS[:-1]]
    cells.append(f"[{record.name}]({record.relative_to('bench/results')})")
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    """The whole page: the intro, then per topic folder a table of its CSV's rows."""
    parts = [INTRO]
    for csv_path in topic_csvs():
        table = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        table += [_row(row) for row in read_rows(csv_path)]
        parts.append(f"## {csv_path.parent.name}/\n\n" + "\n".join(table) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.results_page", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed page; exit 1 if it differs")
    args = parser.parse_args(argv)
    page = render()
    if not args.check:
        PAGE.write_text(page)
        return 0
    committed = PAGE.read_text() if PAGE.exists() else ""
    if committed == page:
        return 0
    diff = difflib.unified_diff(committed.splitlines(keepends=True), page.splitlines(keepends=True),
                                "bench/results/README.md (committed)", "bench/results/README.md (from the CSVs)")
    sys.stdout.writelines(diff)
    print("bench/results/README.md is stale: run python -m bench.results_page", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

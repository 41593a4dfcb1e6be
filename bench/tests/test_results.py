"""bench/results stays readable and small: its page is what the topics' CSVs give, every CSV row names a record
that is there, and the folder stays within its budget.

Why: bench/results/README.md is generated from each topic's headlines.csv (``bench.results_page``); a CSV
edited without regenerating the page, a row naming a record that is gone, or the folder growing past its
budget fails here. Pure file checks, well under a second.
"""

from __future__ import annotations

import csv
from pathlib import Path

from bench import results_page

REPO = Path(__file__).resolve().parents[2]
RESULTS = results_page.RESULTS
# Run outputs the folder does not hold: where a user's own serving runs are written.
WRITTEN_AT_RUN_TIME = RESULTS / "serving"
MAX_RESULT_FILES = 40
MAX_RESULT_BYTES = 5 * 1024 * 1024


def _written_at_run_time(path: Path) -> bool:
    return path == WRITTEN_AT_RUN_TIME or WRITTEN_AT_RUN_TIME in path.parents


def test_the_results_page_is_what_the_csvs_give():
    assert results_page.PAGE.read_text() == results_page.render(), \
        "bench/results/README.md is stale: python -m bench.results_page"


def test_every_topic_has_a_headlines_csv_with_the_columns_and_existing_records():
    topics = sorted(p for p in RESULTS.iterdir() if p.is_dir() and not _written_at_run_time(p))
    assert topics, "bench/results has no topic folder"
    header = ",".join(results_page.COLUMNS)
    for topic in topics:
        table = topic / results_page.CSV_NAME
        assert table.is_file(), f"bench/results/{topic.name}/ has no {results_page.CSV_NAME}"
        with table.open(newline="") as f:
            assert f.readline().rstrip("\n") == header, f"{table.relative_to(REPO)}: not the header {header}"
            missing = [row["record"] for row in csv.DictReader(f, fieldnames=results_page.COLUMNS)
                       if not (REPO / row["record"]).is_file()]
        assert not missing, f"{table.relative_to(REPO)} names records that do not exist: {missing}"
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p != results_page.PAGE]
    assert not loose, f"result files outside a topic folder: {loose}"


def test_bench_results_stays_within_its_budget():
    files = [p for p in RESULTS.rglob("*") if p.is_file() and not _written_at_run_time(p)]
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= MAX_RESULT_FILES, f"bench/results holds {len(files)} files, more than {MAX_RESULT_FILES}"
    assert size <= MAX_RESULT_BYTES, f"bench/results holds {size / 2**20:.1f} MiB, more than {MAX_RESULT_BYTES / 2**20:.0f}"

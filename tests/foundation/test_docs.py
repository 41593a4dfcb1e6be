"""The README and docs/ point only at what exists, and name every switch and every metric.

Why: the README is an operator's front page and docs/ holds the evidence behind it. A result file moved
or renamed, a switch added to settings.py or a collector added to metrics.py must fail here, not leave a
document citing nothing or silent about a knob. bench/results/README.md counts as a document here; that it
is what the topics' CSVs give, and the folder's budget, are bench's own tests (``bench/tests/test_results.py``).
Pure text checks (and git, for a path cited as it was at a commit) plus two modules of the package
(``settings``, ``metrics``) that import no sglang, so this runs in well under a second.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv4_sm120 import metrics, settings

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
INDEX = REPO / "bench" / "results" / "README.md"
RESULTS = REPO / "bench" / "results"

# A repository path as the documents write it: from a top-level folder, not inside another path.
PATH = re.compile(r"(?<![\w./$-])((?:src|tests|bench|tools|harness|docs|patches|\.ci)/[\w./*{},<>$-]*)")
# "git show 11c877e:bench/decode_latency_h200.py": a path as it was at a commit, in history and not the tree.
AT_COMMIT = re.compile(r"(?<![\w./-])([0-9a-f]{7,40}):((?:src|tests|bench|tools|harness|docs|patches|\.ci)/[\w./-]*[\w/])")
# "..._tune_5f3f1cc.json": a result file named by its tail, next to a full path of the same family.
TAIL = re.compile(r"\.\.\._([\w.*-]+\.(?:json|txt|log))")
# Run outputs a document describes but the repository does not hold: a user's own serving runs.
WRITTEN_AT_RUN_TIME = ("bench/results/serving/",)
METRIC = re.compile(r"sglang:dsv4_\w+(?![\w<])")


def _cited_docs() -> list[Path]:
    return [README, *DOCS, INDEX]


def _expand(path: str) -> list[str]:
    """``a_{x,y}.json`` -> both names; a path with a placeholder (``<date>``, ``$(date ...)``, ``DATE``) is where a
    run writes -> its folder."""
    path = path.rstrip(".,;:)")
    if re.search(r"[<$]|DATE", path):
        path = re.split(r"[<$]|DATE", path)[0].rpartition("/")[0] + "/"
    parts = re.split(r"\{([^{}]*)\}", path)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return ["".join(itertools.chain.from_iterable(itertools.zip_longest(fixed, pick, fillvalue="")))
            for pick in itertools.product(*choices)]


def _exists(pattern: str) -> bool:
    if any(ch in pattern for ch in "*?["):
        return any(REPO.glob(pattern))
    return (REPO / pattern).exists()


def cited_paths(text: str) -> set[str]:
    """Every repository path a document cites in the tree, braces expanded."""
    return {p for raw in PATH.findall(AT_COMMIT.sub("", text)) for p in _expand(raw)
            if not p.startswith(WRITTEN_AT_RUN_TIME) and p.rstrip("/") not in {"bench/results", ""}}


def test_every_cited_path_exists():
    missing = [f"{doc.relative_to(REPO)}: {p}" for doc in _cited_docs() for p in sorted(cited_paths(doc.read_text()))
               if not _exists(p)]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def _in_git(obj: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", obj], capture_output=True).returncode == 0


def test_every_path_cited_at_a_commit_is_there():
    """Where the checkout holds the commit (a shallow clone may not), the path was in it."""
    if shutil.which("git") is None:
        pytest.skip("no git here to read history with")
    missing = [f"{doc.relative_to(REPO)}: {commit}:{path}" for doc in _cited_docs()
               for commit, path in sorted(set(AT_COMMIT.findall(doc.read_text())))
               if _in_git(f"{commit}^{{commit}}") and not _in_git(f"{commit}:{path}")]
    assert not missing, "cited at a commit that does not hold it:\n" + "\n".join(missing)


def test_every_result_file_named_by_its_tail_exists():
    results = [p.name for p in RESULTS.rglob("*") if p.is_file()]
    missing = [f"{doc.relative_to(REPO)}: ..._{tail}" for doc in _cited_docs() for tail in TAIL.findall(doc.read_text())
               if not any(Path(name).match(f"*_{tail}") for name in results)]
    assert not missing, "no file in bench/results ends so:\n" + "\n".join(missing)


def test_the_readme_links_every_document():
    readme = README.read_text()
    details = readme.split("\n## Details\n", 1)[1]
    unlinked = [doc.name for doc in DOCS if f"`docs/{doc.name}`" not in details]
    assert not unlinked, f"docs not linked from the README's Details: {unlinked}"


def test_the_readme_switch_table_has_every_switch_with_its_default():
    rows = {line.split("|")[1].strip(): line for line in README.read_text().splitlines() if line.startswith("| `DSV4_SM120_")}
    for switch in settings.SWITCHES:
        row = rows.get(f"`{switch.env}`")
        assert row, f"{switch.env} is missing from the README's switches table"
        assert row.split("|")[2].strip() == f"`{switch.default}`", f"{switch.env}: the README's default is not {switch.default}"
    assert set(rows) == {f"`{s.env}`" for s in settings.SWITCHES}, "the README's table names a switch settings.py lacks"


def test_every_metric_is_named_in_the_readme_or_a_linked_doc():
    readme = README.read_text()
    linked = [doc for doc in DOCS if f"docs/{doc.name}" in readme]
    named = set(METRIC.findall(readme)).union(*(METRIC.findall(doc.read_text()) for doc in linked))
    exposed = metrics.exposed_names()
    assert exposed <= named, f"on /metrics but named in no document: {sorted(exposed - named)}"
    assert named <= exposed, f"named in a document but not a collector: {sorted(named - exposed)}"


def test_the_readme_and_the_docs_stay_short():
    """An operator reads the README in a screen or two and the docs in one sitting: at most 700 and 15,000 words."""
    words = lambda path: len(path.read_text().split())  # noqa: E731
    assert words(README) <= 700
    assert sum(words(doc) for doc in (REPO / "docs").rglob("*.md")) <= 15_000

"""Apply named mutations to copies of the working tree and run the tests that must catch them.

Nothing here writes to the checkout. The working tree (tracked files plus untracked files
git does not ignore, as they are now) is copied once into a temporary directory; each
mutation gets its own copy of that copy, its edits are applied there, and only its listed
tests run, in a child of the fork server (:mod:`zygote`) with the copy's ``src``, then its root
(the suite's ``tests`` package), first on the import path and ``PYTHONPATH``. A mutation is
*caught* when at least one listed test fails (or the tests run past the mutation's time limit:
a hang is a failure in CI); it *survives* when all listed tests pass. A mutation whose text is no longer in the source is an error
that names it: the source drifted and the catalog must follow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly")
ROWS: list = []  # rows of the pytest run, printed by conftest.py at the end of the report


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in ``path`` (repo-relative); ``old`` must occur exactly ``count`` times."""

    path: str
    old: str
    new: str
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    covers: str  # the fix, switch branch or issue item this pins
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids that must fail (at least one) under the mutation
    timeout_s: float = 150.0
    e2e_only: bool = False  # caught only by tests/e2e (real servers): run with --e2e / -m e2e
    env: tuple[tuple[str, str], ...] = ()
    # Set when the mutated module is imported only by processes the test spawns.
    imported_in_subprocess: bool = False


class MutationError(RuntimeError):
    """The catalog no longer matches the source, or the run cannot be trusted."""


def mutated_text(edit: Edit, text: str, name: str) -> str:
    found = text.count(edit.old)
    if found != edit.count:
        raise MutationError(
            f"mutation {name!r} no longer applies: {edit.path} holds its text {found} time(s), expected "
            f"{edit.count}; the source drifted, update tests/mutations/mutation_catalog.py.\n  text: {edit.old!r}"
        )
    return text.replace(edit.old, edit.new)


def check_applies(mutation: Mutation, root: Path = REPO) -> None:
    """Raise :class:`MutationError` unless every edit applies to ``root`` and leaves valid Python."""
    texts: dict[str, str] = {}
    for edit in mutation.edits:
        path = root / edit.path
        if not edit.path.startswith("src/dsv4_sm120/"):
            raise MutationError(f"mutation {mutation.name!r} edits {edit.path}: only the package's own code")
        if not path.is_file():
            raise MutationError(f"mutation {mutation.name!r}: {edit.path} does not exist (source moved?)")
        texts[edit.path] = mutated_text(edit, texts.get(edit.path, path.read_text()), mutation.name)
    for rel, text in texts.items():
        if rel.endswith(".py"):
            try:
                compile(text, rel, "exec")
            except SyntaxError as exc:
                raise MutationError(f"mutation {mutation.name!r} leaves {rel} unparsable: {exc}") from None
        if texts[rel] == (root / rel).read_text():
            raise MutationError(f"mutation {mutation.name!r} changes nothing in {rel}")


def module_of(path: str) -> str:
    rel = Path(path).relative_to("src").with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def snapshot_tree(dest: Path) -> None:
    """Copy the working tree as it is now (tracked and unignored untracked files) to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if not src.is_file() or rel.startswith("tests/mutations/") and rel.endswith(".log"):
            continue  # deleted in the work tree but still in the index
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


@dataclasses.dataclass
class Row:
    name: str
    tests: tuple[str, ...]
    result: str  # caught / survived / error / passed (baseline)
    seconds: float
    detail: str = ""


class Runner:
    """A snapshot of the tree and a fork server; run :meth:`baseline` and :meth:`mutate`."""

    def __init__(self, workdir: Path | None = None, keep: bool = False):
        self.own_tmp = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="dsv4-mutations-"))
        self.keep = keep
        self.base = self.workdir / "base"
        snapshot_tree(self.base)
        self.rows: list[Row] = []
        self._zygote = None
        self._count = 0

    # -- fork server -------------------------------------------------------------------------
    def _server(self):
        if self._zygote is None:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            self._zygote = subprocess.Popen(
                [sys.executable, str(self.base / "tests" / "mutations" / "zygote.py")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=self.workdir, env=env,
            )
            ready = json.loads(self._zygote.stdout.readline() or '{"ready": false}')
            if not ready.get("ready"):
                raise MutationError("the mutation fork server did not start")
            self.preload = ready
        return self._zygote

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.stdin.close()
            self._zygote.wait(30)
            self._zygote = None
        if self.own_tmp and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _job(self, root: Path, tests, timeout_s: float, env=()) -> tuple[dict, dict, str]:
        self._count += 1
        log = self.workdir / f"job{self._count}.log"
        report = self.workdir / f"job{self._count}.json"
        job = {
            "root": str(root), "log": str(log), "report": str(report), "timeout_s": timeout_s + 10,
            "args": [*PYTEST_ARGS, "-o", f"timeout={int(timeout_s)}", *tests], "env": dict(env),
        }
        server = self._server()
        server.stdin.write(json.dumps(job) + "\n")
        server.stdin.flush()
        result = json.loads(server.stdout.readline())
        data = json.loads(report.read_text()) if report.exists() else {}
        return result, data, log.read_text(errors="replace") if log.exists() else ""

    @staticmethod
    def _check_origin(root: Path, data: dict, mutation: Mutation | None) -> str | None:
        """Why the run cannot be trusted (code imported from outside the copy), or None."""
        origin = data.get("package_origin") or ""
        if not origin.startswith(str(root)):
            return f"dsv4_sm120 resolved to {origin}, not the copy {root}"
        strays = {n: f for n, f in data.get("modules", {}).items() if f and not f.startswith(str(root))}
        if strays:
            return f"modules imported from outside the copy: {sorted(strays)[:3]}"
        return None

    @staticmethod
    def _unseen(data: dict, mutation: Mutation) -> list[str]:
        """Mutated modules the pytest process never imported (a subprocess it spawned may have)."""
        wanted = {module_of(e.path) for e in mutation.edits if e.path.endswith(".py")}
        return sorted(wanted - set(data.get("modules", {})))

    # -- runs --------------------------------------------------------------------------------
    def baseline(self, mutations) -> Row:
        """Every listed test passes on the unmutated copy (else 'caught' would mean nothing)."""
        tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        result, data, log = self._job(self.base, tests, timeout_s=900)
        why = self._check_origin(self.base, data, None)
        if why or result["exit"] != 0 or result["timed_out"]:
            detail = why or f"pytest exit {result['exit']}; failed: {data.get('failed')}\n{log[-3000:]}"
            row = Row("(baseline: no mutation)", tests, "error", result["seconds"], detail)
        else:
            row = Row("(baseline: no mutation)", tests, "passed", result["seconds"], f"{len(data['passed'])} passed")
        self.rows.append(row)
        return row

    def mutate(self, mutation: Mutation) -> Row:
        start = time.monotonic()
        root = self.workdir / mutation.name
        try:
            check_applies(mutation, self.base)
            shutil.copytree(self.base, root)
            texts: dict[str, str] = {}
            for edit in mutation.edits:
                texts[edit.path] = mutated_text(edit, texts.get(edit.path, (root / edit.path).read_text()),
                                                mutation.name)
            for rel, text in texts.items():
                (root / rel).write_text(text)
        except MutationError as exc:
            row = Row(mutation.name, mutation.tests, "error", round(time.monotonic() - start, 1), str(exc))
            self.rows.append(row)
            return row
        result, data, log = self._job(root, mutation.tests, mutation.timeout_s, mutation.env)
        why = self._check_origin(root, data, mutation)
        seconds = result["seconds"]
        if result["timed_out"]:
            row = Row(mutation.name, mutation.tests, "caught", seconds, f"timed out after {mutation.timeout_s:.0f} s")
        elif why:
            row = Row(mutation.name, mutation.tests, "error", seconds, why)
        elif result["exit"] in (1, 2) and data.get("failed"):
            row = Row(mutation.name, mutation.tests, "caught", seconds, data["failed"][0])
        elif result["exit"] == 0:
            unseen = self._unseen(data, mutation)
            note = f"; the pytest process never imported {unseen}" if unseen and not mutation.imported_in_subprocess else ""
            row = Row(mutation.name, mutation.tests, "survived", seconds,
                      f"{len(data.get('passed', []))} listed test(s) passed{note}")
        else:
            row = Row(mutation.name, mutation.tests, "error", seconds,
                      f"pytest exit {result['exit']} ({data.get('error', '')}); log tail:\n{log[-2000:]}")
        self.rows.append(row)
        if not self.keep:
            shutil.rmtree(root, ignore_errors=True)
        return row


def table(rows: list[Row]) -> str:
    width = max([len(r.name) for r in rows] + [8])
    lines = [f"{'mutation':<{width}}  {'tests':>5}  {'result':<8}  {'seconds':>7}  detail"]
    for r in rows:
        detail = r.detail.splitlines()[0] if r.detail else ""
        lines.append(f"{r.name:<{width}}  {len(r.tests):>5}  {r.result:<8}  {r.seconds:>7.1f}  {detail[:110]}")
    mutated = [r for r in rows if not r.name.startswith("(")]
    caught = sum(r.result == "caught" for r in mutated)
    lines.append(f"{caught}/{len(mutated)} mutations caught; {sum(r.seconds for r in rows):.0f} s in all")
    return "\n".join(lines)

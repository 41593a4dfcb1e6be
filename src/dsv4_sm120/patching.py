"""``dsv4-sm120 patch apply|check|revert``: the diffs in ``patches/`` on an sglang tree.

Why patches at all: the overlap PD loops decide inside their loop body which
collectives an iteration issues, and no HookRegistry hook reaches a loop body
(see ``docs/collective_guard.md``). The diffs are against the pinned
sglang's files and are applied strictly: every hunk's context must match at
its recorded line, with no fuzz, so a different sglang is refused rather than
patched in the wrong place. Each file is written whole to a temporary file
beside it and renamed over the original, so a file is never half-applied;
every file is checked before any is written. Applying twice or reverting an
unpatched tree changes nothing. Revert restores the original bytes exactly.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsv4_sm120 import pin
from dsv4_sm120.doctor_rows import FAIL, OK, WARN, Row, Section

PATCHES_DIR = Path(__file__).parent / "patches"
APPLIED, PRISTINE, CONFLICT, MISSING = "applied", "not applied", "conflict", "missing"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A patch cannot be applied or reverted on this sglang tree; the message says why and what to do."""


@dataclass(frozen=True)
class Hunk:
    old_start: int
    new_start: int
    lines: tuple[str, ...]  # each starts with " ", "-" or "+", and keeps its newline

    def side(self, new: bool) -> list[str]:
        keep = "+" if new else "-"
        return [line[1:] for line in self.lines if line[0] in (" ", keep)]


@dataclass(frozen=True)
class FilePatch:
    name: str  # the .diff file's name
    target: str  # path relative to the directory that contains the ``sglang`` package
    hunks: tuple[Hunk, ...]


def parse(path: Path) -> FilePatch:
    """Read one unified diff touching one file."""
    target, hunks, current = None, [], None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("+++ "):
            target = line[4:].strip().split("\t")[0].removeprefix("b/")
        elif line.startswith("--- "):
            continue
        elif (m := _HUNK.match(line)) is not None:
            current = []
            hunks.append((int(m.group(1)), int(m.group(3)), current))
        elif current is not None and line[:1] in (" ", "-", "+"):
            current.append(line)
        elif current is not None and line.rstrip("\n") == "":  # blank context line written without its space
            current.append(" \n")
    if target is None or not hunks:
        raise PatchError(f"{path} is not a unified diff of one file (no +++ header or no hunk)")
    return FilePatch(path.name, target, tuple(Hunk(o, n, tuple(ls)) for o, n, ls in hunks))


def patches() -> list[FilePatch]:
    return [parse(p) for p in sorted(PATCHES_DIR.glob("*.diff"))]


def transform(text: str, fp: FilePatch, reverse: bool) -> str | None:
    """``text`` with every hunk applied (or reverted); None unless each hunk matches exactly where recorded."""
    lines = text.splitlines(keepends=True)
    out, pos = [], 0
    for h in fp.hunks:
        before, after = h.side(new=reverse), h.side(new=not reverse)
        start = (h.new_start if reverse else h.old_start) - 1
        if not before:  # pure insertion: the recorded line is the one before it
            start += 1
        if start < pos or lines[start:start + len(before)] != before:
            return None
        out += lines[pos:start] + after
        pos = start + len(before)
    return "".join(out + lines[pos:])


def installed_root() -> Path:
    """The directory holding the installed ``sglang`` package (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"sglang is not installed: pip install sglang=={pin.SGLANG_PIN}")
    return Path(list(spec.submodule_search_locations)[0]).parent


def state(root: Path, fp: FilePatch) -> str:
    path = root / fp.target
    if not path.is_file():
        return MISSING
    text = path.read_text()
    if transform(text, fp, reverse=True) is not None:
        return APPLIED
    if transform(text, fp, reverse=False) is not None:
        return PRISTINE
    return CONFLICT


def _refuse_other_pin(root: Path, explicit_root: bool) -> None:
    if explicit_root:
        return  # a copy: its content is the check
    problem = pin.pin_mismatch(pin.installed_sglang_version())
    if problem is not None:
        raise PatchError(
            f"refusing to patch: {problem.split('; ')[0]}. The diffs in {PATCHES_DIR} are for "
            f"sglang=={pin.SGLANG_PIN} only; install that version, or use the dsv4-sm120 release "
            f"made for your sglang."
        )


def _conflict_message(root: Path, fp: FilePatch) -> str:
    return (
        f"{root / fp.target} matches neither pristine sglang=={pin.SGLANG_PIN} nor its patched form "
        f"({fp.name}): it was modified locally or belongs to another sglang version. Reinstall "
        f"sglang=={pin.SGLANG_PIN} (pip install --force-reinstall --no-deps sglang=={pin.SGLANG_PIN}) and retry."
    )


def _write_atomically(path: Path, text: str) -> None:
    mode = path.stat().st_mode
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".dsv4tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def change(root: Path, reverse: bool, explicit_root: bool = False) -> list[tuple[FilePatch, str]]:
    """Apply (or revert) every patch; returns (patch, what happened). Checks all files before writing any."""
    _refuse_other_pin(root, explicit_root)
    done_state = PRISTINE if reverse else APPLIED
    plan = []
    for fp in patches():
        st = state(root, fp)
        if st == MISSING:
            raise PatchError(f"{root / fp.target} does not exist: is {root} the directory that contains the sglang package?")
        if st == CONFLICT:
            raise PatchError(_conflict_message(root, fp))
        plan.append((fp, st))
    report = []
    for fp, st in plan:
        if st == done_state:
            report.append((fp, f"already {done_state}"))
            continue
        path = root / fp.target
        _write_atomically(path, transform(path.read_text(), fp, reverse=reverse))
        report.append((fp, "reverted" if reverse else "applied"))
    return report


def applied_in_process() -> bool | None:
    """Whether the sglang modules loaded in this process carry the guard call (None: not loaded yet)."""
    import sys

    mods = [sys.modules.get(f"sglang.srt.disaggregation.{m}") for m in ("prefill", "decode")]
    if any(m is None for m in mods):
        return None
    return all(hasattr(m, "_dsv4_collective_guard") for m in mods)


def doctor_section():
    """``doctor``: state of each patch on the installed sglang."""
    try:
        root = installed_root()
    except PatchError as exc:
        return Section("patches", {"error": str(exc)}, [Row("patches", FAIL, str(exc))])
    data, rows = {"sglang_root": str(root)}, []
    for fp in patches():
        st = state(root, fp)
        data[fp.name] = st
        if st == APPLIED:
            rows.append(Row(f"patch {fp.name}", OK, "applied"))
        elif st == PRISTINE:
            rows.append(Row(f"patch {fp.name}", WARN,
                            "not applied: the PD collective guard is inactive; run `dsv4-sm120 patch apply`"))
        else:
            rows.append(Row(f"patch {fp.name}", FAIL, _conflict_message(root, fp) if st == CONFLICT
                            else f"{root / fp.target} missing"))
    return Section("patches", data, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``patch``."""
    parser.add_argument("action", choices=("apply", "check", "revert"),
                        help="apply/revert the diffs; check: exit 0 when every diff is applied or applies cleanly")
    parser.add_argument("--sglang-root", type=Path, default=None,
                        help="directory that contains the sglang package (default: the installed one)")
    parser.add_argument("--require-applied", action="store_true", help="check: also fail when a diff is not applied")


def run(args: argparse.Namespace) -> int:
    """``patch``: exit 0 on success, 1 with a message saying what to do otherwise."""
    explicit = args.sglang_root is not None
    try:
        root = args.sglang_root.resolve() if explicit else installed_root()
        if args.action == "check":
            _refuse_other_pin(root, explicit)
            bad = 0
            for fp in patches():
                st = state(root, fp)
                ok = st == APPLIED or (st == PRISTINE and not args.require_applied)
                bad += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {fp.name}: {st} ({root / fp.target})")
                if st == CONFLICT:
                    print(f"     {_conflict_message(root, fp)}")
            return 1 if bad else 0
        for fp, what in change(root, reverse=args.action == "revert", explicit_root=explicit):
            print(f"{fp.name}: {what} ({root / fp.target})")
        return 0
    except PatchError as exc:
        print(f"dsv4-sm120 patch {args.action}: {exc}")
        return 1

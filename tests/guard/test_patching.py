"""``dsv4-sm120 patch apply|check|revert``: strict, idempotent, atomic, byte-identical revert.

These run on a COPY of the pinned files (``--sglang-root``) so the shared venv is never modified, and
start from the pristine pin whether or not ``patch apply`` was run on the venv (``pristine``);
``check`` also runs on the installed sglang itself, as CI does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import pristine
from dsv4_sm120 import patching, pin

FILES = pristine.FILES


@pytest.fixture
def copy_root(tmp_path) -> Path:
    return pristine.pristine_tree(tmp_path / "pristine")


def _bytes(root: Path) -> dict:
    return {name: (root / "sglang/srt/disaggregation" / name).read_bytes() for name in FILES}


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.cli", "patch", *args], capture_output=True, text=True)


def test_patches_ship_with_the_package_and_the_repo_link():
    names = sorted(p.name for p in patching.PATCHES_DIR.glob("*.diff"))
    assert names == ["collective_guard_decode.diff", "collective_guard_prefill.diff"]
    repo_link = Path(__file__).resolve().parents[2] / "patches"
    assert repo_link.is_symlink() and repo_link.resolve() == patching.PATCHES_DIR.resolve()


def test_check_passes_on_the_installed_pin():
    out = cli("check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "conflict" not in out.stdout


def test_apply_is_idempotent_and_revert_is_byte_identical(copy_root):
    before = _bytes(copy_root)
    assert cli("apply", "--sglang-root", str(copy_root)).returncode == 0
    patched = _bytes(copy_root)
    assert all(patched[n] != before[n] for n in FILES)
    for name in FILES:  # the overlap loop and the --disable-overlap-schedule loop of each file
        assert patched[name].count(b"_dsv4_collective_guard.check_iteration(self,") == 2
    again = cli("apply", "--sglang-root", str(copy_root))
    assert again.returncode == 0 and again.stdout.count("already applied") == 2
    assert _bytes(copy_root) == patched
    assert cli("check", "--require-applied", "--sglang-root", str(copy_root)).returncode == 0
    assert cli("revert", "--sglang-root", str(copy_root)).returncode == 0
    assert _bytes(copy_root) == before
    assert "already not applied" in cli("revert", "--sglang-root", str(copy_root)).stdout
    assert _bytes(copy_root) == before


def test_a_modified_file_is_refused_and_nothing_is_written(copy_root):
    decode = copy_root / "sglang/srt/disaggregation/decode.py"
    decode.write_text(decode.read_text().replace("self.process_decode_queue()", "self.process_decode_queue()  # local", 2))
    before = _bytes(copy_root)
    out = cli("apply", "--sglang-root", str(copy_root))
    assert out.returncode == 1
    assert "matches neither pristine sglang==0.5.23" in out.stdout and "Reinstall" in out.stdout
    assert _bytes(copy_root) == before  # prefill.py was checked fine, but not written either
    assert cli("check", "--sglang-root", str(copy_root)).returncode == 1


def test_a_different_installed_sglang_is_refused(copy_root, monkeypatch):
    monkeypatch.setattr(pin, "installed_sglang_version", lambda: "0.5.99")
    before = _bytes(copy_root)
    with pytest.raises(patching.PatchError, match=r"installed sglang is 0.5.99.*sglang==0.5.23 only"):
        patching.change(copy_root, reverse=False)  # not an explicit root: the installed version is checked
    assert _bytes(copy_root) == before


def test_a_failed_write_leaves_the_original_and_no_temp_file(copy_root, monkeypatch):
    before = _bytes(copy_root)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        patching.change(copy_root, reverse=False, explicit_root=True)
    assert _bytes(copy_root) == before
    assert not list((copy_root / "sglang/srt/disaggregation").glob("*.dsv4tmp"))


def _doctor_on(monkeypatch, root: Path) -> dict:
    monkeypatch.setattr(patching, "installed_root", lambda: root)
    section = patching.doctor_section()
    assert section.key == "patches" and section.data["sglang_root"] == str(root)
    return {row.name.removeprefix("patch "): (section.data[row.name.removeprefix("patch ")], row.status, row.detail)
            for row in section.rows}


def test_doctor_reports_each_patch_state(copy_root, monkeypatch, tmp_path):
    """Pristine: warn, guard inactive; patched: ok; locally modified: fail with the reinstall line."""
    names = {"collective_guard_decode.diff", "collective_guard_prefill.diff"}
    pristine_rows = _doctor_on(monkeypatch, copy_root)
    assert set(pristine_rows) == names
    for st, status, detail in pristine_rows.values():
        assert (st, status) == (patching.PRISTINE, "warn") and "dsv4-sm120 patch apply" in detail

    patched = pristine.patched_tree(tmp_path / "patched")
    assert {v[:2] for v in _doctor_on(monkeypatch, patched).values()} == {(patching.APPLIED, "ok")}

    decode = patched / pristine.DISAGG / "decode.py"
    decode.write_text(decode.read_text().replace("_dsv4_collective_guard.check_iteration", "pass  #", 1))
    rows = _doctor_on(monkeypatch, patched)
    assert rows["collective_guard_decode.diff"][:2] == (patching.CONFLICT, "fail")
    assert "Reinstall" in rows["collective_guard_decode.diff"][2]
    assert rows["collective_guard_prefill.diff"][:2] == (patching.APPLIED, "ok")


def test_tests_start_from_the_pristine_pin_in_a_patched_venv(copy_root, monkeypatch, tmp_path):
    """What CI does before the e2e suite (``patch apply`` on the installed sglang), played on a copy:
    the guard tests still get the pin's pristine bytes; a tree in neither state is refused."""
    patched = pristine.patched_tree(tmp_path / "venv_like")
    assert _bytes(patched) != _bytes(copy_root)
    monkeypatch.setattr(patching, "installed_root", lambda: patched)
    assert _bytes(pristine.pristine_tree(tmp_path / "again")) == _bytes(copy_root)
    assert _bytes(pristine.patched_tree(tmp_path / "again_patched")) == _bytes(patched)

    (patched / pristine.DISAGG / "prefill.py").write_text("# an edited file\n")
    with pytest.raises(RuntimeError, match="neither the pristine pin nor patched"):
        pristine.pristine_tree(tmp_path / "refused")

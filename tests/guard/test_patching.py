"""``dsv4-sm120 patch apply|check|revert``: strict, idempotent, atomic, byte-identical revert.

These run on a COPY of the installed pinned files (``--sglang-root``) so the shared venv is never
modified; ``check`` also runs on the installed sglang itself, as CI does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120 import patching, pin

FILES = ("prefill.py", "decode.py")


@pytest.fixture
def copy_root(tmp_path) -> Path:
    src = patching.installed_root() / "sglang/srt/disaggregation"
    dst = tmp_path / "sglang/srt/disaggregation"
    dst.mkdir(parents=True)
    for name in FILES:
        shutil.copyfile(src / name, dst / name)
    return tmp_path


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
    for name in FILES:
        assert b"_dsv4_collective_guard.check_iteration(self," in patched[name]
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


def test_a_different_installed_sglang_is_refused(monkeypatch):
    monkeypatch.setattr(pin, "installed_sglang_version", lambda: "0.5.99")
    with pytest.raises(patching.PatchError, match=r"installed sglang is 0.5.99.*sglang==0.5.23 only"):
        patching.change(patching.installed_root(), reverse=False)


def test_a_failed_write_leaves_the_original_and_no_temp_file(copy_root, monkeypatch):
    before = _bytes(copy_root)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        patching.change(copy_root, reverse=False, explicit_root=True)
    assert _bytes(copy_root) == before
    assert not list((copy_root / "sglang/srt/disaggregation").glob("*.dsv4tmp"))


def test_doctor_reports_the_patch_state():
    section = patching.doctor_section()
    assert section.key == "patches"
    states = {k: v for k, v in section.data.items() if k.endswith(".diff")}
    assert set(states) == {"collective_guard_decode.diff", "collective_guard_prefill.diff"}
    assert set(states.values()) <= {patching.APPLIED, patching.PRISTINE}
    assert all(row.status in ("ok", "warn") for row in section.rows)

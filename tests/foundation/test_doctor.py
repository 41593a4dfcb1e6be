"""``dsv4-sm120 doctor`` on this CPU machine: consistent install, no GPU reported as such."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dsv4_sm120 import cli, doctor


def test_console_script_exits_0_and_reports_no_gpu():
    exe = Path(sys.executable).parent / "dsv4-sm120"
    assert exe.exists(), "no dsv4-sm120 console script beside this Python: reinstall the package"
    proc = subprocess.run([str(exe), "doctor"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "no GPU" in proc.stdout
    assert "this install is consistent" in proc.stdout


def test_json_exits_0_with_every_section(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["gpu"]["available"] is False
    assert report["sglang"] == {"installed": "0.5.23", "pin": "0.5.23", "matches": True}
    assert report["plugin"]["loaded_by_sglang"] is True
    assert report["manifest"]["missing"] == {}
    assert report["nixl"]["importable"] is True


def test_require_gpu_fails_without_a_gpu(capsys):
    assert cli.main(["doctor", "--require-gpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_plugin_excluded_by_sglang_plugins_is_a_failure(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "another_plugin")
    [row] = doctor._plugin().rows
    assert row.status == doctor.FAIL and "SGLANG_PLUGINS" in row.detail


def test_invalid_switch_is_a_failure(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_COLLECTIVE_GUARD", "maybe")
    ok, sections = doctor.collect()
    assert not ok
    assert any(r.status == doctor.FAIL and "COLLECTIVE_GUARD" in r.name for s in sections for r in s.rows)

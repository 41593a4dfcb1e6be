"""``dsv4-sm120 doctor --selftest`` without a GPU says so, and the selftest imports no sglang.

The GPU side (each kernel once against its torch reference) ran on an H200 (sm_90); its output is kept
in bench/results/kernels/indexer_h200_2026-12-01_triton38_0e1fcec.json under ``selftest``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer; on a GPU the selftest runs")


def _doctor(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.cli", "doctor", "--selftest", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_selftest_without_a_gpu_says_so():
    proc = _doctor()
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout and "nothing was run" in proc.stdout
    assert _doctor("--require-gpu").returncode == 1


def test_selftest_needs_no_sglang():
    code = ("import sys; from dsv4_sm120 import cli; from dsv4_sm120.kernels import selftest; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""The e2e session's figures as one JSON file (bench/results/e2e/e2e_cpu_<date>.json): what ran, where, what came out."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from harness import run_record


def suite_fix() -> str:
    """The fixes as this test session sets them: "default", or the switches it moved off their defaults."""
    from dsv4_sm120.settings import SWITCHES

    moved = [f"{s.env}={os.environ[s.env]}" for s in SWITCHES if os.environ.get(s.env, s.default) != s.default]
    return " ".join(moved) or "default"


COMMIT_AT_START = None  # set by the e2e environment when it builds the wheel: the code the servers run


def write(path: Path, rows: list[dict]) -> None:
    from importlib.metadata import version

    run_record.write(path, {
        "date": run_record.now_utc(),
        "device": f"CPU only: {os.cpu_count()} cores, {platform.machine()} ({platform.node()}); no GPU",
        "commit": COMMIT_AT_START or run_record.commit(),
        "what": "real sglang.launch_server prefill/decode processes over NIXL (UCX, DRAM) behind the real PD router, "
                "tiny dummy-weight Llama on CPU; dsv4-sm120 installed from its wheel. No DSV4 model forward; "
                "timings are this shared 2-core machine's and mean nothing for a GPU host.",
        "sglang": version("sglang"), "sglang_router": version("sglang-router"), "nixl": version("nixl"),
        "scenarios": rows,
    })

"""Fork server of the mutation runner: pays the imports once, forks one pytest per mutation.

Each pytest process of this suite spends 10-25 s importing torch and sglang before its
first test. Forty mutations would spend most of CI's mutation budget on imports, so this
process imports the heavy *third-party* modules once (torch, pytest and the sglang modules
the listed tests use) and forks a child per job. It never imports ``dsv4_sm120``: a child
finds the package and the suite in its mutated copy (``<copy>/src`` and ``<copy>`` first on the
import path, and on ``PYTHONPATH`` for anything it spawns), and reports which file each ``dsv4_sm120`` module
came from so the runner can check that the mutated code is the code that ran.

It is started as a script (``python tests/mutations/zygote.py``), never imported by the
pytest session: that session has imported the package from the checkout and registered its
hooks. Protocol: one JSON job per line on stdin, one JSON result per line on stdout.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import sys
import time

# Heavy modules the listed tests import; a name missing on this install is skipped.
PRELOAD = (
    "pytest",
    "hypothesis",
    "zmq",
    "sglang.srt.server_args",
    "sglang.srt.configs.model_config",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.model_executor.pool_configurator",
    "sglang.srt.model_loader.utils",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.scheduler",
    "sglang.srt.models.deepseek_v4",
    "sglang.srt.plugins",
)

_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


def preload() -> list[str]:
    import torch

    # As tests/conftest.py does, before anything imports triton.language.
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - preloading is an optimisation only
            missing.append(f"{name}: {type(exc).__name__}")
    leaked = sorted(m for m in sys.modules if m == "dsv4_sm120" or m.startswith("dsv4_sm120."))
    if leaked:
        raise SystemExit(f"zygote: preloading imported dsv4_sm120 ({leaked[:3]}); it must import from the copy")
    return missing


class _Outcomes:
    """pytest plugin: each listed test's outcome, so 'caught' names the test that failed."""

    def __init__(self):
        self.failed: list[str] = []
        self.passed: list[str] = []
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(f"{report.nodeid} ({report.when})")
        elif report.when == "call" and report.passed:
            self.passed.append(report.nodeid)
        elif report.skipped:
            self.skipped.append(report.nodeid)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed.append(f"{report.nodeid or '<collection>'} (collect)")


def _child(job: dict) -> None:
    os.setpgid(0, 0)  # the runner kills the whole group on timeout (gloo ranks, servers)
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    root = job["root"]
    src = os.path.join(root, "src")
    os.chdir(root)
    # This process's purpose: a child that imports the mutated copy's package and suite, never the checkout's.
    sys.path[:] = [src, root] + [p for p in sys.path if p not in ("", _OWN_DIR)]
    os.environ["PYTHONPATH"] = os.pathsep.join([src, root])
    os.environ.update(job.get("env") or {})
    importlib.invalidate_caches()
    report: dict = {"package_origin": importlib.util.find_spec("dsv4_sm120").origin}
    import pytest

    outcomes = _Outcomes()
    try:
        rc = int(pytest.main(job["args"], plugins=[outcomes]))
    except BaseException as exc:  # noqa: BLE001 - reported, then the child exits
        rc = 3
        report["error"] = f"{type(exc).__name__}: {exc}"
    report.update(
        rc=rc, failed=outcomes.failed, passed=outcomes.passed, skipped=outcomes.skipped,
        modules={n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
                 if n == "dsv4_sm120" or n.startswith("dsv4_sm120.")},
    )
    with open(job["report"], "w") as out:
        json.dump(report, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _run(job: dict) -> dict:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(job)
        finally:
            os._exit(3)
    deadline = start + float(job["timeout_s"])
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                time.sleep(2)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    try:  # a test may have left processes in the group; none may outlive its job
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return {"exit": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
            "seconds": round(time.monotonic() - start, 1)}


def main() -> None:
    start = time.monotonic()
    missing = preload()
    print(json.dumps({"ready": True, "preload_s": round(time.monotonic() - start, 1), "missing": missing}),
          flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_run(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()

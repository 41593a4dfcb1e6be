"""Fixtures of the real-server suite: the wheel's environment, the tiny model, and PD sets started once.

What is real: ``sglang.launch_server`` prefill and decode processes of the pinned
sglang 0.5.23 (tokenizer manager, scheduler with the patched overlap loops,
detokenizer, HTTP server, ``/health``, ``/metrics``), NIXL agents over UCX between
them, the real PD router (``sglang-router``), dsv4-sm120 installed from its wheel
and loaded by sglang's own plugin loader in every process. What is replaced: the
model is a 2-layer dummy-weight Llama on CPU (no DSV4 forward runs here, there is
no GPU); the CPU adapters of ``cpu_testkit`` (each names the upstream code it
works around).

Servers are shared: one PD set per configuration for the whole session, stopped
after the last e2e test (``pytest_runtest_teardown``) so no idle server takes CPU
from later suites. A failing e2e test gets the tails of every server log of the
session in its report; the logs stay under the session's temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import cluster as cluster_mod
from harness import environment, run_record
from harness.servers import log_tail
from tests.e2e import results

E2E_DIR = Path(__file__).resolve().parent

_STARTED: dict[str, object] = {}  # cluster key -> Cluster, or the exception that stopped its start
_ROOT: list[Path] = []


def _in_e2e(item) -> bool:
    return item is not None and E2E_DIR in Path(item.path).parents


SHARED_SET_TIMEOUT_S = 1200  # pytest-timeout for a test on the shared default PD set (``pd``)


def pytest_collection_modifyitems(items):
    """A test on the shared default set may be the session's first: it then also builds the wheel's
    environment and starts the set (600 s ran out on a loaded 2-core machine). Its own timeout wins."""
    for item in items:
        if _in_e2e(item) and "pd" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SHARED_SET_TIMEOUT_S))


def _root(tmp_path_factory) -> Path:
    if not _ROOT:
        _ROOT.append(tmp_path_factory.mktemp("e2e"))
    return _ROOT[0]


@pytest.fixture(scope="session")
def e2e_env(tmp_path_factory) -> environment.E2EEnv:
    """dsv4-sm120 built into a wheel and installed in the suite's own environment (patch applied)."""
    results.COMMIT_AT_START = run_record.commit()  # the JSON names the code the wheel was built from
    return environment.build(_root(tmp_path_factory) / "env", E2E_DIR / "cpu_testkit")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from harness.tiny_model import write_tiny_llama

    return write_tiny_llama(_root(tmp_path_factory) / "tiny-llama")


@pytest.fixture(scope="session")
def clusters(e2e_env, tiny_model, tmp_path_factory):
    """``get(key, kind, **kw)``: the cluster of that key, started on first use and shared after."""
    logs = _root(tmp_path_factory) / "logs"

    def get(key: str, kind: str = "pd", **kwargs):
        found = _STARTED.get(key)
        if isinstance(found, BaseException):
            pytest.fail(f"cluster {key!r} did not start earlier in this session: {found}")
        if found is None:
            start = cluster_mod.start_pd if kind == "pd" else cluster_mod.start_single
            try:
                found = start(e2e_env, tiny_model, logs / key, **kwargs)
            except Exception as exc:
                _STARTED[key] = exc
                raise
            try:
                if kind == "pd":
                    cluster_mod.wait_serving(found)
            except Exception as exc:
                found.stop()
                _STARTED[key] = exc
                raise
            _STARTED[key] = found
        return found

    def discard(key: str) -> None:
        """Stop a cluster now: no later test needs it, or a scenario left it unusable (a wedged pin)."""
        found = _STARTED.pop(key, None)
        if found is not None and not isinstance(found, BaseException):
            found.stop()

    get.discard = discard
    yield get
    _stop_all()


def _stop_all() -> None:
    for key, found in list(_STARTED.items()):
        if not isinstance(found, BaseException):
            found.stop()
        _STARTED.pop(key)


@pytest.fixture(scope="session")
def pd(clusters):
    """The default PD set: prefill + decode at TP=1 over NIXL behind the router, every fix at its default."""
    return clusters("pd-tp1")


@pytest.fixture(scope="session")
def record():
    """``record(scenario, fix, **figures)``: kept for the session's JSON (``DSV4_E2E_RESULTS=path``)."""
    rows: list[dict] = []

    def add(scenario: str, fix: str, **figures) -> None:
        rows.append({"scenario": scenario, "fix": fix, **figures})

    yield add
    out = os.environ.get("DSV4_E2E_RESULTS")
    if out and rows:
        results.write(Path(out), rows)


def pytest_runtest_teardown(item, nextitem):
    """After the last e2e test, stop every server the suite started (by PID, whole process groups)."""
    if _in_e2e(item) and not _in_e2e(nextitem):
        _stop_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _in_e2e(item) and _ROOT:
        for log in sorted((_ROOT[0] / "logs").rglob("*.log")):
            report.sections.append((f"server log {log.relative_to(_ROOT[0])} (tail)", log_tail(log, 40)))

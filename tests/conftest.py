"""Session-wide test setup, done before any test module imports sglang or Triton.

- The tests directory is a package and the repository root is on pytest's path (``pythonpath`` in
  pyproject.toml), so harness modules import by full name (``from tests import polling``).
- torch runs single-threaded: several suites fork gloo ranks from the pytest process, and a
  child forked after the parent has used a multi-threaded OpenMP pool hangs in its first
  parallel torch op (seen on the full suite: a forked rank stuck in ``index_copy_``).
- Without a CUDA device, Triton runs in its interpreter: ``TRITON_INTERPRET`` must be set
  before ``triton.language`` is first imported (its own library functions are ``@triton.jit``),
  and sglang imports it early, so a per-suite fixture would be too late. The ahead-of-time
  compile tests remove it in their subprocesses; on a GPU host nothing changes.
"""

import os
import sys

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items):
    """Run the real-server suite first and the NIXL suites last.

    Each NIXL 1.5.1 agent keeps a native UCX progress thread polling for as long as it
    lives, and the pin's ``NixlKVManager`` keeps its agent alive through its own worker
    threads, so the loopback pairs of tests/nixl and tests/index_k/test_pd_integrity.py
    cannot be torn down mid-session. Seen on CI: ten such threads held about 1.7 of the
    machine's 2 cores for every suite that ran after them.

    The real-server suite (tests/e2e) goes first for the same reason: its servers are separate
    processes that need the cores, and it stops them after its last test.
    """

    def order(item) -> int:
        if "e2e" in item.path.parts:
            return 0
        return 2 if "nixl" in item.path.parts or item.path.name == "test_pd_integrity.py" else 1

    items.sort(key=order)


@pytest.fixture
def cuda_device():
    """For the tests marked ``gpu`` that need the device itself: without one they fail rather than skip, since
    selected with ``-m gpu`` a check that cannot run has not passed."""
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device: run the -m gpu tests on the GPU host")


@pytest.fixture(autouse=True)
def _integrity_state_as_it_was():
    """Integrity mode's process-wide state (the process's ledger, and whether requests are failed for bad pages)
    put back after each test: a server builds one ledger, a test process builds several stacks, and a ledger
    one test left set made a later test's forward check its key stores (a test-order failure on CI). Read only
    where the module is already imported: importing it here would import Triton for every test."""
    integrity = sys.modules.get("dsv4_sm120.index_k.integrity")
    saved = (integrity.LEDGER, integrity.QUARANTINE.active) if integrity is not None else (None, False)
    yield
    integrity = sys.modules.get("dsv4_sm120.index_k.integrity")
    if integrity is not None:
        integrity.LEDGER, integrity.QUARANTINE.active = saved

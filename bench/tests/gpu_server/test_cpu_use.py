"""The agents set's CPU reading: a process tree's CPU-seconds from /proc, and the cores each server kept busy
driven and idle."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.gpu_server import cpu_use

# a parent that starts a child spinning for about 0.6 s of CPU, then waits for it: the parent itself uses none
TREE = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
        "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass'])")


def test_a_trees_cpu_seconds_count_its_descendants():
    parent = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        before = cpu_use.snapshot({"server": parent.pid})
        deadline = time.monotonic() + 20
        spun = 0.0
        while spun < 0.4 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.05)
            spun = cpu_use.spent(before, cpu_use.snapshot({"server": parent.pid}))["server"]
        assert spun >= 0.4, spun  # the child's spinning, counted under its parent's name
    finally:
        parent.wait(timeout=30)
    assert cpu_use.tree_seconds(parent.pid) == 0.0  # a process gone: nothing to read


def test_each_server_is_given_the_cores_it_kept_busy_driven_and_idle():
    runs = [{"target": "pd", "wall_s": 10.0, "cpu_s": {"pd:prefill": 9.0, "pd_fixes_off:prefill": 10.0, "hc": 1.0}},
            {"target": "pd_fixes_off", "wall_s": 10.0, "cpu_s": {"pd:prefill": 12.0, "pd_fixes_off:prefill": 11.0}},
            {"target": "pd", "wall_s": 0, "cpu_s": {"pd:prefill": 5.0}}]  # no wall time: not a rate
    assert cpu_use.cores(runs) == {"pd:prefill": {"driven": 0.9, "idle": 1.2},
                                   "pd_fixes_off:prefill": {"driven": 1.1, "idle": 1.0},
                                   "hc": {"driven": None, "idle": 0.1}}


LSCPU = """Architecture:             x86_64
CPU(s):                   16
Model name:               Intel(R) Xeon(R) Platinum 8480+
Thread(s) per core:       2
Core(s) per socket:       8
Socket(s):                1
NUMA node(s):             1
"""


def test_a_gpu_record_says_what_cpus_its_servers_shared(monkeypatch):
    from bench.gpu_server import run

    monkeypatch.setattr(run, "_sh", lambda argv: LSCPU if argv == ["lscpu"] else "")
    assert run.host_facts()["cpu"] == {"Model name": "Intel(R) Xeon(R) Platinum 8480+", "CPU(s)": "16",
                                       "Thread(s) per core": "2", "Core(s) per socket": "8", "Socket(s)": "1",
                                       "NUMA node(s)": "1"}

"""``bench-serving`` (upstream's ``sglang.benchmark.serving``) through the PD router, plugin on vs off.

Off means the servers load only the CPU test kit (``SGLANG_PLUGINS=cpu_testkit``)
and the patched loops' guard is switched off, so every process runs the pin's
code. The ratio of the two, measured on, off, off, on on this machine, is the
plugin's overhead here; absolute figures of a tiny CPU model mean nothing for a
GPU host, and a shared 2-core machine makes even the ratio noisy (it is recorded,
not asserted beyond "every request completed"). The dataset is `random-ids`: upstream's `random`
samples ShareGPT text from the hub, which this machine cannot reach.
"""

from __future__ import annotations

import json
import os

import pytest

LEVELS = ("1", "16")
PROMPTS = 32


def _bench(env, cluster, tiny_model, out_dir, tag: str) -> list[dict]:
    proc = env.cli("bench-serving", "--base-url", cluster.front, "--model", "tiny", "--concurrency", *LEVELS,
                   "--num-prompts", str(PROMPTS), "--dataset-name", "random-ids", "--random-input-len", "128", "--random-output-len", "32",
                   "--tokenizer", str(tiny_model), "--out-dir", str(out_dir), "--tag", tag, "--level-timeout", "600",
                   timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])["summary"]


ORDER = ("on", "off", "off", "on")  # ABBA: a load drift on the shared machine cancels to first order


@pytest.mark.e2e
@pytest.mark.timeout(3000)
def test_serving_throughput_plugin_on_vs_off(pd, clusters, e2e_env, tiny_model, tmp_path, record):
    sets = {"on": pd, "off": clusters("pd-tp1-plugin-off", tag="-plugin-off",
                                      switches={"SGLANG_PLUGINS": "cpu_testkit", "DSV4_SM120_COLLECTIVE_GUARD": "0"})}
    passes = []
    for i, which in enumerate(ORDER):
        rows = _bench(e2e_env, sets[which], tiny_model, tmp_path / f"{i}-{which}", f"plugin-{which}")
        passes.append({"plugin": which, "load_average_1m": round(os.getloadavg()[0], 2), "summary": rows})
    ratios = []
    for level in LEVELS:
        total = {w: sum(r["output_throughput"] for p in passes if p["plugin"] == w for r in p["summary"]
                        if str(r["concurrency"]) == level) for w in ("on", "off")}
        ratios.append({"concurrency": int(level), "output_throughput_on_over_off": total["on"] / total["off"]})
    record("bench-serving", "plugin on vs off (ABBA)", order=list(ORDER), passes=passes, ratios=ratios)
    for p in passes:
        for row in p["summary"]:
            assert row["completed"] == PROMPTS, row

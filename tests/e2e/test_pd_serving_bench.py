"""``bench-serving`` (upstream's ``sglang.benchmark.serving``) through the PD router, plugin on vs off.

Off means the servers load only the CPU test kit (``SGLANG_PLUGINS=cpu_testkit``)
and the patched loops' guard is switched off, so every process runs the pin's
code. The ratio of the two runs, measured back to back on this machine, is the
plugin's overhead here; absolute figures of a tiny CPU model mean nothing for a
GPU host, and a shared 2-core machine makes even the ratio noisy (it is recorded,
not asserted beyond "every request completed"). The dataset is `random-ids`: upstream's `random`
samples ShareGPT text from the hub, which this machine cannot reach.
"""

from __future__ import annotations

import json

import pytest

LEVELS = ("1", "16")


def _bench(env, cluster, tiny_model, out_dir, tag: str) -> list[dict]:
    proc = env.cli("bench-serving", "--base-url", cluster.front, "--model", "tiny", "--concurrency", *LEVELS,
                   "--num-prompts", "48", "--dataset-name", "random-ids", "--random-input-len", "128", "--random-output-len", "32",
                   "--tokenizer", str(tiny_model), "--out-dir", str(out_dir), "--tag", tag, "--level-timeout", "600",
                   timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])["summary"]


@pytest.mark.e2e
@pytest.mark.timeout(3000)
def test_serving_throughput_plugin_on_vs_off(pd, clusters, e2e_env, tiny_model, tmp_path, record):
    off = clusters("pd-tp1-plugin-off", switches={"SGLANG_PLUGINS": "cpu_testkit", "DSV4_SM120_COLLECTIVE_GUARD": "0"},
                   tag="-plugin-off")
    on_rows = _bench(e2e_env, pd, tiny_model, tmp_path / "on", "plugin-on")
    off_rows = _bench(e2e_env, off, tiny_model, tmp_path / "off", "plugin-off")
    ratios = [{"concurrency": a["concurrency"],
               "output_throughput_on_over_off": (a["output_throughput"] / b["output_throughput"])
               if a.get("output_throughput") and b.get("output_throughput") else None}
              for a, b in zip(on_rows, off_rows)]
    record("bench-serving", "plugin on vs off", on=on_rows, off=off_rows, ratios=ratios)
    for row in on_rows + off_rows:
        assert row["completed"] == 48, row

"""--model-impl dsv4 on a DeepSeek-V4.1 checkpoint: refused at model load with bf16 keys, upstream with fp8.

One fresh process (upstream's ``load_plugins()`` runs once per process) calls the
real ``load_plugins()`` and then upstream's real ``get_model_architecture`` on
real ``ModelConfig`` objects read from tiny ``config.json`` checkpoints (no
weights: nothing here builds or runs the model). The switch is read when the
hook runs, so the probe sets it before each call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.tiny_checkpoints import write_tiny_dsv4, write_tiny_dsv41

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture
    def arch(path, impl, dtype):
        os.environ["DSV4_SM120_INDEX_K_DTYPE"] = dtype
        try:
            cls, name = get_model_architecture(ModelConfig(path, model_impl=impl))
            return {"class": cls.__module__ + "." + cls.__qualname__, "arch": name}
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
    v41, v4 = sys.argv[1], sys.argv[2]
    out = {f"{name}_{impl}_{dtype}": arch(path, impl, dtype)
           for name, path in (("v41", v41), ("v4", v4))
           for impl in ("dsv4", "sglang") for dtype in ("bf16", "fp8")}
    print("PROBE" + json.dumps(out))
    """
)

UPSTREAM = "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM"
OURS = "dsv4_sm120.model.deepseek_v4.DeepseekV4ForCausalLMSM120"


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    paths = [str(write_tiny_dsv41(root / "v41")), str(write_tiny_dsv4(root / "v4"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_PLUGINS", "DSV4_SM120_"))}
    proc = subprocess.run([sys.executable, "-c", PROBE, *paths], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {"paths": paths, **json.loads(lines[-1][len("PROBE"):])}


def test_bf16_keys_on_v41_are_refused_at_model_load_with_the_way_out(probe):
    got = probe["v41_dsv4_bf16"]
    assert got.get("error") == "UnsupportedCheckpointError", got
    message = got["message"]
    assert "'deepseek_v41'" in message and probe["paths"][0] in message
    assert "--model-impl sglang" in message and "DSV4_SM120_INDEX_K_DTYPE=fp8" in message
    # It says what is not supported: every piece the verdict does not hold.
    from dsv4_sm120.model.v41 import PIECES

    assert all(piece.name in message for piece in PIECES if not piece.holds)
    assert "bf16 C4 indexer inside a V4.1 forward" in message


def test_fp8_keys_on_v41_resolve_to_the_package_class(probe):
    """The way out the refusal names works: the class is the package's, which with fp8 swaps nothing
    (its pools, plan, PD layout and HiCache stack are upstream's: test_v41_layouts)."""
    assert probe["v41_dsv4_fp8"] == {"class": OURS, "arch": "DeepseekV4ForCausalLM"}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_model_impl_sglang_on_v41_is_upstream(probe, dtype):
    assert probe[f"v41_sglang_{dtype}"] == {"class": UPSTREAM, "arch": "DeepseekV4ForCausalLM"}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_v4_checkpoints_are_served_as_before(probe, dtype):
    assert probe[f"v4_dsv4_{dtype}"] == {"class": OURS, "arch": "DeepseekV4ForCausalLM"}
    assert probe[f"v4_sglang_{dtype}"]["class"] == UPSTREAM


def test_doc_table_is_the_verdict_the_code_refuses_with():
    from pathlib import Path

    from dsv4_sm120.model.v41 import PIECES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "deepseek_v41.md").read_text()
    section = doc.split("## Verdict per piece\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| ")][2:]
    assert [(name, verdict == "holds", evidence) for name, verdict, evidence in rows] == [
        (p.name, p.holds, p.evidence) for p in PIECES]

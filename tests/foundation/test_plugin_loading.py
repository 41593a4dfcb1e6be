"""The plugin as sglang sees it: discovered through the installed entry point, in a fresh process.

Each probe is a new Python process (upstream's ``load_plugins()`` runs once per
process) that calls the real ``sglang.srt.plugins.load_plugins()`` and then drives
upstream's real ``get_model_architecture`` on real ``ModelConfig`` objects built
from tiny ``config.json`` checkpoints (no weights: nothing here runs a forward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from harness.tiny_model import write_tiny_llama
from tests.tiny_checkpoints import write_tiny_dsv4

PROBE = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    out = {"targets": sorted(HookRegistry._hooks), "patched": sorted(HookRegistry._patched)}
    if sys.argv[1] != "-":
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader.utils import get_model_architecture
        def arch(path, impl):
            try:
                cls, name = get_model_architecture(ModelConfig(path, model_impl=impl))
                return {"class": cls.__module__ + "." + cls.__qualname__, "arch": name,
                        "upstream_subclass": cls.__mro__[1].__module__ + "." + cls.__mro__[1].__qualname__}
            except Exception as exc:
                return {"error": type(exc).__name__, "message": str(exc)}
        dsv4, llama = sys.argv[1], sys.argv[2]
        out["dsv4_dsv4"] = arch(dsv4, "dsv4")
        out["dsv4_sglang"] = arch(dsv4, "sglang")
        out["dsv4_auto"] = arch(dsv4, "auto")
        out["llama_dsv4"] = arch(llama, "dsv4")
    print("PROBE" + json.dumps(out))
    """
)

MODEL_TARGET = "sglang.srt.model_loader.utils.get_model_architecture"
UPSTREAM_DSV4 = "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM"
OURS = "dsv4_sm120.model.deepseek_v4.DeepseekV4ForCausalLMSM120"


def run_probe(args: list[str], **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_PLUGINS", "DSV4_SM120_"))}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=full_env, timeout=300
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("PROBE")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("PROBE"):])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return str(write_tiny_dsv4(root / "dsv4")), str(write_tiny_llama(root / "llama"))


@pytest.fixture(scope="module")
def loaded(checkpoints) -> dict:
    return run_probe(list(checkpoints))


def test_load_plugins_discovers_and_applies_the_entry_point(loaded):
    assert MODEL_TARGET in loaded["targets"]
    assert MODEL_TARGET in loaded["patched"]


def test_model_impl_dsv4_resolves_to_the_package_subclass(loaded):
    got = loaded["dsv4_dsv4"]
    assert got["class"] == OURS and got["arch"] == "DeepseekV4ForCausalLM"
    assert got["upstream_subclass"] == UPSTREAM_DSV4


@pytest.mark.parametrize("impl", ["sglang", "auto"])
def test_other_model_impls_resolve_as_upstream(loaded, impl):
    assert loaded[f"dsv4_{impl}"]["class"] == UPSTREAM_DSV4


def test_model_impl_dsv4_refuses_a_non_dsv4_checkpoint_clearly(loaded):
    got = loaded["llama_dsv4"]
    assert got["error"] == "UnsupportedCheckpointError"
    assert "LlamaForCausalLM" in got["message"] and "DeepseekV4ForCausalLM" in got["message"]
    assert "--model-impl sglang" in got["message"]


def test_sglang_plugins_naming_another_plugin_excludes_it():
    got = run_probe(["-"], SGLANG_PLUGINS="some_other_plugin")
    assert MODEL_TARGET not in got["targets"]


def test_bad_switch_value_stops_a_dsv4_launch_with_its_message(checkpoints):
    got = run_probe(list(checkpoints), DSV4_SM120_INDEX_K_DTYPE="fp16")
    assert got["dsv4_dsv4"]["error"] == "SettingsError"
    assert "DSV4_SM120_INDEX_K_DTYPE='fp16'" in got["dsv4_dsv4"]["message"]
    # Runs without --model-impl dsv4 are untouched by the package's switches.
    assert got["dsv4_sglang"]["class"] == UPSTREAM_DSV4

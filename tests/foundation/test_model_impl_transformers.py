"""``--model-impl transformers`` is upstream's with the plugin loaded: same model class, same KV pool.

Two fresh processes run the same probe, one with the plugin loaded by the real
``load_plugins()`` and one with it excluded (``SGLANG_PLUGINS`` naming another
plugin), and their answers must be equal. The probe drives upstream's real
``get_model_architecture`` on real ``ModelConfig`` objects (tiny ``config.json``
checkpoints, no weights) and upstream's real ``KVCacheConfigurator.configure()``
on a tiny DeepSeek-V4 checkpoint (``tests/index_k/pool_harness.py``: only the
free-memory probe is replaced, by a fixed budget). The package's switches are
left at their defaults (bf16 keys), so a hook that wrongly acted on
``transformers`` would change the pool; a bad switch value must not stop a
``transformers`` run either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from harness.tiny_model import write_tiny_llama
from tests.child_env import repo_on_path
from tests.tiny_checkpoints import write_tiny_dsv4, write_tiny_dsv41

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture
    def arch(path):
        try:
            config = ModelConfig(path, model_impl="transformers")
            cls, name = get_model_architecture(config)
            return {"class": cls.__module__ + "." + cls.__qualname__, "arch": name,
                    "impl": str(config._resolved_model_impl)}
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
    llama, dsv4, dsv41 = sys.argv[1:4]
    out = {"patched": sorted(HookRegistry._patched)}
    out.update({name: arch(path) for name, path in (("llama", llama), ("dsv4", dsv4), ("dsv41", dsv41))})
    os.environ["DSV4_SM120_INDEX_K_DTYPE"] = "fp16"  # a bad value: only a dsv4 run may stop on it
    out["dsv4_bad_switch"] = arch(dsv4)
    del os.environ["DSV4_SM120_INDEX_K_DTYPE"]
    from tests.index_k import pool_harness
    result = pool_harness.build(Path(dsv4), "transformers")
    kv = result.token_to_kv_pool
    out["pool"] = {"class": type(kv).__qualname__, "index_pool": type(kv.c4_indexer_kv_pool).__qualname__,
                   "index_bytes": kv.c4_indexer_kv_pool.get_bytes_per_token(), "pd_kv_layout": kv.pd_kv_layout(),
                   "plan": str(result.memory_pool_config), "items": kv.get_contiguous_buf_infos()[2]}
    print("PROBE" + json.dumps(out))
    """
)

MODEL_TARGET = "sglang.srt.model_loader.utils.get_model_architecture"


def _probe(args: list[str], **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_PLUGINS", "DSV4_SM120_"))}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          env=repo_on_path(full_env), timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("PROBE"):])


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("ckpt")
    args = [str(write_tiny_llama(root / "llama")), str(write_tiny_dsv4(root / "dsv4")), str(write_tiny_dsv41(root / "dsv41"))]
    return _probe(args), _probe(args, SGLANG_PLUGINS="some_other_plugin")


def test_the_comparison_is_with_and_without_the_plugin(probes):
    with_plugin, without = probes
    assert MODEL_TARGET in with_plugin["patched"]
    assert any(t.startswith("sglang.srt.mem_cache.kv_cache_configurator") for t in with_plugin["patched"])
    assert without["patched"] == []


@pytest.mark.parametrize("checkpoint", ["llama", "dsv4", "dsv41", "dsv4_bad_switch"])
def test_transformers_resolves_the_same_class_as_upstream(probes, checkpoint):
    with_plugin, without = probes
    assert "error" not in with_plugin[checkpoint], with_plugin[checkpoint]
    assert with_plugin[checkpoint] == without[checkpoint]
    assert with_plugin[checkpoint]["class"].startswith("sglang.srt.models.transformers.")


def test_transformers_gets_upstreams_pool_plan_and_pd_layout(probes):
    with_plugin, without = probes
    assert with_plugin["pool"] == without["pool"]
    assert with_plugin["pool"]["index_bytes"] == 132 and "index_k:bf16" not in with_plugin["pool"]["pd_kv_layout"]

"""The package's model class, built through upstream's real ``__init__`` on a tiny DeepSeek-V4 config.

tests/kernels/model_build.py builds ``DeepseekV4ForCausalLMSM120`` in a fresh interpreter (real
published ServerArgs, real one-rank gloo groups, real ModelConfig, real layers, no weights; what it
replaces and why is in its docstring) for bf16 and fp8 index keys, with and without
``--enable-hisparse``, and reports what was built. The AOT specs are checked against the dtypes the
real compressor of that model hands the index-K store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.child_env import repo_on_path


@pytest.fixture(scope="module")
def built() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_SM120_")}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.model_build"], env=repo_on_path(env),
                          capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"model build harness failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


def test_bf16_build_swaps_every_c4_indexer(built):
    res = built["bf16"]
    assert "error" not in res, res
    assert len(res["c4_layers"]) == res["n_indexers"] == 2, "upstream builds one C4 indexer per ratio-4 layer"
    assert res["indexer_types"] == ["BF16C4Indexer"]
    assert res["bf16_indexers"] == res["n_bf16"] == 2 and res["index_k_dtype"] == "bf16"


def test_the_build_says_once_at_the_default_log_level_what_it_built(built):
    assert built["bf16"]["built_lines"] == [
        "dsv4-sm120: built DeepseekV4ForCausalLMSM120 with bf16 index keys: "
        "2 of 2 C4 indexers replaced by BF16C4Indexer, 0 upstream C4Indexer left"]
    assert built["fp8"]["built_lines"] == [
        "dsv4-sm120: built DeepseekV4ForCausalLMSM120 with fp8 index keys: "
        "0 of 2 C4 indexers replaced by BF16C4Indexer, 2 upstream C4Indexer left"]


def test_bf16_build_readies_every_kernel_variant_before_serving(built):
    assert built["bf16"]["warmups"] == [{"device": "cpu", "heads": 64, "checksum": False, "two_stage": False}]
    assert built["fp8"]["warmups"] == []


def test_fp8_build_is_upstreams_indexer(built):
    res = built["fp8"]
    assert res["indexer_types"] == ["C4Indexer"] and res["bf16_indexers"] == 0 and res["index_k_dtype"] == "fp8"


def test_hisparse_is_refused_at_model_build_with_bf16_keys(built):
    res = built["bf16_hisparse"]
    assert res.get("error") == "BF16IndexerUnsupported", res
    assert "--enable-hisparse" in res["message"] and "DSV4_SM120_INDEX_K_DTYPE=fp8" in res["message"]
    assert built["fp8_hisparse"]["indexer_types"] == ["C4Indexer"], "fp8 keys keep upstream's hisparse path"


def test_aot_store_specs_take_what_upstreams_compressor_feeds(built):
    from dsv4_sm120.kernels import aot

    triton_type = {"torch.float32": "*fp32", "torch.bfloat16": "*bf16"}
    kv = triton_type[built["bf16"]["compressor_kv_dtype"]]
    store_specs = [s for s in aot.KERNEL_SPECS if s.name.startswith("index_k_store")]
    assert len(store_specs) == 3
    for spec in store_specs:  # the store casts the norm weight to the kv dtype, so both pointers carry it
        assert spec.signature["kv_ptr"] == kv and spec.signature["w_ptr"] == kv, spec
    one_launch = [s for s in aot.KERNEL_SPECS if s.name.startswith("query_store")]
    assert len(one_launch) == 2
    for spec in one_launch:
        assert spec.signature["kv_ptr"] == kv and spec.signature["norm_w_ptr"] == kv, spec

"""The package's model class built on a tiny DeepSeek-V4.1 config through upstream's real ``__init__``.

One fresh interpreter builds upstream's ``DeepseekV4ForCausalLM`` and the package's
``DeepseekV4ForCausalLMSM120`` (bf16 and fp8 keys) on the same tiny V4.1 ``config.json``
(no weights loaded), with the kernels area's build harness (``tests/kernels/model_build.py``:
real CPU ``ServerArgs`` published with ``runtime_context``, real one-rank gloo groups, a real
``ModelConfig``; replaced there and said why: ``vllm._custom_ops``, which nothing calls while
a model is built). What it shows: only the C4 layer's ``C4Indexer`` becomes ``BF16C4Indexer``;
the ratio-1/2 ``DeepseekV41Indexer`` modules and every parameter stay upstream's; with fp8
keys nothing is swapped. Building a model is not running it: no forward runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.child_env import repo_on_path

PROBE = textwrap.dedent(
    """
    import dataclasses, json, tempfile
    from pathlib import Path
    from dsv4_sm120 import settings
    from dsv4_sm120.index_k import gate
    from harness.servers import free_port
    from tests.kernels import model_build
    from tests.tiny_checkpoints import write_tiny_dsv41
    model_build._stand_in_vllm_ops()
    from sglang.srt.distributed import parallel_state

    def built(cls, dtype, ckpt):
        gate.use(dataclasses.replace(settings.load(), index_k_dtype=dtype))  # as plugin.register hands it over
        model = cls(model_build._publish(ckpt).hf_config, None)
        return {"indexers": {n: type(m).__name__ for n, m in model.named_modules() if n.endswith(".indexer")},
                "params": {n: list(p.shape) for n, p in model.named_parameters()},
                "bf16_indexers": getattr(model, "bf16_indexers", None)}

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_dsv41(Path(tmp) / "tiny-dsv41")
        config = json.loads((ckpt / "config.json").read_text())
        config.update(model_build.BUILD_KEYS)
        (ckpt / "config.json").write_text(json.dumps(config))
        model_build._publish(ckpt)
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        parallel_state.initialize_model_parallel(backend="gloo")
        from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
        from dsv4_sm120.model.deepseek_v4 import DeepseekV4ForCausalLMSM120
        out = {"upstream": built(DeepseekV4ForCausalLM, "fp8", ckpt),
               "bf16": built(DeepseekV4ForCausalLMSM120, "bf16", ckpt),
               "fp8": built(DeepseekV4ForCausalLMSM120, "fp8", ckpt)}
    print("RESULT " + json.dumps(out), flush=True)
    """
)

C4 = "model.layers.0.self_attn.indexer"
V41 = ("model.layers.1.self_attn.indexer", "model.layers.3.self_attn.indexer")  # the index source layers


@pytest.fixture(scope="module")
def models() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_SM120_")}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=repo_on_path(env),
                          timeout=500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_upstream_builds_a_c4_indexer_and_the_v41_indexers(models):
    assert models["upstream"]["indexers"] == {C4: "C4Indexer", **{name: "DeepseekV41Indexer" for name in V41}}


def test_bf16_swaps_the_c4_indexer_only(models):
    assert models["bf16"]["indexers"] == {C4: "BF16C4Indexer", **{name: "DeepseekV41Indexer" for name in V41}}
    assert models["bf16"]["bf16_indexers"] == 1
    assert models["bf16"]["params"] == models["upstream"]["params"], "the swap changes no weight"


def test_fp8_swaps_nothing(models):
    assert models["fp8"]["indexers"] == models["upstream"]["indexers"]
    assert models["fp8"]["bf16_indexers"] == 0
    assert models["fp8"]["params"] == models["upstream"]["params"]

"""Build ``DeepseekV4ForCausalLMSM120`` through upstream's real ``__init__`` on the CPU and report what it built.

Run in a fresh interpreter as ``python -m tests.kernels.model_build`` with the repository root on
``PYTHONPATH`` (tests/kernels/test_model_build.py does): it publishes a real
CPU ``ServerArgs`` with sglang's ``runtime_context.publish``, builds real gloo process groups of one
rank with sglang's ``init_distributed_environment`` / ``initialize_model_parallel``, reads a real
``ModelConfig`` from a tiny DeepSeek-V4 ``config.json`` (tests/tiny_checkpoints.py, plus the keys a
released V4 config carries that the model's layers read: hyper-connection, MoE gate and YaRN fields),
and constructs the package's model class with no weights loaded, once per scenario. Prints one line
``RESULT <json>``.

Replaced, because it cannot run here: ``vllm._custom_ops``, which upstream's rotary-embedding base class
imports at construction on a host that is neither CUDA nor the CPU engine (the CPU engine, for its part,
loads sgl-kernel's CUDA library at publish). The stand-in module's ``rotary_embedding`` raises if called;
nothing calls it while a model is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import traceback
import types
from pathlib import Path

from harness.servers import free_port
from tests.tiny_checkpoints import write_tiny_dsv4

# Keys a released DeepSeek-V4 config.json has that the tiny config leaves out; values are the
# released model's where they are a choice of algorithm, small where they size something.
BUILD_KEYS = {
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "topk_method": "noaux_tc", "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "n_shared_experts": 1, "norm_topk_prob": True, "n_group": 1,
    "topk_group": 1, "n_hash_layers": 0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "window_size": 128,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16384,
                     "beta_fast": 32, "beta_slow": 1},
}


def _stand_in_vllm_ops() -> None:
    def rotary_embedding(*args, **kwargs):
        raise NotImplementedError("vllm._custom_ops stand-in: no forward runs in this harness")

    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    sys.modules.setdefault("vllm._custom_ops", ops)


def _checkpoint(root: Path) -> Path:
    ckpt = write_tiny_dsv4(root / "tiny-dsv4-build", num_layers=4)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(BUILD_KEYS)
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def _publish(ckpt: Path, **extra):
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(ckpt), device="cpu", model_impl="dsv4", skip_tokenizer_init=True,
                      page_size=256, kv_cache_dtype="fp8_e4m3", **extra)
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    _log_as_a_server_does(args)
    return ModelConfig.from_server_args(args)


def _record_warmups() -> list:
    """The kernel warmups the model's construction asks for (off CUDA they compile nothing anyway)."""
    from dsv4_sm120.kernels import warmup

    calls: list = []
    real = warmup.compile_for_serving

    def recorded(device, **kwargs):
        calls.append({"device": str(device), **kwargs})
        return real(device, **kwargs)

    warmup.compile_for_serving = recorded
    return calls


class _Lines(logging.Handler):
    """Keeps what reaches the root logger's handlers, as the server's log would show it."""

    lines: list = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _log_as_a_server_does(args) -> None:
    """sglang's own logger set-up at the launch's default ``--log-level``, then a handler that keeps lines."""
    from sglang.srt.utils.common import configure_logger

    configure_logger(args)
    logging.getLogger().addHandler(_Lines())


def _build(ckpt: Path, index_k_dtype: str, **server_extra) -> dict:
    import torch
    from sglang.srt.layers.attention.dsv4.indexer import C4Indexer

    from dsv4_sm120 import settings
    from dsv4_sm120.index_k import gate
    from dsv4_sm120.model.deepseek_v4 import BF16C4Indexer, DeepseekV4ForCausalLMSM120

    gate.use(dataclasses.replace(settings.load(), index_k_dtype=index_k_dtype))  # as plugin.register hands it over
    model_config = _publish(ckpt, **server_extra)
    _Lines.lines.clear()
    warmups = _record_warmups()
    try:
        model = DeepseekV4ForCausalLMSM120(model_config.hf_config, None)
    except Exception as exc:  # the refusal scenarios report the error they got
        return {"error": type(exc).__name__, "message": str(exc)}
    indexers = [m for m in model.modules() if isinstance(m, C4Indexer)]
    out = {
        "indexer_types": sorted({type(m).__name__ for m in indexers}),
        "n_indexers": len(indexers),
        "n_bf16": sum(type(m) is BF16C4Indexer for m in indexers),
        "bf16_indexers": model.bf16_indexers,
        "index_k_dtype": model.index_k_dtype,
        "c4_layers": [i for i, r in enumerate(model_config.hf_config.compress_ratios) if r == 4],
        "built_lines": [ln for ln in _Lines.lines if ln.startswith("dsv4-sm120: built")],
        "warmups": warmups,
    }
    if indexers:  # the dtypes upstream's compressor hands the index-K store in production
        comp = indexers[0].compressor
        for p in comp.parameters():
            p.data.normal_()
        x = torch.randn(3, model_config.hf_config.hidden_size).to(torch.bfloat16)
        out["compressor_kv_dtype"] = str(comp._compute_wkv_gate(x).dtype)
        out["compressor_norm_weight_dtype"] = str(comp.norm.weight.dtype)
    return out


def main() -> None:
    import tempfile

    _stand_in_vllm_ops()
    from sglang.srt.distributed import parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _checkpoint(Path(tmp))
        _publish(ckpt)
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        parallel_state.initialize_model_parallel(backend="gloo")
        result = {}
        for name, dtype, extra in (("bf16", "bf16", {}), ("fp8", "fp8", {}),
                                   ("bf16_hisparse", "bf16", {"enable_hisparse": True}),
                                   ("fp8_hisparse", "fp8", {"enable_hisparse": True})):
            try:
                result[name] = _build(ckpt, dtype, **extra)
            except Exception:
                result[name] = {"error": "harness", "message": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

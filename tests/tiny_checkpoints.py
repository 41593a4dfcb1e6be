"""Tiny ``config.json`` checkpoints (no weights) for tests that build real sglang configs.

Shared by every test that needs a ``ModelConfig``: a DeepSeek-V4 config shaped
like V4-Flash's indexer (128-dim index keys, 64 index heads, C4 layers) but
with few layers, and a DeepSeek-V4.1 config (the same plus ratio-1/2 layers with
their kv and index source layers). The non-DSV4 checkpoint of the refusal paths is
``harness.tiny_model.write_tiny_llama``.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_dsv4(dirpath: Path, num_layers: int = 4) -> Path:
    """A DeepSeek-V4 checkpoint directory with a config.json only."""
    dirpath.mkdir(parents=True, exist_ok=True)
    ratios = [4 if i % 2 == 0 else 128 for i in range(num_layers)] + [0]
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": 1024,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "sliding_window": 128,
        "hc_mult": 4,
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": None,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 512,
        "compress_ratios": ratios,
        "vocab_size": 1024,
        "max_position_embeddings": 65536,
        "torch_dtype": "bfloat16",
    }
    (dirpath / "config.json").write_text(json.dumps(config))
    return dirpath


# Tiny V4.1: one layer of each compress ratio V4.1 has, ratio-1/2 pairs whose first
# layer owns the compressed KV and the fp4 indexer, then the MTP slot (ratio 0).
DSV41_COMPRESS_RATIOS = [4, 1, 1, 2, 2, 128]
DSV41_SOURCE_LAYERS = [1, 3]


def write_tiny_dsv41(dirpath: Path) -> Path:
    """A DeepSeek-V4.1 checkpoint directory with a config.json only, as V4.1 ships it
    (architecture ``DeepseekV41ForCausalLM``, model_type ``deepseek_v41``)."""
    write_tiny_dsv4(dirpath, num_layers=len(DSV41_COMPRESS_RATIOS))
    config = json.loads((dirpath / "config.json").read_text())
    config.update(
        architectures=["DeepseekV41ForCausalLM"],
        model_type="deepseek_v41",
        compress_ratios=DSV41_COMPRESS_RATIOS + [0],
        kv_source_layer_ids=DSV41_SOURCE_LAYERS,
        index_source_layer_ids=DSV41_SOURCE_LAYERS,
    )
    (dirpath / "config.json").write_text(json.dumps(config))
    return dirpath


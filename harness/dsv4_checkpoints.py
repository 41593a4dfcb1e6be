"""The DeepSeek-V4 checkpoints the GPU serving runs load with ``--load-format dummy`` (config.json only).

``tiny``: the smallest model upstream's DSV4 checks accept on Hopper (head_dim 512 with 64 rope dims,
window 128, 64 query heads for FlashMLA at TP=1, 64 index heads of 128, top-512), 4 layers whose
compress ratios give two C4 layers (the ones with an indexer), one C128 and one SWA-only layer.

``hicache``: ``tiny``'s dimensions with eight layers, six of them C4, so that a HiCache storm moves many
index-K pages per token it loads back.

``flash12``: DeepSeek-V4-Flash's own attention and indexer dimensions (hidden 4096, 64 heads, q/o LoRA
ranks 1024, 8 output groups, 64 index heads, window 128, YaRN x16 over 65536) and its layer pattern
(two SWA-only layers, then C4 and C128 alternating) cut to 12 layers, with 8 routed experts of Flash's
width (2048) instead of 256, so that the GPU work of attention and the indexer dominates a step while
the weights stay small. Flash has 43 layers, 256 experts and top-6 routing.

Upstream reads ``num_hash_layers`` (the config class's own field is ``n_hash_layers``): both are set.
No ``quantization_config``: bf16 dummy weights; the launch sets ``SGLANG_DSV4_FP4_EXPERTS=0`` so the
routed experts stay bf16 too.
"""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 448,
    "v_head_dim": 512,
    "kv_lora_rank": 512,
    "sliding_window": 128,
    "window_size": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

_TINY = {
    "hidden_size": 1024,
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 512,
    "o_groups": 8,
    "num_hidden_layers": 4,
    "compress_ratios": [0, 4, 128, 4, 0],
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "num_hash_layers": 1,
    "n_hash_layers": 1,
    "vocab_size": 1024,
}

MODELS = {
    "tiny": _TINY,
    # tiny's dimensions, six C4 layers: six index-K pages move with every 256 prefix tokens
    "hicache": {**_TINY, "num_hidden_layers": 8, "compress_ratios": [0, 4, 4, 4, 4, 4, 4, 128, 0]},
    "flash12": {
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "num_hidden_layers": 12,
        "compress_ratios": [0, 0] + [4, 128] * 5 + [0],
        "n_routed_experts": 8,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "num_hash_layers": 3,
        "n_hash_layers": 3,
        "vocab_size": 129280,
    },
}


def config(name: str) -> dict:
    """The config.json of model ``name`` (see the module doc)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return {**_COMMON, **MODELS[name]}


def c4_layers(name: str) -> int:
    """Layers with a C4 indexer (compress ratio 4) in model ``name``."""
    cfg = config(name)
    return sum(1 for r in cfg["compress_ratios"][: cfg["num_hidden_layers"]] if r == 4)


def write(name: str, root: Path) -> Path:
    """Write ``root/<name>/config.json``; returns the checkpoint directory."""
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config(name), indent=1) + "\n")
    return path


def write_all(root: Path) -> list[Path]:
    return [write(name, root) for name in MODELS]

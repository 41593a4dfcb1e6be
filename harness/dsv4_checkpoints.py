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

``flash_share``: Flash's per-layer proportions (its attention and indexer widths, top-6 of experts 2048
wide plus one shared, its layer pattern) with as many layers as one 80 GB GPU holds for the three servers
of the ``longctx`` set at once with bf16 dummy weights: :func:`flash_share_counts` counts each layer's
bytes (:func:`weight_bytes`) and keeps the three servers' weights within 60% of 80 GB, the rest for their
pools, activations and graphs. It comes to 20 layers (two SWA-only, nine C4, nine C128) and 8 routed
experts, 15.9 GB a server. Layers are kept before experts: a token's FLOPs per layer do not depend on
how many experts it chooses from (six and the shared one either way), while the share of C4 layers (the
ones with an indexer) does depend on the count: 9 of 20 here, 21 of 43 in Flash, 5 of 12 in
``flash12``. What is cut: 23 layers and 248 of 256 experts (a decode batch reads 8 experts' weights a
layer where Flash's would read up to 256 of its mxfp4 ones).

:data:`FLASH` is the full DeepSeek-V4-Flash config (not a checkpoint: its bf16 weights do not fit), the
reference of the long-context panel's analytic shares.

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

def layer_pattern(layers: int) -> list[int]:
    """Flash's compress ratios for ``layers`` layers: two SWA-only (0), then C4 and C128 alternating, and the
    trailing entry (0) of the next-token layer."""
    return ([0, 0] + [4, 128] * layers)[:layers] + [0]


FLASH = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "num_hidden_layers": 43,
    "compress_ratios": layer_pattern(43),
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "n_hash_layers": 3,
    "vocab_size": 129280,
}

GPU_BYTES = 80e9
WEIGHT_SHARE = 0.6  # of one GPU, for the weights of the three servers that share it
SHARE_SERVERS = 3
SHARE_EXPERTS = 8


def layer_params(cfg: dict, ratio: int) -> int:
    """Parameters of one layer of ``cfg`` with compress ratio ``ratio``: attention (wq_a, wkv, wq_b, the
    grouped wo_a, wo_b), the compressor (``2 * coff * head_dim`` wide, coff 2 for C4), the C4 indexer (wq_b,
    weights_proj, its compressor of index_head_dim), the routed and shared experts (three ``hidden x
    moe_intermediate`` matrices each) and the router. Norms, sinks and the hyper-connection mixes (under
    0.1% of a layer) are left out."""
    h, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, o, groups = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    p = h * q + h * hd + q * heads * hd + heads * hd * o + groups * o * h
    if ratio:
        p += h * 2 * (2 if ratio == 4 else 1) * hd
    if ratio == 4:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        p += q * ih * idim + h * ih + h * 2 * 2 * idim
    experts = cfg["n_routed_experts"]
    return p + (experts + cfg["n_shared_experts"]) * 3 * h * cfg["moe_intermediate_size"] + h * experts


def weight_bytes(cfg: dict, bytes_per_param: int = 2) -> int:
    """Bytes of a config's weights in bf16: every layer (:func:`layer_params`), the embedding and the head."""
    cfg = {**_COMMON, **cfg}
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    params = sum(layer_params(cfg, r) for r in ratios) + 2 * cfg["vocab_size"] * cfg["hidden_size"]
    return params * bytes_per_param


def _flash_with(layers: int, experts: int) -> dict:
    return {**FLASH, "num_hidden_layers": layers, "compress_ratios": layer_pattern(layers),
            "n_routed_experts": experts}


def flash_share_counts(budget: float = GPU_BYTES * WEIGHT_SHARE, servers: int = SHARE_SERVERS,
                       experts: int = SHARE_EXPERTS) -> tuple[int, int]:
    """(layers, routed experts) of ``flash_share``: the most layers, an even count (as many C4 layers as
    C128), whose weights ``servers`` times over fit ``budget`` bytes with ``experts`` routed experts."""
    layers = 4
    def fits(n: int) -> bool:
        return n <= FLASH["num_hidden_layers"] and servers * weight_bytes(_flash_with(n, experts)) <= budget

    while fits(layers + 2):
        layers += 2
    return layers, experts


MODELS = {
    "tiny": _TINY,
    # tiny's dimensions, six C4 layers: six index-K pages move with every 256 prefix tokens
    "hicache": {**_TINY, "num_hidden_layers": 8, "compress_ratios": [0, 4, 4, 4, 4, 4, 4, 128, 0]},
    "flash12": _flash_with(12, 8),
    "flash_share": _flash_with(*flash_share_counts()),
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

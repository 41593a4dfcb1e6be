"""Memory planner: size the C4 indexer at 256 B/token when bf16 keys are in force.

Upstream's ``get_dsv4_indexer_bytes_per_token`` answers 132 (fp8) or 68 (fp4);
the DSV4 pool configurator budgets the C4 indexer with it, so without this hook
a bf16 pool would need 124 B/token/C4-layer more than planned and OOM at load.
``pool_configurator`` imports the function under its own name: HookRegistry
re-points that binding when it applies the hook (verified in tests/index_k).
The fp4 request (the DSV4.1 low-ratio pools, forced fp4) is never changed.
"""

from __future__ import annotations

from dsv4_sm120.index_k import gate

TARGET = "sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token"


def indexer_bytes_per_token(original, index_head_dim, use_fp4_indexer, *args, **kwargs):
    """AROUND hook: 2 B per index value under ``--model-impl dsv4`` with bf16 keys."""
    if use_fp4_indexer or not gate.bf16_for(gate.published_model_impl()):
        return original(index_head_dim, use_fp4_indexer, *args, **kwargs)
    return index_head_dim * 2

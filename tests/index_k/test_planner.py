"""Memory planner: the planned token capacity for a fixed budget, by hand, for fp8 and bf16 keys."""

from __future__ import annotations


import pytest

import pool_harness

PAGE = 256
C4_LAYER_COUNT = 2  # tiny checkpoint: compress ratios [4, 128, 4, 128]


def _planner(checkpoint, dtype, monkeypatch):
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", dtype)
    return create_memory_pool_configurator(pool_harness.configurator(checkpoint, "dsv4"))


@pytest.mark.parametrize("dtype, index_bytes", [("fp8", 132), ("bf16", 256)])
def test_planned_capacity_matches_hand_calculation(checkpoint, hooked, monkeypatch, dtype, index_bytes):
    planner = _planner(checkpoint, dtype, monkeypatch)
    budget = pool_harness.BUDGET_BYTES
    assert planner.indexer_bytes_per_token == index_bytes

    # Everything but the C4 indexer is upstream's and the same for both dtypes:
    # the per-token KV bytes of every layer, and the fixed (per-request) pools.
    kv_bytes_per_token = planner.bytes_per_full_token - C4_LAYER_COUNT * planner.indexer_bytes_per_token / 4
    reqs = planner._resolve_max_running_requests_per_worker(budget)
    fixed = (planner._get_c128_state_fixed_bytes(reqs) + planner._get_c2_state_fixed_bytes(reqs)
             + planner._get_swa_fixed_bytes() + planner._fixed_swa_bytes(reqs) + planner._fixed_c4_state_bytes(reqs))

    # By hand: each full token adds one compressed key every 4 tokens on each C4 layer.
    per_token = kv_bytes_per_token + C4_LAYER_COUNT * index_bytes / 4
    expected = int((budget - fixed) / per_token) // PAGE * PAGE
    config = planner.calculate_pool_sizes(budget, PAGE)
    assert config.full_max_total_num_tokens == expected
    assert config.c4_max_total_num_tokens == expected // 4


def test_bf16_costs_exactly_the_larger_keys(checkpoint, hooked, monkeypatch):
    fp8, bf16 = (_planner(checkpoint, d, monkeypatch) for d in ("fp8", "bf16"))
    assert bf16.bytes_per_full_token - fp8.bytes_per_full_token == C4_LAYER_COUNT * (256 - 132) / 4
    assert bf16.low_ratio_index_bytes == fp8.low_ratio_index_bytes == 68  # fp4 low-ratio pools untouched


def test_allocation_fits_the_plan(built):
    """The bf16 pool the plan sized holds 256 B per compressed token plus upstream's reserved page only."""
    result = built("dsv4", "bf16")
    compressed_tokens = result.full_max_total_num_tokens // 4
    # Upstream reserves one logical page (256 slot indices) for the allocator's
    # dummy page, for fp8 too: ceil((size + 256) / 64) physical pages.
    pages = -(-(compressed_tokens + 256) // 64)
    for rows in result.token_to_kv_pool.c4_indexer_kv_pool.index_k_with_scale_buffer:
        assert rows.nbytes == pages * 16384
        assert rows.nbytes - compressed_tokens * 256 <= 256 * 256 + 16384

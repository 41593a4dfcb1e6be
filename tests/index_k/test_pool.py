"""The real DSV4 pool, built by upstream's configure() on CPU, with bf16 and fp8 index keys."""

from __future__ import annotations

import pytest
import torch

from dsv4_sm120.index_k import layout

C4_LAYERS = (0, 2)  # tiny checkpoint: compress ratios [4, 128, 4, 128]


def _index_pool(result):
    return result.token_to_kv_pool.c4_indexer_kv_pool


def test_planner_binding_is_hooked(hooked):
    from sglang.srt.mem_cache import deepseek_v4_memory_pool as memory_pool
    from sglang.srt.model_executor import pool_configurator

    hooked_fn = memory_pool.get_dsv4_indexer_bytes_per_token
    assert hasattr(hooked_fn, "__wrapped__"), "HookRegistry did not wrap get_dsv4_indexer_bytes_per_token"
    # pool_configurator imported the function by name; HookRegistry must have re-pointed it.
    assert pool_configurator.get_dsv4_indexer_bytes_per_token is hooked_fn


def test_bf16_pool_layout(built):
    from dsv4_sm120.index_k.pool import BF16IndexKPool, DSV4SM120TokenToKVPool

    result = built("dsv4", "bf16")
    kv = result.token_to_kv_pool
    index_pool = _index_pool(result)
    assert type(kv) is DSV4SM120TokenToKVPool and type(index_pool) is BF16IndexKPool
    assert index_pool.get_bytes_per_token() == 256 and index_pool.page_size == layout.SLOTS_PER_PAGE
    c4_pages = kv.c4_kv_pool.kv_buffer[0].shape[0]
    for rows in index_pool.index_k_with_scale_buffer:
        # Same page count as the C4 KV pool: PD and HiCache address both by page.
        assert rows.dtype == torch.uint8 and tuple(rows.shape) == (c4_pages, 16384)
    assert c4_pages * layout.SLOTS_PER_PAGE >= index_pool.size, "pages must cover every compressed slot"
    pages = kv.index_k_pages_bf16(C4_LAYERS[1])
    assert pages.dtype == torch.bfloat16 and tuple(pages.shape) == (c4_pages, 64, 128)
    assert pages.data_ptr() == index_pool.index_k_with_scale_buffer[1].data_ptr(), "a view, not a copy"
    assert kv.pd_kv_layout() == "v4,c4:v4,c128:v4,index_k:bf16"


def test_bf16_pd_registration_uses_real_item_lengths(built):
    kv = built("dsv4", "bf16").token_to_kv_pool
    ptrs, lens, items = kv.get_contiguous_buf_infos()
    rows = _index_pool(built("dsv4", "bf16")).index_k_with_scale_buffer
    for buf in rows:
        i = ptrs.index(buf.data_ptr())
        assert (lens[i], items[i]) == (buf.nbytes, 16384)


def test_fp8_is_upstream_byte_for_byte(built):
    """fp8 under --model-impl dsv4 against upstream's own pool, built side by side."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool

    ours, upstream = built("dsv4", "fp8"), built("sglang", "fp8")
    assert type(_index_pool(ours)) is DeepSeekV4IndexerPool
    assert ours.max_total_num_tokens == upstream.max_total_num_tokens
    assert ours.memory_pool_config == upstream.memory_pool_config
    a, b = ours.token_to_kv_pool, upstream.token_to_kv_pool
    assert a.pd_kv_layout() == b.pd_kv_layout() == "v4,c4:v4,c128:v4"
    for infos in ("get_contiguous_buf_infos", "get_state_buf_infos", "get_request_state_buf_infos"):
        assert getattr(a, infos)()[1:] == getattr(b, infos)()[1:], infos
    for x, y in zip(_index_pool(ours).index_k_with_scale_buffer, _index_pool(upstream).index_k_with_scale_buffer):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    assert _index_pool(ours).get_bytes_per_token() == 132


def test_switch_does_not_reach_other_model_impls(built):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool, DeepSeekV4TokenToKVPool

    plain = built("sglang", "bf16")
    assert type(plain.token_to_kv_pool) is DeepSeekV4TokenToKVPool
    assert type(_index_pool(plain)) is DeepSeekV4IndexerPool
    assert plain.max_total_num_tokens == built("sglang", "fp8").max_total_num_tokens


def test_set_then_read_follows_the_page_contract(built):
    kv = built("dsv4", "bf16").token_to_kv_pool
    layer = C4_LAYERS[0]
    num_slots = kv.index_k_pages_bf16(layer).shape[0] * 64
    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([0, 1, 63, 64, 127, 128, num_slots - 1], dtype=torch.int64)
    keys = torch.randn(len(slots), 128, generator=gen).to(torch.bfloat16)
    kv.set_index_k_bf16(layer, slots, keys)
    pages, rows = kv.index_k_pages_bf16(layer), kv.index_k_page_rows(layer)
    for slot, key in zip(slots.tolist(), keys):
        page, offset = layout.slot_address(slot)
        assert torch.equal(pages[page, slot % 64], key)
        assert torch.equal(rows[page, offset : offset + 256], key.view(torch.uint8))
    other = kv.index_k_pages_bf16(C4_LAYERS[1])
    assert not other.view(torch.uint8).any(), "a write to one layer leaked into another"


def test_a_layers_bf16_page_view_is_made_once_and_follows_its_buffer(built):
    """The C4 indexer asks for a layer's bf16 pages twice a step: the same view each time (made once: the kernels'
    plans then find its layout by identity), one per layer, seeing every write, and made anew if upstream gives
    the layer another buffer."""
    kv = built("dsv4", "bf16").token_to_kv_pool
    first, second = kv.index_k_pages_bf16(C4_LAYERS[0]), kv.index_k_pages_bf16(C4_LAYERS[1])
    assert kv.index_k_pages_bf16(C4_LAYERS[0]) is first and second is not first
    kv.set_index_k_bf16(C4_LAYERS[0], torch.tensor([5]), torch.ones(1, 128, dtype=torch.bfloat16))
    assert torch.equal(first.view(-1, 128)[5], torch.ones(128, dtype=torch.bfloat16))
    pool = kv.index_pools[4]
    local = kv.layer_mapping[C4_LAYERS[0]].compress_layer_id
    pool.index_k_with_scale_buffer[local] = pool.index_k_with_scale_buffer[local].clone()
    fresh = kv.index_k_pages_bf16(C4_LAYERS[0])
    assert fresh is not first and fresh.data_ptr() == pool.index_k_with_scale_buffer[local].data_ptr()


class _PendingLoad:
    """Stands in for HiCache's LayerDoneCounter, whose events are CUDA events.

    ``wait_until(i)`` is when the load of local layer ``i`` lands: it copies the
    bytes the host would have delivered into the device page, as the real H2D
    copy on the load stream would have by the time the event fires.
    """

    def __init__(self, kv, layer, page, payload):
        self.kv, self.layer, self.page, self.payload = kv, layer, page, payload
        self.waited = []

    def wait_until(self, threshold):
        self.waited.append(threshold)
        if threshold >= self.layer and self.payload is not None:
            self.kv.index_pools[4].index_k_with_scale_buffer[self.kv.layer_mapping[self.layer].compress_layer_id][
                self.page
            ] = self.payload
            self.payload = None


def test_readers_and_writer_wait_for_the_layer_load(built):
    kv = built("dsv4", "bf16").token_to_kv_pool
    layer, page = C4_LAYERS[1], 3
    landed = torch.full((16384,), 7, dtype=torch.uint8)
    kv.register_layer_transfer_counter(_PendingLoad(kv, layer, page, landed))
    try:
        assert torch.equal(kv.index_k_page_rows(layer)[page], landed), "read before the load landed"
        kv.layer_transfer_counter.payload = landed.clone().fill_(9)
        # A writer must not run before the load: the late load would overwrite its key.
        key = torch.ones(1, 128, dtype=torch.bfloat16)
        kv.set_index_k_bf16(layer, torch.tensor([page * 64 + 5]), key)
        assert torch.equal(kv.index_k_pages_bf16(layer)[page, 5], key[0])
        assert kv.layer_transfer_counter.waited == [layer] * 3  # one fence per access
    finally:
        kv.register_layer_transfer_counter(None)


def test_wrong_use_gets_a_clear_error(built):
    from dsv4_sm120.index_k.pool import IndexKLayoutError

    bf16 = built("dsv4", "bf16").token_to_kv_pool
    with pytest.raises(IndexKLayoutError, match="not a C4"):
        bf16.index_k_pages_bf16(1)
    with pytest.raises(IndexKLayoutError, match="bf16 keys"):
        bf16.set_index_k_bf16(0, torch.tensor([0]), torch.ones(1, 128, dtype=torch.float32))
    with pytest.raises(IndexKLayoutError, match="DSV4_SM120_INDEX_K_DTYPE"):
        bf16.get_index_k_with_scale_buffer(0)
    with pytest.raises(IndexKLayoutError, match="DSV4_SM120_INDEX_K_DTYPE=bf16"):
        built("dsv4", "fp8").token_to_kv_pool.index_k_pages_bf16(0)


def test_bf16_pool_needs_the_contract_geometry(hooked):
    from dsv4_sm120.index_k.pool import BF16IndexKPool, IndexKLayoutError

    pool = BF16IndexKPool(64 * 8, 64, torch.bfloat16, 128, 2, "cpu", False, global_page_size=256)
    # 512 slots plus upstream's reserved logical page (256 slot indices): 12 pages of 16384 B.
    assert tuple(pool.index_k_with_scale_buffer[0].shape) == (12, 16384)
    with pytest.raises(IndexKLayoutError, match="index_head_dim=128"):
        BF16IndexKPool(64 * 8, 64, torch.bfloat16, 64, 2, "cpu", False, global_page_size=256)

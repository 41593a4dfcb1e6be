"""DeepSeek-V4.1 layouts under the bf16 index-key path: the evidence behind ``dsv4_sm120.model.v41.PIECES``.

Real parts: a tiny V4.1 ``config.json`` (``DeepseekV41ForCausalLM``, model_type
``deepseek_v41``, ratios 4/1/1/2/2/128 with kv and index source layers; no
weights) read by the pin's ``ModelConfig``; upstream's ``KVCacheConfigurator.configure()``,
its memory planner, the DSV4 pool, upstream's HiCache strategy registry and
stack builder, upstream's PD layout comparison. Replaced: the free-memory probe
(fixed budget, see ``pool_harness``) and ``cudaHostRegister`` (needs a CUDA
driver; host pinning off). On CPU ``select_dsv4_kv_layout`` gives the V4 main
layout, as on sm_90 and sm_120; the V41 layouts need SM100 or gfx950 and are not
built here. Nothing here runs a V4.1 forward: that piece is refused, not tested.
"""

from __future__ import annotations

import pytest
import torch

from tests.index_k import pool_harness
from tests.index_k.test_pd import _decode_manager, prefill_route  # noqa: F401 - the fixture is used below
from tests.tiny_checkpoints import DSV41_COMPRESS_RATIOS, write_tiny_dsv41

BUDGET = 128 << 20
LAYERS = len(DSV41_COMPRESS_RATIOS)
C4_LAYER, C1_LAYER, C2_LAYER = 0, 1, 3
PAGE = 256
FP8_V41 = "v4,c1:v4,c2:v4,c4:v4,c128:v4"
BF16_V41 = FP8_V41 + ",index_k:bf16"


@pytest.fixture(scope="module")
def ckpt41(tmp_path_factory):
    return write_tiny_dsv41(tmp_path_factory.mktemp("ckpt41") / "tiny-dsv41")


@pytest.fixture(scope="module")
def v41(ckpt41, hooked):
    """``v41(model_impl, dtype, hicache=False, checksum=False)``: (configure() result, HiCache stack, strategy)."""
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    class Tree:  # the radix tree only lends its component set and eviction callbacks
        components = {ComponentType.FULL: None, ComponentType.SWA: None}

    cache = {}

    def get(model_impl, dtype, hicache=False, checksum=False):
        key = model_impl, dtype, hicache, checksum
        if key not in cache:
            with pytest.MonkeyPatch.context() as mp:
                pool_harness.switches(mp, index_k_dtype=dtype, index_k_checksum=checksum)
                extra = {}
                if hicache:
                    mp.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
                    extra = dict(enable_hierarchical_cache=True, hicache_ratio=2.0,
                                 hicache_mem_layout="layer_first", hicache_io_backend="kernel")
                result = pool_harness.build(ckpt41, model_impl, BUDGET, LAYERS, **extra)
                stack = strategy = None
                if hicache:
                    kv = result.token_to_kv_pool
                    params = CacheInitParams(disable=False, req_to_token_pool=result.req_to_token_pool,
                                             token_to_kv_pool_allocator=result.token_to_kv_pool_allocator,
                                             page_size=PAGE)
                    strategy = hybrid_pool_assembler._select_strategy(kv, set(Tree.components))
                    stack = strategy.build(cache=Tree(), kvcache=kv, params=params,
                                           server_args=runtime_context.get_server_args(), load_cache_event=None)
            cache[key] = result, stack, strategy
        return cache[key]

    return get


def _host_pools(stack) -> dict:
    return {str(e.name): e.host_pool for e in stack.host_pool_group.entries}


def test_the_pin_reads_a_v41_checkpoint_as_dsv4(ckpt41):
    """Why a verdict is needed: upstream's normalisation makes V4.1 pass ``is_deepseek_v4``."""
    from sglang.srt.configs.model_config import ModelConfig, is_deepseek_v4

    from dsv4_sm120.model import v41

    hf = ModelConfig(str(ckpt41), model_impl="dsv4").hf_config
    assert hf.architectures == ["DeepseekV4ForCausalLM"] and hf.model_type == "deepseek_v41"
    assert is_deepseek_v4(hf) and v41.is_deepseek_v41(hf)
    assert list(hf.kv_source_layer_ids) == [C1_LAYER, C2_LAYER]


def test_bf16_c4_pool_sits_next_to_upstreams_fp4_low_ratio_pools(v41):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DSV41_INDEX_PAGE_SIZE, DeepSeekV4IndexerPool

    from dsv4_sm120.index_k.pool import BF16IndexKPool, DSV4SM120TokenToKVPool, IndexKLayoutError

    kv = v41("dsv4", "bf16")[0].token_to_kv_pool
    upstream = v41("sglang", "fp8")[0].token_to_kv_pool
    assert type(kv) is DSV4SM120TokenToKVPool and type(kv.index_pools[4]) is BF16IndexKPool
    c4_pages = kv.c4_kv_pool.kv_buffer[0].shape[0]
    assert [tuple(r.shape) for r in kv.index_pools[4].index_k_with_scale_buffer] == [(c4_pages, 16384)]
    for ratio in (1, 2):
        ours, theirs = kv.index_pools[ratio], upstream.index_pools[ratio]
        assert type(ours) is type(theirs) is DeepSeekV4IndexerPool
        assert ours.use_fp4_indexer and ours.index_k_rne and ours.get_bytes_per_token() == 68
        assert ours.page_size == theirs.page_size == DSV41_INDEX_PAGE_SIZE
        assert [r.shape[1] for r in ours.index_k_with_scale_buffer] == [DSV41_INDEX_PAGE_SIZE * 68]
    # The bf16 accessors reach the C4 layer only; the ratio-1 layer keeps upstream's fp4 accessor.
    assert kv.index_k_pages_bf16(C4_LAYER).shape[1:] == (64, 128)
    with pytest.raises(IndexKLayoutError, match="not a C4"):
        kv.index_k_pages_bf16(C1_LAYER)
    low = kv.get_index_k_with_scale_buffer(C1_LAYER)
    assert low.data_ptr() == kv.index_pools[1].index_k_with_scale_buffer[0].data_ptr()


def test_planner_sizes_c4_at_256_and_leaves_the_fp4_pools_at_68(ckpt41, hooked, monkeypatch):
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    planners = {}
    for dtype in ("fp8", "bf16"):
        pool_harness.switches(monkeypatch, index_k_dtype=dtype)
        planners[dtype] = create_memory_pool_configurator(
            pool_harness.configurator(ckpt41, "dsv4", BUDGET, LAYERS))
    fp8, bf16 = planners["fp8"], planners["bf16"]
    assert (fp8.indexer_bytes_per_token, bf16.indexer_bytes_per_token) == (132, 256)
    assert fp8.low_ratio_index_bytes == bf16.low_ratio_index_bytes == 68
    # One C4 layer: each full token adds a quarter of one compressed key's extra 124 B.
    assert bf16.bytes_per_full_token - fp8.bytes_per_full_token == (256 - 132) / 4
    # By hand, as for V4: each full token adds a quarter key on the one C4 layer; everything
    # else (SWA, C128, the ratio-1/2 KV and their fp4 keys, the fixed pools) is upstream's.
    for planner, index_bytes in ((fp8, 132), (bf16, 256)):
        other_bytes = planner.bytes_per_full_token - planner.indexer_bytes_per_token / 4
        reqs = planner._resolve_max_running_requests_per_worker(BUDGET)
        fixed = (planner._get_c128_state_fixed_bytes(reqs) + planner._get_c2_state_fixed_bytes(reqs)
                 + planner._get_swa_fixed_bytes() + planner._fixed_swa_bytes(reqs)
                 + planner._fixed_c4_state_bytes(reqs))
        room = BUDGET - fixed
        expected = int(room / (other_bytes + index_bytes / 4)) // PAGE * PAGE
        # Then whole pages come off until the ratio-1/2 reserved pages fit too: one full page of
        # main KV per source layer, and fp4 index keys up to the index pool's last page.
        while expected * (other_bytes + index_bytes / 4) + _low_ratio_padding(planner, expected) > room:
            expected -= PAGE
        plan = planner.calculate_pool_sizes(BUDGET, PAGE)
        assert plan.full_max_total_num_tokens == expected
        assert plan.c4_max_total_num_tokens == expected // 4
    assert fp8.bytes_per_full_token - fp8.indexer_bytes_per_token / 4 == pytest.approx(
        bf16.bytes_per_full_token - bf16.indexer_bytes_per_token / 4)


def _low_ratio_padding(planner, full_tokens: int) -> int:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DSV41_INDEX_PAGE_SIZE as IP

    padding = 0
    for ratio in (1, 2):  # one source layer each in the tiny checkpoint
        index_slots = -(-((full_tokens + PAGE) // ratio + IP) // IP) * IP
        padding += PAGE * planner._get_paged_kv_bytes_per_token(ratio) + (index_slots - full_tokens // ratio) * 68
    return padding


def test_allocation_fits_the_plan(v41):
    result = v41("dsv4", "bf16")[0]
    kv = result.token_to_kv_pool
    compressed = result.full_max_total_num_tokens // 4
    pages = -(-(compressed + PAGE) // 64)  # upstream's reserved logical page, as for V4
    assert [r.nbytes for r in kv.index_pools[4].index_k_with_scale_buffer] == [pages * 16384]
    full = result.full_max_total_num_tokens
    for ratio in (1, 2):  # upstream's fp4 pools, sized as the planner padded them
        ip = kv.index_pools[ratio].page_size
        low_pages = -(-((full + PAGE) // ratio + ip) // ip)
        assert [r.nbytes for r in kv.index_pools[ratio].index_k_with_scale_buffer] == [low_pages * ip * 68]
    allocated = sum(t.nbytes for t in _all_pool_tensors(kv))
    assert allocated <= BUDGET, f"{allocated} B allocated for a {BUDGET} B plan"


def _all_pool_tensors(kv):
    pools = [*kv.kv_pools.values(), *kv.index_pools.values(), kv.swa_kv_pool]
    for pool in pools:
        for name in ("kv_buffer", "index_k_with_scale_buffer"):
            yield from (getattr(pool, name, None) or [])


def test_pd_layout_carries_the_tag_and_registers_bf16_c4_rows_only(v41):
    kv = v41("dsv4", "bf16")[0].token_to_kv_pool
    upstream = v41("sglang", "fp8")[0].token_to_kv_pool
    assert (kv.pd_kv_layout(), upstream.pd_kv_layout()) == (BF16_V41, FP8_V41)
    ours, theirs = kv.get_contiguous_buf_infos()[2], upstream.get_contiguous_buf_infos()[2]
    # Same wire order and items; only the C4 indexer item grows from 64 x 132 B to 64 x 256 B.
    assert ours == [16384 if item == 8448 else item for item in theirs]
    assert theirs.count(8448) == 1


@pytest.mark.parametrize("prefill, decode", [(BF16_V41, FP8_V41), (FP8_V41, BF16_V41)])
def test_pd_handshake_refuses_bf16_against_fp8_on_v41(hooked, prefill_route, prefill, decode):  # noqa: F811
    from dsv4_sm120.index_k.pd import IndexKLayoutMismatch

    with pytest.raises(IndexKLayoutMismatch, match="DSV4_SM120_INDEX_K_DTYPE"):
        _decode_manager(decode).try_ensure_parallel_info(prefill_route(prefill))
    addr = prefill_route(decode)
    assert _decode_manager(decode).try_ensure_parallel_info(addr) is True


def test_hicache_mirrors_bf16_c4_and_keeps_upstreams_low_ratio_mirrors(v41):
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    from dsv4_sm120.index_k.hicache import _host_pool_class, _strategy_class

    _, stack, strategy = v41("dsv4", "bf16", hicache=True)
    _, up_stack, up_strategy = v41("sglang", "fp8", hicache=True)
    assert type(strategy) is _strategy_class() and type(up_strategy) is not _strategy_class()
    ours, theirs = _host_pools(stack), _host_pools(up_stack)
    assert ours.keys() == theirs.keys()
    c4 = ours["deepseek_v4_c4_indexer"]
    assert type(c4) is _host_pool_class() and c4.item_bytes == 16384 and c4.page_aligned_only
    for name in ("deepseek_v4_c1", "deepseek_v4_c1_indexer", "deepseek_v4_c2", "deepseek_v4_c2_indexer"):
        assert type(ours[name]) is type(theirs[name]) is DeepSeekV4PagedHostPool, name
        assert (ours[name].item_bytes, ours[name].page_aligned_only) == (
            theirs[name].item_bytes, theirs[name].page_aligned_only), name


def test_integrity_mode_checksums_the_bf16_c4_pages_only(v41):
    from sglang.srt.disaggregation.base.conn import KVArgs

    from dsv4_sm120.index_k.hicache import _host_pool_class
    from dsv4_sm120.index_k.pd_integrity import index_k_buffers

    result, stack, _ = v41("dsv4", "bf16", hicache=True, checksum=True)
    kv = result.token_to_kv_pool
    # HiCache: only the C4 indexer mirror carries a checksum ledger.
    ledgers = {name for name, pool in _host_pools(stack).items() if getattr(pool, "index_k_ledger", None)}
    assert ledgers == {"deepseek_v4_c4_indexer"}
    assert sum(type(p) is _host_pool_class() for p in _host_pools(stack).values()) == 1
    # PD: the buffers checksummed are exactly the C4 indexer's page rows (c1/c2 items: 17408/8704 B).
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = kv.get_contiguous_buf_infos()
    args.kv_layout = kv.pd_kv_layout()
    picked = [args.kv_data_ptrs[i] for i in index_k_buffers(args)]
    assert picked == [r.data_ptr() for r in kv.index_pools[4].index_k_with_scale_buffer]


def test_fp8_route_is_upstream_on_v41(v41):
    """``DSV4_SM120_INDEX_K_DTYPE=fp8`` with --model-impl dsv4: the plan, pools, PD layout and HiCache stack are upstream's."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _DeepSeekV4Strategy

    (ours, stack, strategy), (theirs, up_stack, _) = v41("dsv4", "fp8", hicache=True), v41("sglang", "fp8", hicache=True)
    assert ours.memory_pool_config == theirs.memory_pool_config
    a, b = ours.token_to_kv_pool, theirs.token_to_kv_pool
    assert a.pd_kv_layout() == b.pd_kv_layout() == FP8_V41
    for infos in ("get_contiguous_buf_infos", "get_state_buf_infos", "get_request_state_buf_infos"):
        assert getattr(a, infos)()[1:] == getattr(b, infos)()[1:], infos
    for ratio in (4, 1, 2):
        x, y = a.index_pools[ratio], b.index_pools[ratio]
        assert type(x) is type(y) and x.get_bytes_per_token() == y.get_bytes_per_token()
        for p, q in zip(x.index_k_with_scale_buffer, y.index_k_with_scale_buffer):
            assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)
    assert type(strategy) is _DeepSeekV4Strategy
    pools, up_pools = _host_pools(stack), _host_pools(up_stack)
    assert {n: (type(p), getattr(p, "item_bytes", None)) for n, p in pools.items()} == {
        n: (type(p), getattr(p, "item_bytes", None)) for n, p in up_pools.items()}


def test_fp8_route_has_no_integrity_mode_on_v41(v41):
    """With fp8 keys the checksum switch finds no bf16 page to check, on HiCache or PD, as upstream."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    from dsv4_sm120.index_k.pd_integrity import index_k_buffers

    result, stack, _ = v41("dsv4", "fp8", hicache=True, checksum=True)
    assert not any(getattr(p, "index_k_ledger", None) for p in _host_pools(stack).values())
    args = KVArgs()
    _, _, args.kv_item_lens = result.token_to_kv_pool.get_contiguous_buf_infos()
    args.kv_layout = result.token_to_kv_pool.pd_kv_layout()
    assert index_k_buffers(args) == []

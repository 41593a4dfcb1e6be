"""One sglang import per test process: the hooks are applied once, pools are built on demand."""

from __future__ import annotations

import pytest

from tests.index_k import pool_harness
from tests.index_k.pool_harness import HICACHE_RATIO, SLOTS_PER_FULL_PAGE


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return pool_harness.tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def hooked():
    """This area's hooks, applied through upstream's HookRegistry (as load_plugins does)."""
    pool_harness.apply_index_k_hooks()


@pytest.fixture(scope="session")
def built(checkpoint, hooked):
    """``built(model_impl, dtype)``: a real configure() result, cached per combination."""
    import os

    cache = {}

    def build(model_impl: str, dtype: str):
        if (model_impl, dtype) not in cache:
            old = os.environ.get("DSV4_SM120_INDEX_K_DTYPE")
            os.environ["DSV4_SM120_INDEX_K_DTYPE"] = dtype
            try:
                cache[model_impl, dtype] = pool_harness.build(checkpoint, model_impl)
            finally:
                if old is None:
                    os.environ.pop("DSV4_SM120_INDEX_K_DTYPE")
                else:
                    os.environ["DSV4_SM120_INDEX_K_DTYPE"] = old
        return cache[model_impl, dtype]

    return build


@pytest.fixture(scope="session")
def stacks(checkpoint, hooked):
    """``stacks(layout, dtype, checksum)``: (configure() result, StackBuildResult, strategy), cached.

    The HiCache stack as upstream's strategy registry builds it on the real pool;
    ``cudaHostRegister`` is replaced (it needs a CUDA driver), so host pinning is off.
    """
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    class Tree:  # the radix tree only lends its component set and eviction callbacks
        components = {ComponentType.FULL: None, ComponentType.SWA: None}

    cache = {}

    def get(layout, dtype="bf16", checksum=False):
        if (layout, dtype, checksum) not in cache:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("DSV4_SM120_INDEX_K_DTYPE", dtype)
                mp.setenv("DSV4_SM120_INDEX_K_CHECKSUM", "1" if checksum else "0")
                # Replaced: cudaHostRegister needs a CUDA driver (host pinning off).
                mp.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
                result = pool_harness.build(
                    checkpoint, "dsv4", enable_hierarchical_cache=True, hicache_ratio=HICACHE_RATIO,
                    hicache_mem_layout=layout, hicache_io_backend="kernel",
                )
                kv = result.token_to_kv_pool
                params = CacheInitParams(disable=False, req_to_token_pool=result.req_to_token_pool,
                                         token_to_kv_pool_allocator=result.token_to_kv_pool_allocator,
                                         page_size=SLOTS_PER_FULL_PAGE)
                strategy = hybrid_pool_assembler._select_strategy(kv, set(Tree.components))
                built = strategy.build(cache=Tree(), kvcache=kv, params=params,
                                       server_args=runtime_context.get_server_args(), load_cache_event=None)
            cache[layout, dtype, checksum] = result, built, strategy
        return cache[layout, dtype, checksum]

    return get

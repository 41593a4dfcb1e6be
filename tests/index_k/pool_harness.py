"""Build the real DeepSeek-V4 KV pool on CPU, the way a scheduler does.

A real ``ServerArgs(device="cpu")`` is published with sglang's own
``runtime_context.publish``, a real ``ModelConfig`` is read from a tiny DSV4
``config.json`` (no weights), and upstream's ``KVCacheConfigurator.configure()``
plans and allocates the pools. One thing is replaced: the free-memory probe,
because the planner's budget must be fixed for a hand calculation and this
machine's free memory moves with the other jobs on it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.tiny_checkpoints import write_tiny_dsv4

BUDGET_BYTES = 64 << 20
NUM_LAYERS = 4
SLOTS_PER_FULL_PAGE = 256  # HiCache indexes the C4 indexer region in FULL token slots
HICACHE_RATIO = 2.0


def publish(model_dir: Path, model_impl: str, **extra):
    """Publish a CPU ServerArgs; ``extra`` adds server arguments (e.g. the HiCache ones)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(model_dir), device="cpu", model_impl=model_impl,
                      skip_tokenizer_init=True, page_size=256, max_running_requests=8,
                      chunked_prefill_size=1024, kv_cache_dtype="fp8_e4m3", **extra)
    runtime_context.publish(args, role="scheduler")
    return args


def configurator(model_dir: Path, model_impl: str, budget_bytes: int = BUDGET_BYTES, num_layers: int = NUM_LAYERS,
                 **server_extra):
    """A published, ready ``KVCacheConfigurator`` whose memory probe answers ``budget_bytes``."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        SpecAuxHiddenStateConfig,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class FixedBudgetConfigurator(KVCacheConfigurator):
        # Replaced: the free-memory probe (see the module docstring).
        def _profile_available_bytes(self, pre_model_load_memory):
            return budget_bytes

    args = publish(model_dir, model_impl, **server_extra)
    model_config = ModelConfig.from_server_args(args)
    return FixedBudgetConfigurator(
        device="cpu", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None,
        model_config=model_config, server_args=args,
        kv_cache_dtype=torch.float8_e4m3fn, kv_cache_dtype_str="fp8_e4m3",
        model_dtype=torch.bfloat16, page_size=256, sliding_window_size=128,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=SpecAuxHiddenStateConfig(),
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        layer_info=ModelLayerInfo(start_layer=0, end_layer=num_layers, num_effective_layers=num_layers),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )


def build(model_dir: Path, model_impl: str, budget_bytes: int = BUDGET_BYTES, num_layers: int = NUM_LAYERS,
          **server_extra):
    """Plan and allocate through ``configure()``; returns its ``KVCacheConfigResult``."""
    return configurator(model_dir, model_impl, budget_bytes, num_layers, **server_extra).configure(
        pre_model_load_memory=0)


def build_stack(model_dir: Path, layout: str, mp):
    """A ``--model-impl dsv4`` pool with HiCache, and its stack as upstream's strategy registry builds it:
    (configure() result, StackBuildResult, strategy). ``cudaHostRegister`` is replaced through ``mp`` (it needs
    a CUDA driver), so host pinning is off."""
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    class Tree:  # the radix tree only lends its component set and eviction callbacks
        components = {ComponentType.FULL: None, ComponentType.SWA: None}

    mp.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
    result = build(model_dir, "dsv4", enable_hierarchical_cache=True, hicache_ratio=HICACHE_RATIO,
                   hicache_mem_layout=layout, hicache_io_backend="kernel")
    kv = result.token_to_kv_pool
    params = CacheInitParams(disable=False, req_to_token_pool=result.req_to_token_pool,
                             token_to_kv_pool_allocator=result.token_to_kv_pool_allocator,
                             page_size=SLOTS_PER_FULL_PAGE)
    strategy = hybrid_pool_assembler._select_strategy(kv, set(Tree.components))
    built = strategy.build(cache=Tree(), kvcache=kv, params=params, server_args=runtime_context.get_server_args(),
                           load_cache_event=None)
    return result, built, strategy


def tiny_checkpoint(tmp_dir: Path) -> Path:
    return write_tiny_dsv4(tmp_dir / "tiny-dsv4", num_layers=NUM_LAYERS)


def switches(mp, **values) -> None:
    """Through ``mp`` (a pytest MonkeyPatch): the settings this area's hooks decide from, as
    ``plugin.register`` hands them over in a server started with ``values`` (``index_k_dtype="fp8"``)."""
    from dsv4_sm120 import settings
    from dsv4_sm120.index_k import gate

    mp.setattr(gate, "_switches", dataclasses.replace(settings.load(), **values))


def apply_index_k_hooks() -> None:
    """Register this area's hooks and apply them with upstream's real HookRegistry, once."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_sm120 import settings
    from dsv4_sm120.index_k import hooks

    if any(t.startswith("sglang.srt.mem_cache.kv_cache_configurator") for t in HookRegistry._patched):
        return
    hooks.register(settings.load())
    HookRegistry.apply_hooks()

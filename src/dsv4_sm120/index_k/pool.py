"""The DeepSeek-V4 KV pool used under ``--model-impl dsv4``, and its bf16 index-K pool.

Upstream's C4 indexer pool stores fp8 keys with an fp32 scale per token; it has
no bf16 option. :class:`BF16IndexKPool` keeps upstream's pool machinery (page
count, memory-saver region, the ``[num_pages, page_row_bytes]`` uint8 page-row
buffer that PD registration and the HiCache mirror read) and changes only the
bytes per token, 256, with no scale section (see :mod:`.layout`).

:class:`DSV4SM120TokenToKVPool` is upstream's DSV4 pool with three changes, all
gated on ``DSV4_SM120_INDEX_K_DTYPE=bf16``: the C4 indexer pool comes from
upstream's override point ``_make_indexer_pool``; ``pd_kv_layout()`` carries the
index-K dtype; and the indexer reads and writes bf16 keys through
:meth:`~DSV4SM120TokenToKVPool.index_k_pages_bf16` and
:meth:`~DSV4SM120TokenToKVPool.set_index_k_bf16`, each behind upstream's
per-layer HiCache load fence ``wait_layer_transfer``. With ``fp8`` every method
is upstream's, so the pool is upstream's byte for byte.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
    DeepSeekV4IndexerPool,
    DeepSeekV4TokenToKVPool,
)

from dsv4_sm120.index_k import gate, layout


class IndexKLayoutError(RuntimeError):
    """An index-K access does not fit the layout the pool was built with."""


class BF16IndexKPool(DeepSeekV4IndexerPool):
    """C4 indexer pool with bf16 keys: page row = 64 slots x 256 B, no scales."""

    index_k_dtype = "bf16"

    def __init__(self, size, page_size, dtype, index_head_dim, layer_num, device,
                 enable_memory_saver, start_layer=None, end_layer=None, global_page_size=None):
        super().__init__(
            size, page_size, dtype, index_head_dim, layer_num, device, enable_memory_saver,
            start_layer, end_layer, use_fp4_indexer=False, global_page_size=global_page_size,
        )
        self._bf16_views: dict = {}  # local layer -> (its page rows, their bf16 view): see pages_bf16

    def get_bytes_per_token(self) -> int:
        return layout.BF16_BYTES_PER_TOKEN

    def _create_buffer(self):
        if self.index_head_dim != layout.INDEX_HEAD_DIM or self.page_size != layout.SLOTS_PER_PAGE:
            raise IndexKLayoutError(
                f"bf16 index keys need index_head_dim={layout.INDEX_HEAD_DIM} and "
                f"{layout.SLOTS_PER_PAGE} compressed slots per page (page size 256), got "
                f"index_head_dim={self.index_head_dim}, {self.page_size} slots per page; "
                f"set DSV4_SM120_INDEX_K_DTYPE=fp8 to keep upstream's fp8 keys for this model."
            )
        # Upstream allocates [num_pages, page_size * bytes_per_token] uint8 page rows.
        super()._create_buffer()

    def page_rows(self, local_layer: int) -> torch.Tensor:
        """uint8 [num_pages, 16384]: the buffer PD registers and HiCache mirrors."""
        return self.index_k_with_scale_buffer[local_layer]

    def pages_bf16(self, local_layer: int) -> torch.Tensor:
        """bf16 [num_pages, 64, 128] view of one layer's page rows (no copy), made once per layer buffer: the C4
        indexer asks for it twice a layer per step, and making the view took about 2 us of host time each (the
        kernels' plans then find its layout by identity, ``kernels.launch.lasting_key``)."""
        rows = self.page_rows(local_layer)
        kept = self._bf16_views.get(local_layer)
        if kept is None or kept[0] is not rows:  # first ask, or upstream made the layer's buffer anew
            kept = self._bf16_views[local_layer] = (
                rows, rows.view(torch.bfloat16).view(rows.shape[0], layout.SLOTS_PER_PAGE, layout.INDEX_HEAD_DIM))
        return kept[1]

    def write_slots(self, local_layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store ``keys`` (bf16 [n, 128]) at compressed ``slots`` (int64 [n])."""
        if keys.dtype != torch.bfloat16 or keys.ndim != 2 or keys.shape[1] != layout.INDEX_HEAD_DIM:
            raise IndexKLayoutError(
                f"set_index_k_bf16 takes bf16 keys of shape [n, {layout.INDEX_HEAD_DIM}], "
                f"got {keys.dtype} {tuple(keys.shape)}"
            )
        if slots.ndim != 1 or slots.shape[0] != keys.shape[0] or slots.dtype != torch.int64:
            raise IndexKLayoutError(
                f"set_index_k_bf16 takes int64 slot indices of shape [{keys.shape[0]}], "
                f"got {slots.dtype} {tuple(slots.shape)}"
            )
        flat = self.pages_bf16(local_layer).view(-1, layout.INDEX_HEAD_DIM)
        flat.index_copy_(0, slots, keys)

    def _fp8_only(self, name: str):
        raise IndexKLayoutError(
            f"{name} reads or writes upstream's fp8 key+scale layout, but this C4 indexer "
            f"pool holds bf16 keys (DSV4_SM120_INDEX_K_DTYPE=bf16); use index_k_pages_bf16 / "
            f"set_index_k_bf16, or set DSV4_SM120_INDEX_K_DTYPE=fp8 on every server."
        )

    def get_index_k_with_scale_buffer(self, layer_id):
        self._fp8_only("get_index_k_with_scale_buffer")

    def get_index_k_scale_buffer(self, *args, **kwargs):
        self._fp8_only("get_index_k_scale_buffer")

    def set_index_k_scale_buffer(self, *args, **kwargs):
        self._fp8_only("set_index_k_scale_buffer")

    def set_index_fused(self, *args, **kwargs):
        self._fp8_only("set_index_fused (compress_norm_rope_store)")

    def set_index_fp4(self, *args, **kwargs):
        self._fp8_only("set_index_fp4")

    def get_index_k_fp4(self, *args, **kwargs):
        self._fp8_only("get_index_k_fp4")

    def get_index_k_dequant(self, *args, **kwargs):
        self._fp8_only("get_index_k_dequant")


class DSV4SM120TokenToKVPool(DeepSeekV4TokenToKVPool):
    """Upstream's DSV4 KV pool; with bf16 index keys its C4 indexer pool is :class:`BF16IndexKPool`."""

    def __init__(self, *args, **kwargs):
        # Read before upstream's __init__, which builds the indexer pools through
        # _make_indexer_pool below.
        self.index_k_dtype = gate.index_k_dtype()
        super().__init__(*args, **kwargs)
        if self.index_k_dtype == "bf16":
            from dsv4_sm120.index_k import hicache

            hicache.register_stack_strategy()

    def _make_indexer_pool(self, size, page_size, dtype, index_head_dim, layer_num, device,
                           enable_memory_saver, force_fp4=False, global_page_size=None,
                           index_k_page8=False):
        # force_fp4 marks the DSV4.1 low-ratio (1/2) pools: upstream's fp4 layout stays.
        if self.index_k_dtype != "bf16" or force_fp4:
            return super()._make_indexer_pool(
                size, page_size, dtype, index_head_dim, layer_num, device, enable_memory_saver,
                force_fp4=force_fp4, global_page_size=global_page_size, index_k_page8=index_k_page8,
            )
        return BF16IndexKPool(
            size, page_size, dtype, index_head_dim, layer_num, device, enable_memory_saver,
            global_page_size=global_page_size,
        )

    def pd_kv_layout(self) -> str:
        base = super().pd_kv_layout()
        if isinstance(self.index_pools.get(4), BF16IndexKPool):
            return f"{base},{layout.PD_LAYOUT_TAG_BF16}"
        return base

    def _bf16_index_pool(self, layer_id: int) -> tuple[BF16IndexKPool, int]:
        item = self.layer_mapping[layer_id] if 0 <= layer_id < len(self.layer_mapping) else None
        if item is None or item.compress_ratio != 4:
            raise IndexKLayoutError(
                f"layer {layer_id} is not a C4 (compress ratio 4) layer of this pipeline stage; "
                f"only C4 layers have a lightning indexer"
            )
        pool = self.index_pools.get(4)
        if not isinstance(pool, BF16IndexKPool):
            raise IndexKLayoutError(
                f"the C4 indexer pool holds upstream's fp8 keys (DSV4_SM120_INDEX_K_DTYPE="
                f"{self.index_k_dtype}); the bf16 accessors need DSV4_SM120_INDEX_K_DTYPE=bf16"
            )
        return pool, item.compress_layer_id

    def index_k_page_rows(self, layer_id: int) -> torch.Tensor:
        """uint8 [num_pages, 16384] page rows of a C4 layer, after its HiCache load landed."""
        self.wait_layer_transfer(layer_id)
        pool, local = self._bf16_index_pool(layer_id)
        return pool.page_rows(local)

    def index_k_pages_bf16(self, layer_id: int) -> torch.Tensor:
        """bf16 [num_pages, 64, 128] view of a C4 layer's keys, after its HiCache load landed."""
        self.wait_layer_transfer(layer_id)
        pool, local = self._bf16_index_pool(layer_id)
        return pool.pages_bf16(local)

    def set_index_k_bf16(self, layer_id: int, slot_indices: torch.Tensor, keys: torch.Tensor) -> None:
        """Store bf16 keys [n, 128] at compressed slots [n], after the layer's HiCache load landed.

        Upstream's fp8 writers do not wait; a bf16 write to a page whose load-back
        is still in flight would be overwritten when the load lands, so this one does.
        """
        self.wait_layer_transfer(layer_id)
        pool, local = self._bf16_index_pool(layer_id)
        pool.write_slots(local, slot_indices, keys)

"""HiCache host mirror for bf16 index-K pages.

Upstream's DSV4 stack already mirrors the C4 indexer region row for row: the
host item is the device page row (``_dsv4_indexer_regions``), so the host pool
is a ``DeepSeekV4PagedHostPool`` with 16384-byte rows and the same host page
count as the C4 KV pool (upstream's ratio rules). What upstream gets wrong for
bf16 is the sub-page copy: a transfer that is not a whole number of pages goes
through ``transfer_cache_dsv4_mla``, a kernel hard-wired to one fixed token layout
(a 576 B value and an 8 B scale per token, ``hisparse.cuh``), which is neither a bf16
index-K row (256 B keys) nor anything it can be told about. On a bf16 row it would move
the wrong bytes, so
the bf16 mirror must refuse sub-page transfers (``page_aligned_only``), as
upstream's own fp4 indexer mirror does.

The strategy below is prepended through upstream's ``register_stack_strategy``;
it matches only a pool with bf16 C4 keys and otherwise builds exactly
upstream's DSV4 stack. It then adopts the built index-K host pool into
:class:`BF16IndexKHostPool`, a subclass that adds no state of upstream's and
only wraps the two transfer methods for integrity mode. Upstream reads
``page_aligned_only`` only at transfer time (and in ``__init__`` only on XPU,
for the sub-page kernel it now never calls), so setting it on the built host
pool is equivalent to building it so.
"""

from __future__ import annotations

import functools

from dsv4_sm120.index_k import gate, integrity, layout

_registered = False


class IndexKMirrorError(RuntimeError):
    """The host mirror built for the bf16 index-K region does not match the device rows."""


@functools.cache
def _strategy_class():
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _DeepSeekV4Strategy

    class BF16IndexKStackStrategy(_DeepSeekV4Strategy):
        """Upstream's DSV4 HiCache stack; its bf16 index-K mirror page-aligned only (and checksummed)."""

        def matches(self, kvcache, components):
            # BF16IndexKPool's class attribute (upstream's pools have none): read, not imported, since the
            # pool module registers this strategy and the two would import each other.
            pools = getattr(kvcache, "index_pools", None) or {}
            return getattr(pools.get(4), "index_k_dtype", None) == "bf16" and super().matches(kvcache, components)

        def build(self, **kwargs):
            result = super().build(**kwargs)
            host = result.host_pool_group.get_pool(PoolName.DEEPSEEK_V4_C4_INDEXER)
            check_mirror(host, kwargs["kvcache"].index_pools[4])
            adopt(host, checksum=gate.switches().index_k_checksum, kvcache=kwargs["kvcache"])
            return result

    return BF16IndexKStackStrategy


@functools.cache
def _host_pool_class():
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    class BF16IndexKHostPool(DeepSeekV4PagedHostPool):
        """Upstream's V4 paged host pool; in integrity mode it checksums pages out and notes their loads."""

        index_k_ledger = None

        def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
            # A transfer that is not whole pages goes straight to upstream, which refuses it (page_aligned_only).
            if (self.index_k_ledger is not None and self._has_transfer_indices(host_indices, device_indices)
                    and host_indices.numel() % self.slot_page_size == 0):
                ledger = self.index_k_ledger
                host_pages = integrity.on_device(ledger.device, self._to_page_indices(host_indices))
                device_pages = integrity.on_device(self.device_buffers[0].device, self._to_page_indices(device_indices))
                for layer, rows in enumerate(self.device_buffers):
                    ledger.record(layer, host_pages, rows, device_pages)
            return super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

        def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                     **kwargs):
            super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                             **kwargs)
            if self.index_k_ledger is not None and self._has_transfer_indices(host_indices, device_indices):
                # Checked where the C4 indexer reads the pages (integrity.PageLedger.check_reads), not here.
                self.index_k_ledger.note_load(layer_id, host_indices, device_indices, self.slot_page_size)

    return BF16IndexKHostPool


def adopt(host_pool, checksum: bool, kvcache=None) -> None:
    """Make the built index-K host pool page-aligned only, and checksummed in integrity mode.

    ``kvcache`` is the device KV pool: the ``LayerDoneCounter`` registered on it (the one its load
    fence waits on) ties each load to the forward that checks it.
    """
    host_pool.__class__ = _host_pool_class()
    host_pool.page_aligned_only = True
    if checksum:
        host_pool.index_k_ledger = integrity.LEDGER = integrity.PageLedger(
            host_pool.layer_num, host_pool.num_host_pages, host_pool.device_buffers[0].device,
            host_pool.pool_name, kvcache,
        )


def check_mirror(host_pool, device_pool) -> None:
    """Refuse a host mirror whose rows are not the bf16 device page rows."""
    rows = device_pool.index_k_with_scale_buffer
    problems = []
    if host_pool.item_bytes != layout.BF16_PAGE_ROW_BYTES:
        problems.append(f"host item is {host_pool.item_bytes} B, not {layout.BF16_PAGE_ROW_BYTES}")
    if len(host_pool.device_buffers) != len(rows) or any(
        a.data_ptr() != b.data_ptr() for a, b in zip(host_pool.device_buffers, rows)
    ):
        problems.append("its device buffers are not the bf16 pool's page rows")
    if problems:
        raise IndexKMirrorError(
            "HiCache host mirror of the bf16 index-K region is wrong: " + "; ".join(problems)
            + ". The installed sglang's DSV4 stack changed; run `dsv4-sm120 doctor`."
        )


def register_stack_strategy() -> None:
    """Prepend the bf16 strategy to upstream's registry once per process."""
    global _registered
    if _registered:
        return
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import register_stack_strategy as register

    register(_strategy_class()())
    _registered = True

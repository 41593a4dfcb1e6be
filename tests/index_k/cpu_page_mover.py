"""CPU stand-ins for the four HiCache page-row copy kernels of ``DeepSeekV4PagedHostPool``.

Upstream's copies (``sgl_kernel.kvcacheio``) are CUDA-only and are not even
imported on a CPU build, so the host pool's transfer methods cannot move bytes
here. These functions take the kernels' exact arguments and move the same
bytes with torch indexing, following the same page addressing: one index is
one page row, pointer tables hold one ``data_ptr`` per layer, ``page_first``
host buffers are ``[pages, layers, item]``. Everything else stays upstream's:
the host pool object, its allocator, ``backup_from_device_all_layer`` /
``load_to_device_per_layer`` dispatch, the page-alignment decision and the
token-to-page translation. The real kernels run on the GPU in the HiCache race
issue (#5). ``transfer_cache_dsv4_mla`` (the sub-page copy hard-wired to the fp8
row) is installed as a trap: a bf16 mirror must never reach it.
"""

from __future__ import annotations

import torch


class SubPageCopyCalled(AssertionError):
    """The fp8-row sub-page copy was used on a bf16 index-K mirror."""


def install(monkeypatch, host_pool) -> dict:
    """Install the stand-ins on ``memory_pool_host``; returns per-kernel call counts."""
    from sglang.srt.mem_cache import memory_pool_host

    tensors = {t.data_ptr(): t for t in [*host_pool.device_buffers, *host_pool.data_refs]}
    calls = {}

    def layers(ptr_table):
        return [tensors[int(p)] for p in ptr_table.tolist()]

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def rows(dst, dst_indices, src, src_indices):
        dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

    def all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
        for src, dst in zip(layers(src_layers)[:num_layers], layers(dst_layers)[:num_layers]):
            rows(dst, dst_indices, src, src_indices)

    def per_layer_mla(src, dst, src_indices, dst_indices, item_size):
        rows(dst, dst_indices, src, src_indices)

    def all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers):
        for layer, src in enumerate(layers(src_layers)[:num_layers]):
            rows(dst.select(1, layer), dst_indices, src, src_indices)

    def per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim):
        rows(dst, dst_indices, src.select(1, layer_id), src_indices)

    def sub_page_copy(*args, **kwargs):
        raise SubPageCopyCalled("transfer_cache_dsv4_mla would split a bf16 row as fp8 keys + scales")

    for name, fn in {
        "transfer_kv_all_layer_mla": all_layer_mla,
        "transfer_kv_per_layer_mla": per_layer_mla,
        "transfer_kv_all_layer_mla_lf_pf": all_layer_mla_lf_pf,
        "transfer_kv_per_layer_mla_pf_lf": per_layer_mla_pf_lf,
        "transfer_cache_dsv4_mla": sub_page_copy,
    }.items():
        monkeypatch.setattr(memory_pool_host, name, counted(name, fn), raising=False)
    return calls


def pages_to_slots(pages: torch.Tensor, slots_per_page: int) -> torch.Tensor:
    """HiCache indices are token slots in the FULL coordinate space, a page at a time."""
    return (pages[:, None] * slots_per_page + torch.arange(slots_per_page)).reshape(-1)

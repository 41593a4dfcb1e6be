"""CPU stand-ins for the HiCache page-row copy kernels of ``DeepSeekV4PagedHostPool``.

Upstream's copies for whole pages are ``sgl_kernel.kvcacheio`` ops (CUDA and C++ in the
sgl-kernel wheel, which needs ``libcuda.so.1`` to load) and are not even imported on a CPU
build, so the host pool's transfer methods cannot move bytes here. These functions take the
ops' exact arguments and move bytes the way the kernels address them, from the pointers
and sizes they are given, not from the tensors' shapes: item ``i`` of a layer-first buffer
is the ``item_size`` bytes at ``base + i * item_size``; in a page-first host buffer it is at
``base + i * layout_dim + layer * item_size``. So a host pool built with the wrong item
size or layout stride moves the wrong bytes here as it would on the GPU, and the round
trips fail. Everything else is upstream's: the host pool object, its allocator,
``backup_from_device_all_layer`` / ``load_to_device_per_layer`` dispatch, the
page-alignment decision and the token-to-page translation.

``transfer_cache_dsv4_mla`` (the token-granular copy, a CUDA JIT kernel hard-wired to the
main-KV token of 576 value + 8 scale bytes, from reading ``kvcacheio/hisparse.cuh``) is
installed as a trap: it cannot move a bf16 index-K token correctly, so a bf16 mirror must
refuse sub-page transfers before reaching it. Upstream's strategy does reach it.

Which of upstream's copies a bf16 page takes, per server flag, and which ran where:
the tests of tests/index_k/test_hicache.py.
"""

from __future__ import annotations

import torch


class SubPageCopyCalled(AssertionError):
    """The fp8-row sub-page copy was used on a bf16 index-K mirror."""


def install(monkeypatch, host_pool) -> dict:
    """Install the stand-ins on ``memory_pool_host``; returns per-kernel call counts."""
    from sglang.srt.mem_cache import memory_pool_host

    tensors = {t.data_ptr(): t for t in [*host_pool.device_buffers, *host_pool.data_refs]}
    if not isinstance(host_pool.kv_buffer, list):
        tensors[host_pool.kv_buffer.data_ptr()] = host_pool.kv_buffer
    calls = {}

    def flat(tensor):
        assert tensor.is_contiguous() and tensor.dtype == torch.uint8, "the kernels address contiguous bytes"
        return tensor.view(-1)

    def layers(ptr_table):
        return [tensors[int(p)] for p in ptr_table.tolist()]

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def copy(dst, dst_indices, dst_stride, dst_offset, src, src_indices, src_stride, src_offset, item_size):
        """Item i: ``item_size`` bytes at ``index * stride + offset``, as the kernels compute it."""
        span = torch.arange(item_size)
        src_at = (src_indices.to(torch.int64)[:, None] * src_stride + src_offset + span).reshape(-1)
        dst_at = (dst_indices.to(torch.int64)[:, None] * dst_stride + dst_offset + span).reshape(-1)
        flat(dst)[dst_at] = flat(src)[src_at]

    def all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
        for src, dst in zip(layers(src_layers)[:num_layers], layers(dst_layers)[:num_layers]):
            copy(dst, dst_indices, item_size, 0, src, src_indices, item_size, 0, item_size)

    def per_layer_mla(src, dst, src_indices, dst_indices, item_size):
        copy(dst, dst_indices, item_size, 0, src, src_indices, item_size, 0, item_size)

    def all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers):
        for layer, src in enumerate(layers(src_layers)[:num_layers]):
            copy(dst, dst_indices, dst_layout_dim, layer * item_size, src, src_indices, item_size, 0, item_size)

    def per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim):
        copy(dst, dst_indices, item_size, 0, src, src_indices, src_layout_dim, layer_id * item_size, item_size)

    # The direct ops (C++ in sgl-kernel) copy page slices tensor by tensor: page_size rows per index.
    def direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        assert page_size == 1, "the DSV4 host pool passes page rows, page_size=1"
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[dst_indices] = src[src_indices]

    def all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
        assert page_size == 1 and len(dst_ptrs) == 1
        for layer, src in enumerate(src_ptrs):
            dst_ptrs[0][dst_indices, layer, 0] = src[src_indices]

    def per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        assert page_size == 1 and len(src_ptrs) == len(dst_ptrs) == 1
        dst_ptrs[0][dst_indices] = src_ptrs[0][src_indices, layer_id, 0]

    def sub_page_copy(*args, **kwargs):
        raise SubPageCopyCalled("transfer_cache_dsv4_mla would copy a bf16 row as main-KV tokens (576 B value + 8 B scale)")

    for name, fn in {
        "transfer_kv_all_layer_mla": all_layer_mla,
        "transfer_kv_per_layer_mla": per_layer_mla,
        "transfer_kv_all_layer_mla_lf_pf": all_layer_mla_lf_pf,
        "transfer_kv_per_layer_mla_pf_lf": per_layer_mla_pf_lf,
        "transfer_kv_direct": direct,
        "transfer_kv_all_layer_direct_lf_pf": all_layer_direct_lf_pf,
        "transfer_kv_per_layer_direct_pf_lf": per_layer_direct_pf_lf,
        "transfer_cache_dsv4_mla": sub_page_copy,
    }.items():
        monkeypatch.setattr(memory_pool_host, name, counted(name, fn), raising=False)
    return calls


def pages_to_slots(pages: torch.Tensor, slots_per_page: int) -> torch.Tensor:
    """HiCache indices are token slots in the FULL coordinate space, a page at a time."""
    return (pages[:, None] * slots_per_page + torch.arange(slots_per_page)).reshape(-1)

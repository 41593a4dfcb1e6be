"""Gather-copy of whole index-K pages between two pools, either of which may be pinned host memory.

HiCache moves index-K pages between the device pool and its host mirror by
page index. One ``cudaMemcpyAsync`` per page pays a launch per 16 KiB; this
kernel moves any list of pages in one launch, reading or writing pinned host
memory directly through unified virtual addressing (the way upstream's
transfer kernels do), 16-byte accesses per thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # int32 words per program: 4 KiB


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, PAGE_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    part = tl.program_id(1)
    s = tl.load(src_idx_ptr + i).to(tl.int64)
    d = tl.load(dst_idx_ptr + i).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + d * PAGE_WORDS + offs, tl.load(src_ptr + s * PAGE_WORDS + offs))


def _words(pool: torch.Tensor) -> torch.Tensor:
    if not pool.is_contiguous():
        raise ValueError("page pools must be contiguous")
    words = pool.view(pool.shape[0], -1).view(torch.int32)
    if words.shape[1] % BLOCK:
        raise ValueError(f"page size must be a multiple of {BLOCK * 4} bytes; got {words.shape[1] * 4}")
    return words


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for whole pages; one pool may be pinned host memory; indices on the GPU."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"pools differ: {src.dtype} {tuple(src.shape)} vs {dst.dtype} {tuple(dst.shape)}")
    if src_idx.shape != dst_idx.shape:
        raise ValueError("src_idx and dst_idx must have the same length")
    for pool in (src, dst):
        if pool.device.type == "cpu" and not pool.is_pinned():
            raise ValueError("a host pool must be pinned (torch.empty(..., pin_memory=True)) to be copied by the GPU")
    s, d = _words(src), _words(dst)
    n = src_idx.shape[0]
    if n:
        _copy_pages_kernel[(n, s.shape[1] // BLOCK)](s, d, src_idx, dst_idx, PAGE_WORDS=s.shape[1], BLOCK=BLOCK,
                                                     num_warps=4)


def copy_pages_ref(src, dst, src_idx, dst_idx) -> None:
    """Plain torch reference of :func:`copy_pages`."""
    dst[dst_idx.to(dst.device).long()] = src[src_idx.to(src.device).long()].to(dst.device)

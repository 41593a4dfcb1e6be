"""The bf16 C4 index-K page contract the kernels read and write.

Kept identical to the memory pool's contract (``dsv4_sm120.index_k.layout``):
a page holds 64 compressed slots of 128 bf16 values, 16384 bytes, no scale
section; compressed slot ``s`` lives at page ``s // 64``, row ``s % 64``.
Kernels see one layer's pool as a bf16 tensor ``[num_pages, 64, 128]``.
This module is duplicated here (not imported) because ``kernels/`` must stay
importable without the rest of the package on the GPU image.
"""

from __future__ import annotations

import torch

PAGE_SLOTS = 64
HEAD_DIM = 128
ROPE_DIM = 64
ROW_BYTES = HEAD_DIM * 2
PAGE_BYTES = PAGE_SLOTS * ROW_BYTES  # 16384


def check_pages(pages: torch.Tensor, name: str = "pages") -> None:
    """Raise a clear error unless ``pages`` is a contiguous bf16 [num_pages, 64, 128] pool."""
    if pages.dtype != torch.bfloat16 or pages.dim() != 3 or tuple(pages.shape[1:]) != (PAGE_SLOTS, HEAD_DIM):
        raise ValueError(
            f"{name} must be the bf16 index-K pool [num_pages, {PAGE_SLOTS}, {HEAD_DIM}]; "
            f"got {pages.dtype} {tuple(pages.shape)}. Pass pool.index_k_pages_bf16(layer_id)."
        )
    if not pages.is_contiguous():
        raise ValueError(f"{name} must be contiguous (page stride {PAGE_SLOTS * HEAD_DIM} elements)")

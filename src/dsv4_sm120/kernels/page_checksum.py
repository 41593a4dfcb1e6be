"""Per-page integrity checksum for index-K pages moved by HiCache or PD.

A Fletcher-style pair over the bytes of each row: ``s1 = sum b_i`` and
``s2 = sum (i + 1) * b_i``, packed as ``(s2 mod 2^31) << 32 | (s1 mod 2^32)``
into one int64. Any single changed byte changes s1; any two changed bytes that
keep s1 (a swap or a +d/-d pair) change s2. Partial sums stay in int32 inside a
2048-byte block and in int64 across blocks, so the Triton kernel and the torch
reference produce the same bits with no overflow for rows up to 2^24 bytes.
One program per row; rows are read once at device bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
MAX_ROW_BYTES = 1 << 24


@triton.jit
def _checksum_kernel(x_ptr, out_ptr, row_bytes, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    s1 = tl.zeros([], dtype=tl.int64)
    s2 = tl.zeros([], dtype=tl.int64)
    for start in range(0, row_bytes, BLOCK):
        idx = start + offs
        b = tl.load(base + idx, mask=idx < row_bytes, other=0).to(tl.int32)
        part = tl.sum(b, axis=0)
        weighted = tl.sum(b * (offs + 1), axis=0)
        s1 += part.to(tl.int64)
        s2 += weighted.to(tl.int64) + part.to(tl.int64) * start
    packed = ((s2 & 0x7FFFFFFF) << 32) | (s1 & 0xFFFFFFFF)
    tl.store(out_ptr + row, packed)


def _as_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"page_checksum takes uint8 rows [N, row_bytes] (use pages.view(torch.uint8).flatten(1)); "
                         f"got {rows.dtype} {tuple(rows.shape)}")
    if rows.shape[1] > MAX_ROW_BYTES:
        raise ValueError(f"rows of {rows.shape[1]} bytes exceed the checksum's {MAX_ROW_BYTES}-byte limit")
    return rows if rows.stride(1) == 1 else rows.contiguous()


def page_checksum(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N] checksums of uint8 rows [N, row_bytes]; Triton on CUDA, the torch reference elsewhere."""
    rows = _as_rows(rows)
    if rows.device.type != "cuda":
        result = page_checksum_ref(rows)
        if out is not None:
            out.copy_(result)
            return out
        return result
    if out is None:
        out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    if rows.shape[0]:
        _checksum_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def page_checksum_triton(rows: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any device (the CPU under TRITON_INTERPRET=1); for tests."""
    rows = _as_rows(rows)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    if rows.shape[0]:
        _checksum_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def page_checksum_ref(rows: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`page_checksum`, bit for bit."""
    rows = _as_rows(rows)
    b = rows.to(torch.int64)
    weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=rows.device)
    s1 = b.sum(1)
    s2 = (b * weights).sum(1)
    return ((s2 & 0x7FFFFFFF) << 32) | (s1 & 0xFFFFFFFF)

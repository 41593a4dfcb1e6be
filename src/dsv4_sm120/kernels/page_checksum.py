"""Per-page integrity checksum for index-K pages moved by HiCache or PD.

A Fletcher-style pair over the bytes of each row: ``s1 = sum b_i`` and
``s2 = sum (i + 1) * b_i``, packed as ``(s2 mod 2^31) << 32 | (s1 mod 2^32)``
into one int64. Any single changed byte changes s1; any two changed bytes that
keep s1 (a swap or a +d/-d pair) change s2. The kernel keeps per-lane int32
partial sums (no overflow for rows up to 2^23 bytes with 8192-byte steps) and reduces them once in
int64, so it and the torch reference produce the same bits. One program per
row; rows are read once at device bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # bytes per loop step: 32 per thread at 8 warps, several 16-byte loads in flight
NUM_WARPS = 8
MAX_ROW_BYTES = 1 << 23


@triton.jit
def _checksum_kernel(x_ptr, out_ptr, row_bytes, stride_row, BLOCK: tl.constexpr):
    # Per-lane int32 accumulators, one reduction at the end:
    #   s1 = sum b,  s2 = sum b * (j + 1) + BLOCK * sum b * block_index   (byte i = block_index * BLOCK + j)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    acc_s = tl.zeros([BLOCK], dtype=tl.int32)
    acc_w = tl.zeros([BLOCK], dtype=tl.int32)
    acc_blk = tl.zeros([BLOCK], dtype=tl.int32)
    n_blocks = tl.cdiv(row_bytes, BLOCK)
    for blk in range(0, n_blocks):
        idx = blk * BLOCK + offs
        b = tl.load(base + idx, mask=idx < row_bytes, other=0).to(tl.int32)
        acc_s += b
        acc_w += b * (offs + 1)
        acc_blk += b * blk
    s1 = tl.sum(acc_s.to(tl.int64), axis=0)
    s2 = tl.sum(acc_w.to(tl.int64), axis=0) + BLOCK * tl.sum(acc_blk.to(tl.int64), axis=0)
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
        _checksum_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def page_checksum_triton(rows: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any device (the CPU under TRITON_INTERPRET=1); for tests."""
    rows = _as_rows(rows)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    if rows.shape[0]:
        _checksum_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def page_checksum_ref(rows: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`page_checksum`, bit for bit."""
    rows = _as_rows(rows)
    b = rows.to(torch.int64)
    weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=rows.device)
    s1 = b.sum(1)
    s2 = (b * weights).sum(1)
    return ((s2 & 0x7FFFFFFF) << 32) | (s1 & 0xFFFFFFFF)

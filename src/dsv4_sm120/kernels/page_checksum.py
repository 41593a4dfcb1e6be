"""Per-page integrity checksum for index-K pages moved by HiCache or PD.

A Fletcher-style pair over the 16-bit halfwords ``h_k`` of each row (little
endian, zero-padded to a multiple of 4 bytes), modulo 2^32:

    s1 = sum h_k,    s2 = sum (k + 1) * h_k,    checksum = (s2 << 32) | s1  (int64 bits)

Any change confined to one halfword (every single-byte or single-bit error)
changes s1; any two changed halfwords that keep s1 (a swap, a +d/-d pair, a
shifted slot) change s2 by d * (i - j), which is not 0 mod 2^32 for rows up to
128 KiB (an index-K page is 16 KiB). The kernel reads each row once as int32
words with wrapping int32 lane sums, a few integer operations per 4 bytes, so
it runs at memory speed; the torch reference computes the same bits in int64
(no overflow anywhere, so the interpreter and the GPU agree too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels.launch import launch

BLOCK = 1024  # int32 words (4 KiB) per loop step
NUM_WARPS = 4
MAX_ROW_BYTES = 1 << 23
EXACT_ROW_BYTES = 1 << 17  # every two-halfword change is caught up to this row size


@triton.jit
def row_checksum(base, row_words, BLOCK: tl.constexpr):
    """The packed checksum (int64 scalar) of one row of ``row_words`` int32 words at ``base``."""
    # halfword index of (word k, half e) is 2k + e; with k = blk * BLOCK + j:
    #   s2 = sum lo * (2j + 1) + hi * (2j + 2)  +  2 * BLOCK * sum (lo + hi) * blk     (all mod 2^32)
    j = tl.arange(0, BLOCK)
    w_lo = 2 * j + 1
    acc_s = tl.zeros([BLOCK], dtype=tl.int32)
    acc_w = tl.zeros([BLOCK], dtype=tl.int32)
    acc_b = tl.zeros([BLOCK], dtype=tl.int32)
    for blk in range(0, tl.cdiv(row_words, BLOCK)):
        k = blk * BLOCK + j
        word = tl.load(base + k, mask=k < row_words, other=0)
        lo = word & 0xFFFF
        hi = (word >> 16) & 0xFFFF
        s = lo + hi
        acc_s += s
        acc_w += lo * w_lo + hi * (w_lo + 1)
        acc_b += s * blk
    # lanes hold their sums mod 2^32 (int32 wraps); reduce in int64, then take mod 2^32
    s1 = tl.sum(acc_s.to(tl.int64), axis=0) & 0xFFFFFFFF
    s2 = (tl.sum(acc_w.to(tl.int64), axis=0) + (2 * BLOCK) * tl.sum(acc_b.to(tl.int64), axis=0)) & 0xFFFFFFFF
    s2 = tl.where(s2 >= 2147483648, s2 - 4294967296, s2)
    return s2 * 4294967296 + s1


@triton.jit
def _checksum_kernel(x_ptr, out_ptr, row_words, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, row_checksum(x_ptr + row * stride_row, row_words, BLOCK))


def _as_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"page_checksum takes uint8 rows [N, row_bytes] (use pages.view(torch.uint8).flatten(1)); "
                         f"got {rows.dtype} {tuple(rows.shape)}")
    if rows.shape[1] > MAX_ROW_BYTES:
        raise ValueError(f"rows of {rows.shape[1]} bytes exceed the checksum's {MAX_ROW_BYTES}-byte limit")
    if rows.shape[1] % 4 or rows.stride(1) != 1 or rows.stride(0) % 4 or rows.data_ptr() % 4:
        pad = (-rows.shape[1]) % 4
        padded = torch.zeros((rows.shape[0], rows.shape[1] + pad), dtype=torch.uint8, device=rows.device)
        padded[:, : rows.shape[1]] = rows
        rows = padded
    return rows


def _launch(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    words = rows.view(torch.int32)
    if rows.shape[0]:
        launch(_checksum_kernel, (rows.shape[0],), (words, out, words.shape[1], words.stride(0)), dict(BLOCK=BLOCK),
               num_warps=NUM_WARPS, num_stages=3)
    return out


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
    return _launch(rows, out)


def page_checksum_triton(rows: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any device (the CPU under TRITON_INTERPRET=1); for tests."""
    rows = _as_rows(rows)
    return _launch(rows, torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device))


def page_checksum_ref(rows: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`page_checksum`, bit for bit."""
    rows = _as_rows(rows).to(torch.int64)
    half = rows[:, 0::2] | (rows[:, 1::2] << 8)  # little-endian halfwords
    idx = torch.arange(1, half.shape[1] + 1, dtype=torch.int64, device=rows.device)
    mask = 0xFFFFFFFF
    s1 = half.sum(1) & mask
    s2 = (half * idx).sum(1) & mask
    s2_signed = s2 - (s2 >= 2**31).to(torch.int64) * 2**32
    return s2_signed * 2**32 + s1

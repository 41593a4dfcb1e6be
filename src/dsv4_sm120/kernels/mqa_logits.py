"""Paged MQA logits over bf16 index-K pages (the C4 lightning indexer's scores).

    logits[t, n] = sum_h w[t, h] * relu(q[t, h] . k[n])   for n < min(seq_lens[t], max_seq_len)

where key n of row t lives at page ``page_table[t, n // 64]``, row ``n % 64`` of
the bf16 pool ``[num_pages, 64, 128]``. The output is fp32 ``[rows, max_seq_len]``,
contiguous: the shape and dtype upstream's paged top-k transforms
(``--dsa-topk-backend`` sgl-kernel / torch / flashinfer) read.

Columns at or past a row's length are neither computed nor written. In decode
and target-verify upstream sizes ``max_seq_len`` to the CUDA-graph capture
width (context / 4 for every row), so writing -inf there would cost time in
proportion to the context the server could hold, not to the keys a request
has. No transform reads past ``seq_lens`` (the torch and flashinfer ones mask
by it before selecting, sgl-kernel's only loop to it; tests/kernels/
test_topk_poison.py poisons that region and checks the selection), and
upstream's own TileLang kernel leaves it unwritten too.

One program scores one query row over a contiguous range of key tiles: a tile
is one page, 64 keys x 128 dims, read as one contiguous 16 KiB block from its
page id (one scalar load per tile, so the address arithmetic is per tile, not
per element), then one tensor-core product against the row's 64 heads, relu,
weight and a sum over heads in registers. The launch grid depends on
the width only through a cap, and the work per program is set on the device
from the row's live length, so a request with 4k keys is scored the same way
whatever the width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels._common import interpreting
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, check_pages

# Defaults (4 warps, 4 stages) from the H200 sweeps in bench/results/indexer_h200_2026-12-01*.json.
TARGET_PROGRAMS = 2048  # ~15 programs per SM: enough loads in flight for decode, one pass per row for prefill
MIN_TILES_PER_PROGRAM = 4  # a program that scores fewer key tiles spends most of its time loading q


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row,
    max_seq_len, splits, min_tiles,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, FP32_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row64 = row.to(tl.int64)
    seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
    live_pages = tl.cdiv(seq, PAGE)
    tiles = tl.maximum(tl.cdiv(live_pages, splits), min_tiles)  # this row's share of pages per program
    t0 = split * tiles
    t1 = tl.minimum(t0 + tiles, live_pages)
    if t0 < t1:
        heads = tl.arange(0, H)
        dims = tl.arange(0, D)
        q_t = tl.load(q_ptr + row64 * stride_q_row + heads[None, :] * stride_q_head + dims[:, None])  # [D, H]
        w = tl.load(w_ptr + row64 * stride_w_row + heads).to(tl.float32)
        out_row = out_ptr + row64 * stride_out_row
        pt_row = pt_ptr + row64 * stride_pt_row
        offs = tl.arange(0, PAGE)
        in_page = offs[:, None] * D + dims[None, :]  # [PAGE, D] element offsets inside one page
        for t in range(t0, t1):
            n = t * PAGE + offs
            live = n < seq
            page = tl.load(pt_row + t).to(tl.int64)
            k = tl.load(kv_ptr + page * (PAGE * D) + in_page, mask=live[:, None], other=0.0)  # [PAGE, D]
            if FP32_DOT:  # the CPU interpreter's bf16 dot is wrong; exact bf16 products in fp32 agree
                s = tl.dot(k.to(tl.float32), q_t.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(k, q_t)  # [PAGE, H] fp32 accumulate
            s = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
            tl.store(out_row + n, s, mask=live)

def _normalize(q, weights, seq_lens, page_table):
    if q.dim() == 4:  # upstream passes [B, next_n=1, H, D]
        if q.shape[1] != 1:
            raise ValueError(f"q [B, next_n, H, D] needs next_n == 1 (flatten MTP rows first); got {tuple(q.shape)}")
        q = q[:, 0]
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be bf16 [rows, H, {HEAD_DIM}]; got {q.dtype} {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    rows, heads = q.shape[0], q.shape[1]
    if heads & (heads - 1) or heads < 16:
        raise ValueError(f"the number of heads must be a power of two >= 16; got {heads}")
    weights = weights.reshape(rows, heads)
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    seq_lens = seq_lens.reshape(-1)
    if seq_lens.shape[0] != rows or page_table.dim() != 2 or page_table.shape[0] != rows:
        raise ValueError(f"seq_lens [rows] and page_table [rows, pages] must match q's {rows} rows; got "
                         f"{tuple(seq_lens.shape)} and {tuple(page_table.shape)}")
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if page_table.dtype != torch.int32 or page_table.stride(-1) != 1:
        page_table = page_table.to(torch.int32).contiguous()
    return q, weights, seq_lens, page_table


def bf16_paged_mqa_logits(
    q: torch.Tensor,
    pages: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    min_tiles: int = MIN_TILES_PER_PROGRAM,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """fp32 logits [rows, max_seq_len] of bf16 queries against the bf16 index-K pool (see module doc).

    Only ``[0, min(seq_lens[t], max_seq_len))`` of row t is written. ``splits`` programs share a row
    (default: enough programs to fill the GPU, fewer when the width has too few pages), each taking at
    least ``min_tiles`` pages of the row's live length.
    """
    check_pages(pages)
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    rows = q.shape[0]
    if out is None:
        out = torch.empty((rows, max_seq_len), dtype=torch.float32, device=q.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, max_seq_len) or out.stride(1) != 1:
        raise ValueError(f"out must be fp32 [{rows}, {max_seq_len}] with unit inner stride")
    if rows == 0 or max_seq_len == 0:
        return out
    if splits is None:  # split rows only when there are too few to fill the GPU; never past the width
        splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, rows), triton.cdiv(max_seq_len, PAGE_SLOTS * min_tiles)))
    _logits_kernel[(rows, int(splits))](
        q, weights, pages, seq_lens, page_table, out,
        q.stride(0), q.stride(1), weights.stride(0), page_table.stride(0), out.stride(0),
        max_seq_len, int(splits), int(min_tiles),
        H=q.shape[1], D=HEAD_DIM, PAGE=PAGE_SLOTS, FP32_DOT=interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_mqa_logits_ref(q, pages, weights, seq_lens, page_table, max_seq_len, *, dtype=torch.float32,
                         rows_per_chunk: int = 256) -> torch.Tensor:
    """Plain torch reference in ``dtype`` (fp32 or fp64) on upcast inputs, chunked over rows.

    Columns past a row's length hold -inf here (the kernel leaves them unwritten); compare the live part.
    """
    check_pages(pages)
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    rows = q.shape[0]
    out = torch.full((rows, max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    n_pages = triton.cdiv(max_seq_len, PAGE_SLOTS)
    pos = torch.arange(max_seq_len, device=q.device)
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        pt = page_table[r0:r1, :n_pages].long()
        valid_pages = torch.arange(pt.shape[1], device=q.device)[None, :] * PAGE_SLOTS < seq_lens[r0:r1, None]
        k = pages[torch.where(valid_pages, pt, 0)].to(dtype).flatten(1, 2)[:, :max_seq_len]  # [r, N, D]
        s = torch.einsum("rnd,rhd->rnh", k, q[r0:r1].to(dtype)).clamp_min(0)
        s = (s * weights[r0:r1, None, :].to(dtype)).sum(-1)
        live = pos[None, : s.shape[1]] < seq_lens[r0:r1, None]
        out[r0:r1, : s.shape[1]] = torch.where(live, s, float("-inf")).float()
    return out

"""Two-stage C4 indexer selection over bf16 index-K pages: an fp8 scan of every key, a bf16 re-score of the best.

The single-stage score (``mqa_logits``) of key n for query row t is

    logit[t, n] = sum_h w[t, h] * relu(q[t, h] . k[n])             (bf16 products, fp32 sums)

Stage 1 scores every live key at fp8 tensor-core rate, quantized as upstream's fp8 indexer quantizes, but
from the bf16 pool itself (index keys stay 256 B a token, nothing else is stored):

    s_k[n] = max(amax_d |k[n, d]|, 1e-4) / 448,   k8[n] = e4m3(clamp(k[n] * (1 / s_k[n]), -448, 448))
    s_q[t, h], q8[t, h]  the same per (row, head);   w8[t, h] = w[t, h] * s_q[t, h]
    stage1[t, n] = s_k[n] * sum_h w8[t, h] * relu(q8[t, h] . k8[n])  (e4m3 products, fp32 sums)

with fp32 math, both divisions correctly rounded and e4m3 rounding to nearest even, as torch's
``.to(torch.float8_e4m3fn)``. The kernel quantizes each key tile in registers after loading it (one
scale per key over its 128 dims); the queries are quantized once per call by torch (:func:`quantize_queries`).
Stage 1's output contract is ``bf16_paged_mqa_logits``': fp32 ``[rows, max_seq_len]``, only
``[0, min(seq_lens[t], max_seq_len))`` of row t written.

Stage 2 takes each row's best ``topk + margin`` keys by stage 1 (``torch.topk``) and scores exactly those
again by ``logit`` above: a gather kernel loads 64 candidates' key rows as one [64, 128] tile and scores it
with the single-stage kernel's own tile math (``mqa_logits._tile_scores``: the same product, relu, weights
and head sum), so a candidate's score is the single-stage kernel's up to accumulation order. The best
``topk`` candidates by that score are the selection: :func:`two_stage_topk` returns int32 ``[rows, topk]``,
each row's key indices ascending, -1 after the last (upstream's raw indices, as a set). On synthetic
long-context keys (bench/indexer/precision.py) a margin of 512 selected what bf16 keys select in every row.

Program shapes: decode (fewer than ``mqa_logits.PREFILL_ROWS`` rows), ``splits`` programs a row, program p
scanning tiles p, p + P, ... (as ``mqa_logits``' strided decode, with its split count); prefill, one program
for ``ROWS_PER_PROGRAM`` consecutive rows, each key page loaded and quantized once for all of them, and rows
that read another page (another request in the group) scanned again on their own pages afterwards.

On a Hopper GPU Triton's fp8 product keeps fewer accumulator bits than fp32 (its sm_90 default of
``max_num_imprecise_acc``), so stage 1 there agrees with its reference less closely than under the CPU
interpreter, where the e4m3 values are multiplied in fp32 (``FP32_DOT``: the interpreter's casts to
float8e4nv truncate, so the values are rounded by :func:`e4m3_rne`). Stage 2 is unaffected. Speed is not
measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels._common import cdiv, interpreting
from dsv4_sm120.kernels.launch import check_one_device, launch
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, check_pages
from dsv4_sm120.kernels.mqa_logits import (PREFILL_ROWS, _half_group, _load_row_q, _normalize, _row_group, _row_sums,
                                           _tile_scores, decode_splits, paged_mqa_logits_ref)

FP8_MAX = 448.0  # e4m3fn's largest finite value, upstream's kFP8E4M3Max
SCALE_FLOOR = 1e-4  # upstream's floor on a row's amax
TOPK = 512
MARGIN = 512
# Launch settings: mqa_logits' tuned ones where the shape is the same, none tuned here (no GPU has run these).
# Triton 3.8 builds (tests/kernels/test_aot_compile.py), sm_90 / sm_120: decode 4 key pages in flight, 64 KiB of
# shared memory, 127 / 125 registers; prefill 56 KiB, 255 registers and 96 / 88 B spilled (mqa_logits' prefill
# spills 112 / 340 B); re-score 32 KiB, 64 / 96 registers.
ROWS_PER_PROGRAM = 4  # stage 1, prefill
CAND_BLOCK = PAGE_SLOTS  # stage 2: candidates a program scores, one [64, 128] tile as the single-stage kernel's
SCAN_DECODE_CONFIG = dict(num_warps=4, num_stages=8)
SCAN_PREFILL_CONFIG = dict(num_warps=4, num_stages=3)
RESCORE_CONFIG = dict(num_warps=4, num_stages=1)


@triton.jit
def e4m3_rne(x):
    """fp32 x in [-448, 448] -> the nearest e4m3 value, ties to even, still fp32 (for the CPU interpreter).

    Normal range (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, rounding on the bits. Below it e4m3's
    spacing is 2^-9: adding and taking away 1.5 * 2^14 (whose fp32 spacing is 2^-9) rounds x to it."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_keys(k, FP32_DOT: tl.constexpr):
    """A bf16 key tile [PAGE, D] -> its e4m3 keys and fp32 scales [PAGE] (see module doc); the e4m3 keys are
    float8e4nv, or under FP32_DOT their exact values in fp32."""
    x = k.to(tl.float32)
    PAGE: tl.constexpr = x.shape[0]
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), tl.full([PAGE], 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full([PAGE], 1.0, tl.float32), scale)
    x = tl.clamp(x * inv[:, None], -448.0, 448.0)
    if FP32_DOT:
        return e4m3_rne(x), scale
    return x.to(tl.float8e4nv), scale


@triton.jit
def _fp8_products(k8, q_t, FP32_DOT: tl.constexpr):
    """k8 . q_t[:, c] for e4m3 keys [PAGE, D] and e4m3 query columns [D, C] (fp32 [PAGE, C])."""
    if FP32_DOT:  # e4m3 products are exact in fp32
        return tl.dot(k8, q_t.to(tl.float32), input_precision="ieee")
    return tl.dot(k8, q_t)  # fp8 tensor cores, fp32 accumulate


@triton.jit
def _scan_row(q_t, w, kv_ptr, pt_row, out_row, ref_pt, seq, t0, t1, step,
              D: tl.constexpr, PAGE: tl.constexpr, ONLY_OTHER_PAGES: tl.constexpr, FP32_DOT: tl.constexpr):
    """Stage 1 of one row (e4m3 q_t [D, H], w8 [H]) over its pages t0, t0 + step, ... < t1; with
    ONLY_OTHER_PAGES only keys whose page differs from ``ref_pt``'s are stored."""
    offs = tl.arange(0, PAGE)
    in_page = offs[:, None] * D + tl.arange(0, D)[None, :]
    for t in range(t0, t1, step):
        n = t * PAGE + offs
        live = n < seq
        page = tl.load(pt_row + t).to(tl.int64)
        k8, k_scale = _quantize_keys(tl.load(kv_ptr + page * (PAGE * D) + in_page, mask=live[:, None], other=0.0),
                                     FP32_DOT)
        s = tl.sum(tl.maximum(_fp8_products(k8, q_t, FP32_DOT), 0.0) * w[None, :], axis=1) * k_scale
        if ONLY_OTHER_PAGES:
            live = live & (page != tl.load(ref_pt + t).to(tl.int64))
        tl.store(out_row + n, s, mask=live)


@triton.jit(do_not_specialize=["stride_pt_row", "stride_out_row", "n_rows", "max_seq_len", "splits"],
            do_not_specialize_on_alignment=["seq_ptr", "pt_ptr"])
def _scan_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row,
    n_rows, max_seq_len, splits,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr, FP32_DOT: tl.constexpr,
):
    if R == 1:  # decode: program (row, split) scans tiles split, split + P, ... of the row
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
        n_tiles = tl.cdiv(seq, PAGE)
        active = tl.minimum(splits, n_tiles)
        if split < active:
            q_t, w = _load_row_q(q_ptr + row * stride_q_row, w_ptr + row * stride_w_row, stride_q_head, H, D)
            pt_row = pt_ptr + row * stride_pt_row
            _scan_row(q_t, w, kv_ptr, pt_row, out_ptr + row * stride_out_row, pt_row, seq, split, n_tiles, active,
                      D, PAGE, False, FP32_DOT)
    else:  # prefill: R consecutive rows; a page they share is loaded and quantized once for all R
        r0, rr, rows, seqs, seq_hi, ref_pt = _row_group(seq_ptr, pt_ptr, stride_pt_row, n_rows, max_seq_len, R)
        HALF: tl.constexpr = R // 2  # two products a tile, as mqa_logits' prefill (one held too many registers)
        q_a, w_a = _half_group(q_ptr, w_ptr, r0, n_rows, stride_q_row, stride_q_head, stride_w_row, HALF, H, D)
        q_b, w_b = _half_group(q_ptr, w_ptr, r0 + HALF, n_rows, stride_q_row, stride_q_head, stride_w_row, HALF, H, D)
        offs = tl.arange(0, PAGE)
        in_page = offs[:, None] * D + tl.arange(0, D)[None, :]
        out_rows = out_ptr + rows[None, :] * stride_out_row
        other = tl.zeros([R], dtype=tl.int32)  # rows that read a page of their own somewhere
        for t in range(0, tl.cdiv(seq_hi, PAGE)):
            n = t * PAGE + offs
            page = tl.load(ref_pt + t)
            mine = tl.load(pt_ptr + rows * stride_pt_row + t, mask=t * PAGE < seqs, other=page)
            other = tl.maximum(other, (mine != page).to(tl.int32))
            k = tl.load(kv_ptr + page.to(tl.int64) * (PAGE * D) + in_page, mask=(n < seq_hi)[:, None], other=0.0)
            k8, k_scale = _quantize_keys(k, FP32_DOT)
            sums = tl.join(_row_sums(_fp8_products(k8, q_a, FP32_DOT), w_a, PAGE, HALF, H),
                           _row_sums(_fp8_products(k8, q_b, FP32_DOT), w_b, PAGE, HALF, H))  # [PAGE, HALF, 2]
            s = tl.reshape(tl.permute(sums, (0, 2, 1)), (PAGE, R)) * k_scale[:, None]
            tl.store(out_rows + n[:, None], s, mask=(n[:, None] < seqs[None, :]) & (mine == page)[None, :])
        if tl.max(other, axis=0) > 0:  # rows of different requests in one group: each scans its own pages
            tl.debug_barrier()
            for i in tl.static_range(R):
                if tl.sum(tl.where(rr == i, other, 0), axis=0) > 0:
                    row = tl.minimum(r0 + i, n_rows - 1).to(tl.int64)
                    seq = tl.sum(tl.where(rr == i, seqs, 0), axis=0)
                    q_i, w_i = _load_row_q(q_ptr + row * stride_q_row, w_ptr + row * stride_w_row, stride_q_head, H, D)
                    _scan_row(q_i, w_i, kv_ptr, pt_ptr + row * stride_pt_row, out_ptr + row * stride_out_row, ref_pt,
                              seq, 0, tl.cdiv(seq, PAGE), 1, D, PAGE, True, FP32_DOT)


@triton.jit(do_not_specialize=["stride_pt_row", "stride_c_row", "stride_out_row", "n_cand", "max_seq_len"],
            do_not_specialize_on_alignment=["seq_ptr", "pt_ptr", "cand_ptr"])
def _rescore_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, cand_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_c_row, stride_out_row,
    n_cand, max_seq_len,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Stage 2: program (row, b) scores the row's candidates b * PAGE ... (b + 1) * PAGE - 1 in bf16; -inf
    where a candidate is -1 or not a live key."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * PAGE + tl.arange(0, PAGE)
    in_row = j < n_cand
    seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
    n = tl.load(cand_ptr + row * stride_c_row + j, mask=in_row, other=-1)
    live = (n >= 0) & (n < seq)
    n = tl.where(live, n, 0)
    page = tl.load(pt_ptr + row * stride_pt_row + n // PAGE, mask=live, other=0).to(tl.int64)
    k = tl.load(kv_ptr + (page * PAGE + n % PAGE)[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None],
                other=0.0)  # [PAGE, D]: 64 gathered key rows, 256 B each
    q_t, w = _load_row_q(q_ptr + row * stride_q_row, w_ptr + row * stride_w_row, stride_q_head, H, D)
    s = tl.sum(_tile_scores(k, q_t, w, FP32_DOT), axis=1)
    tl.store(out_ptr + row * stride_out_row + j, tl.where(live, s, float("-inf")), mask=in_row)


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's per-row e4m3 quantization of ``x [..., 128]``: (float8_e4m3fn values, fp32 scales [...])."""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    return (x * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's queries, once per call: e4m3 ``q8 [rows, H, 128]`` and fp32 ``w8 = w * s_q [rows, H]``."""
    q8, scale = quantize_fp8_ref(q)
    return q8, weights.float().reshape(scale.shape) * scale


def fp8_paged_mqa_logits(q, pages, weights, seq_lens, page_table, max_seq_len, *, out=None,
                         rows_per_program: int | None = None, splits: int | None = None) -> torch.Tensor:
    """Stage 1: fp32 logits [rows, max_seq_len] of the fp8 recipe (module doc) for bf16 q [rows, H, 128] and
    head weights; only ``[0, min(seq_lens[t], max_seq_len))`` of row t is written. ``rows_per_program``:
    1 (decode) or ``ROWS_PER_PROGRAM`` (prefill); by default prefill from ``PREFILL_ROWS`` rows."""
    check_pages(pages)
    check_one_device(q, pages, weights, seq_lens, page_table, out)
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    rows, heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((rows, max_seq_len), dtype=torch.float32, device=q.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, max_seq_len) or out.stride(1) != 1:
        raise ValueError(f"out must be fp32 [{rows}, {max_seq_len}] with unit inner stride")
    if rows == 0 or max_seq_len == 0:
        return out
    q8, w8 = quantize_queries(q, weights)
    r = int(rows_per_program) if rows_per_program is not None else (ROWS_PER_PROGRAM if rows >= PREFILL_ROWS else 1)
    if r not in (1, ROWS_PER_PROGRAM):
        raise ValueError(f"rows_per_program must be 1 or {ROWS_PER_PROGRAM}; got {r}")
    cfg = SCAN_PREFILL_CONFIG if r > 1 else SCAN_DECODE_CONFIG
    if r > 1:
        grid, splits = (cdiv(rows, r), 1), 1
    else:
        if splits is None:
            splits = decode_splits(rows, max_seq_len, device=q.device, num_stages=cfg["num_stages"],
                                   num_warps=cfg["num_warps"], heads=heads)
        grid = (rows, int(splits))
    launch(_scan_kernel, grid,
           (q8, w8, pages, seq_lens, page_table, out, q8.stride(0), q8.stride(1), w8.stride(0), page_table.stride(0),
            out.stride(0), rows, max_seq_len, int(splits)),
           dict(H=heads, D=HEAD_DIM, PAGE=PAGE_SLOTS, R=r, FP32_DOT=interpreting()), **cfg)
    return out


def rescore_candidates(q, pages, weights, seq_lens, page_table, cand, max_seq_len, *, out=None) -> torch.Tensor:
    """Stage 2: fp32 [rows, C] bf16 scores (``logit`` of the module doc) of the candidate key indices
    ``cand`` [rows, C] (int, -1 for none); -inf for -1 and for indices at or past a row's live length."""
    check_pages(pages)
    check_one_device(q, pages, weights, seq_lens, page_table, cand, out)
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    rows, heads = q.shape[0], q.shape[1]
    if cand.dim() != 2 or cand.shape[0] != rows:
        raise ValueError(f"cand must be [{rows}, C]; got {tuple(cand.shape)}")
    if cand.dtype != torch.int32 or cand.stride(-1) != 1:
        cand = cand.to(torch.int32).contiguous()
    n_cand = cand.shape[1]
    if out is None:
        out = torch.empty((rows, n_cand), dtype=torch.float32, device=q.device)
    if rows == 0 or n_cand == 0:
        return out
    launch(_rescore_kernel, (rows, cdiv(n_cand, CAND_BLOCK)),
           (q, weights, pages, seq_lens, page_table, cand, out, q.stride(0), q.stride(1), weights.stride(0),
            page_table.stride(0), cand.stride(0), out.stride(0), n_cand, max_seq_len),
           dict(H=heads, D=HEAD_DIM, PAGE=PAGE_SLOTS, FP32_DOT=interpreting()), **RESCORE_CONFIG)
    return out


def _live_lengths(seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    return seq_lens.reshape(-1).long().clamp(max=max_seq_len)


def _candidates(stage1: torch.Tensor, live: torch.Tensor, n_cand: int, *, in_place: bool = False) -> torch.Tensor:
    """Each row's best ``n_cand`` live keys by stage 1, int32 [rows, n_cand], -1 where a row has fewer;
    ``in_place``: the unwritten columns of ``stage1`` itself are set to -inf (no copy of the logits)."""
    pos = torch.arange(stage1.shape[1], device=stage1.device)
    past = pos[None, :] >= live[:, None]  # unwritten columns
    masked = stage1.masked_fill_(past, float("-inf")) if in_place else stage1.masked_fill(past, float("-inf"))
    cand = torch.topk(masked, n_cand, dim=1, sorted=False).indices
    return torch.where(cand < live[:, None], cand, -1).to(torch.int32)


def _selection(cand: torch.Tensor, scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best candidates by ``scores`` (-inf: none), as int32 [rows, topk]: ascending, -1 after."""
    k = min(topk, cand.shape[1])
    best = torch.topk(scores, k, dim=1, sorted=False).indices
    sel = torch.where(torch.isfinite(scores.gather(1, best)), cand.gather(1, best).long(), torch.iinfo(torch.int32).max)
    sel = sel.sort(dim=1).values
    sel = torch.where(sel == torch.iinfo(torch.int32).max, -1, sel).to(torch.int32)
    if k < topk:
        sel = torch.nn.functional.pad(sel, (0, topk - k), value=-1)
    return sel


def two_stage_topk(q, pages, weights, seq_lens, page_table, max_seq_len, *, topk: int = TOPK,
                   margin: int = MARGIN) -> torch.Tensor:
    """Each row's ``topk`` keys by the bf16 score, among its ``topk + margin`` best by stage 1 (module doc).

    Returns int32 ``[rows, topk]``: row t's selected key indices n (0 <= n < min(seq_lens[t], max_seq_len)),
    ascending, then -1 where the row has fewer than ``topk`` live keys. As a set this is the raw-index output of
    upstream's top-k transforms on ``bf16_paged_mqa_logits``' logits (``out_raw_indices``; their order within a
    row is unspecified, and a row of at most ``topk`` keys gets 0 .. n - 1 then -1, as here); the pool slot of
    index n is ``page_table[t, n // 64] * 64 + n % 64``, as their ``out_page_indices``.
    """
    if topk < 1 or margin < 0:
        raise ValueError(f"topk must be >= 1 and margin >= 0; got {topk}, {margin}")
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    rows = q.shape[0]
    if rows == 0 or max_seq_len == 0:
        return torch.full((rows, topk), -1, dtype=torch.int32, device=q.device)
    stage1 = fp8_paged_mqa_logits(q, pages, weights, seq_lens, page_table, max_seq_len)
    cand = _candidates(stage1, _live_lengths(seq_lens, max_seq_len), min(topk + margin, max_seq_len))
    scores = rescore_candidates(q, pages, weights, seq_lens, page_table, cand, max_seq_len)
    return _selection(cand, scores, topk)


def two_stage_paged_mqa_logits(q, pages, weights, seq_lens, page_table, max_seq_len, *, out=None,
                               topk: int = TOPK, margin: int = MARGIN) -> torch.Tensor:
    """The two-stage selection as serving consumes it: fp32 logits ``[rows, max_seq_len]`` for upstream's top-k
    transforms (``--dsa-topk-backend``), in which each row's ``topk + margin`` best live keys by stage 1 carry
    their bf16 score (stage 2) and every other column -inf.

    Why logits and not indices: the transform's best ``topk`` of these are :func:`two_stage_topk`'s selection
    (as a set, ties aside), and everything the transform does besides choosing (the pool-slot mapping, the
    raw-index capture of ``--enable-return-indexer-topk``, chunk plans) stays upstream's. A row of at most
    ``topk + margin`` live keys has them all re-scored, so it is scored exactly as by the single-stage kernel.
    ``out`` (the forward's logits buffer) holds stage 1 first; nothing of the logits' size is allocated."""
    check_pages(pages)
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    out = fp8_paged_mqa_logits(q, pages, weights, seq_lens, page_table, max_seq_len, out=out)
    if q.shape[0] == 0 or max_seq_len == 0:
        return out
    cand = _candidates(out, _live_lengths(seq_lens, max_seq_len), min(topk + margin, max_seq_len), in_place=True)
    scores = rescore_candidates(q, pages, weights, seq_lens, page_table, cand, max_seq_len)
    out.fill_(float("-inf"))
    # a row with fewer live keys than candidates has -1 entries with -inf scores: sent to column 0 under amax,
    # they leave that column's own score (or -inf) as it is
    return out.scatter_reduce_(1, cand.clamp_min(0).long(), scores, reduce="amax")


def fp8_paged_mqa_logits_ref(q, pages, weights, seq_lens, page_table, max_seq_len) -> torch.Tensor:
    """Plain torch reference of stage 1: upstream's quantization of the keys and queries, then float64 sums of the
    exact e4m3 products; fp32 [rows, max_seq_len], -inf past a row's length (the kernel leaves that unwritten)."""
    check_pages(pages)
    q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    q8, w8 = quantize_queries(q, weights)
    rows = q.shape[0]
    out = torch.full((rows, max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    live = _live_lengths(seq_lens, max_seq_len)
    for t in range(rows):
        n = int(live[t])
        if n == 0:
            continue
        slots = page_table[t, : cdiv(n, PAGE_SLOTS)].long()
        k8, k_scale = quantize_fp8_ref(pages[slots].flatten(0, 1)[:n])  # [n, D]
        s = (k8.double() @ q8[t].double().T).clamp_min(0)  # [n, H]
        out[t, :n] = ((s @ w8[t].double()) * k_scale.double()).float()
    return out


def rescore_candidates_ref(q, pages, weights, seq_lens, page_table, cand, max_seq_len) -> torch.Tensor:
    """Plain torch reference of stage 2: the float64 bf16-key logits (``paged_mqa_logits_ref``) at the candidates."""
    ref = paged_mqa_logits_ref(q, pages, weights, seq_lens, page_table, max_seq_len, dtype=torch.float64)
    cand = cand.long()
    live = (cand >= 0) & (cand < _live_lengths(seq_lens, max_seq_len)[:, None])
    return torch.where(live, ref.gather(1, cand.clamp(0, max(max_seq_len - 1, 0))), float("-inf"))


def two_stage_topk_ref(q, pages, weights, seq_lens, page_table, max_seq_len, *, topk: int = TOPK,
                       margin: int = MARGIN) -> torch.Tensor:
    """:func:`two_stage_topk` on the two references."""
    stage1 = fp8_paged_mqa_logits_ref(q, pages, weights, seq_lens, page_table, max_seq_len)
    cand = _candidates(stage1, _live_lengths(seq_lens, max_seq_len), min(topk + margin, max_seq_len))
    return _selection(cand, rescore_candidates_ref(q, pages, weights, seq_lens, page_table, cand, max_seq_len), topk)

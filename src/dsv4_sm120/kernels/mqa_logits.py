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

Decode (fewer than ``PREFILL_ROWS`` rows): ``splits`` programs share a query row;
program p takes the row's key tiles p, p + P, p + 2P, ... where P is the number of
programs the row's live length needs (at most ``splits``). A tile is one page, 64
keys x 128 dims, read as one contiguous 16 KiB block from its page id (one scalar
load per tile), then one tensor-core product against the row's 64 heads, relu,
weight and a sum over heads in registers. A program's first page id does not
depend on the row's length, so it is loaded together with the length and the
queries (one memory latency less on tiny batches). The grid depends on the width
only through a cap (splits chosen to fill whole waves of resident programs), and
the work per program is set on the device from the live length, so a request with
4k keys is scored the same way whatever the width.

Prefill: one program scores ``ROWS_PER_PROGRAM`` (4) consecutive query rows. A
request's rows share its page table, so each key page is loaded once for the four
rows and scored by two [64 keys x 128] x [128 x 2*64 heads] products, both issued before
either's head sums, which are joined into one store (the key tile's trips from L2 were the limit with
one row per program; one [128 x 4*64] product held more registers than the program has, and spilled). Where the rows'
page ids differ (rows of two requests in one group), the program stores only the
rows that read the group's page and then scores the others again on their own
pages, so the output is the same for any grouping (bit for bit on a Hopper GPU).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels._common import cdiv, interpreting
from dsv4_sm120.kernels.launch import Launch, check_one_device, kept, lasting_key, same_memory, tensor_key
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, check_pages

# Launch defaults, from the Hopper sweeps in bench/results/kernels/indexer_h200_2026-12-01*.json (tune_*: decode
# timed in CUDA graphs over rotating page tables, prefill with do_bench).
MIN_TILES_PER_PROGRAM = 1
PREFILL_ROWS = 1024  # from this many query rows on, a program scores ROWS_PER_PROGRAM rows at once
ROWS_PER_PROGRAM = 4
DECODE_CONFIG = dict(num_warps=4, num_stages=8)  # 8 stages: 4 key pages in flight per program, 2 programs an SM
PREFILL_CONFIG = dict(num_warps=4, num_stages=3)
# Decode latency, Hopper tunes (tiny batches, 512 pages: 5-6 us kernels): the strided split (program p of a row
# takes tiles p, p + P, ...), whose first page id does not depend on the row's length and is loaded together with
# the length and the queries, beat a contiguous split by 3-15%. Loading the queries inside the tile pipeline was
# faster only where a program has one tile (1 x 4k) and slower elsewhere. The tune record keeps the variants'
# figures; the kernel keeps the winner only.
# Inline logits stores (see _store_logits) from this many rows on. Under Triton 3.8 on a Hopper GPU they make
# target-verify (16 and 128 rows) 3-9% faster but decode of 1 and 8 rows 1-5% slower (1 x 4k: 3.42 against
# 3.59 us with tl.store); from 64 rows on they are within 1%.
INLINE_STORE_MIN_ROWS = 16
# The one-row kernel's shared memory, from which its residency follows: num_stages // 2 key pages in flight, and
# on Hopper (wgmma reads its second operand from shared memory) the row's queries too. The AOT builds at 4-8
# stages hold 4-524 B more than the pages and queries (sm_90: 49-82 KiB, sm_120: 33-66 KiB);
# tests/kernels/test_aot_compile.py keeps this estimate at or above them, within 2 KiB. The driver keeps 1 KiB
# more a program. Registers (72 a thread) never bind first.
_SCRATCH_SMEM = 1024  # the stores' layout-change scratch and the page-id buffers (measured 4-524 B)
_RESERVED_SMEM = 1024  # per program, by the driver
_HOPPER_132_SM = dict(major=9, multi_processor_count=132, shared_memory_per_multiprocessor=233472,
                      max_threads_per_multi_processor=2048)  # the stand-in off a GPU (interpreter, CPU tests)
_DEVICE_PROPS: dict = {}
# decode_splits' answers: (rows, width in split units, device index, stages, warps, heads) -> splits. Eager decode
# widths grow with the context, so the table is emptied at a bound instead of growing without one.
_SPLITS: dict = {}
_SPLITS_MAX = 1 << 16
# bf16_paged_mqa_logits' plans, by argument layout (tensor_key of each tensor, the width, the options): eager decode
# widths grow with the context, so the table is emptied at a bound as well.
_PLANS: dict = {}
_PLANS_MAX = 1 << 12


def decode_program_smem(num_stages: int, *, major: int, heads: int = 64) -> int:
    """Estimated shared bytes of one decode program (see above) on a GPU of compute capability ``major``."""
    queries = heads * HEAD_DIM * 2 if major == 9 else 0
    return (num_stages // 2) * PAGE_SLOTS * HEAD_DIM * 2 + queries + _SCRATCH_SMEM


def _device_index(device: torch.device) -> int | None:
    """The CUDA device whose properties set the decode waves; None for the Hopper stand-in."""
    if device.type != "cuda" or interpreting():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_props(device: torch.device) -> dict:
    idx = _device_index(device)
    if idx is None:
        return _HOPPER_132_SM
    if idx not in _DEVICE_PROPS:
        p = torch.cuda.get_device_properties(idx)
        _DEVICE_PROPS[idx] = {k: getattr(p, k) for k in _HOPPER_132_SM}
    return _DEVICE_PROPS[idx]


def resident_programs(props: dict, num_stages: int, num_warps: int = 4, heads: int = 64) -> int:
    """Decode programs one multiprocessor of a GPU with these properties holds at once: on a Hopper GPU (228 KiB
    of shared memory) 2 at 8 stages, 3 at 6, 4 at 4; on an sm_120 GPU (100 KiB) 1 at 8 stages, 2 at 4 to 7."""
    smem = decode_program_smem(num_stages, major=props["major"], heads=heads) + _RESERVED_SMEM
    by_smem = props["shared_memory_per_multiprocessor"] // smem
    by_threads = props["max_threads_per_multi_processor"] // (32 * num_warps)
    return max(1, min(by_smem, by_threads))


def decode_splits(rows: int, max_seq_len: int, *, device: torch.device, num_stages: int, min_tiles: int = 1,
                  tile_pages: int = 1, num_warps: int = 4, heads: int = 64) -> int:
    """Programs per row for the one-row kernel: the fewest splits whose programs fill whole waves best.

    A wave is ``resident_programs`` on each multiprocessor of ``device``. For rows whose keys fill the
    width, time goes with (waves) x (tiles per program), so a split count whose programs end just under a
    whole number of waves wins (e.g. 256 rows on 132 x 3 slots: 3 splits, 768 programs in 2 waves, beat 2
    splits, 512 programs in 1.3 waves, by 11% on a Hopper GPU); each extra wave must gain 10% of fill (rows much
    shorter than the width leave most programs idle, and a second wave then only adds latency). Never more
    splits than the width has tiles.

    The search loops over up to 4 waves of programs (1,056 candidates for one row on a Hopper GPU: 2.2 ms of host
    time), so its answer is kept in ``_SPLITS`` per device and everything else it depends on.
    """
    max_splits = max(1, cdiv(max_seq_len, PAGE_SLOTS * tile_pages * min_tiles))
    key = (rows, max_splits, _device_index(device), num_stages, num_warps, heads)

    def search() -> int:
        props = _device_props(device)
        return _search_splits(rows, max_splits,
                              resident_programs(props, num_stages, num_warps, heads) * props["multi_processor_count"])
    return kept(_SPLITS, key, _SPLITS_MAX, search)


def _search_splits(rows: int, max_splits: int, slots: int) -> int:
    """The split count of :func:`decode_splits`: the score of ``sp`` splits is the filled fraction of the
    waves its ``rows * sp`` programs need, less 0.1 per wave past the first; the smallest ``sp`` of the best
    score wins (a later one must beat the best by more than 1e-9).

    Within one wave count the score grows with ``sp`` (by ``rows / (waves * slots)`` a step, far above 1e-9),
    so only the largest ``sp`` of each wave count can win, and it wins exactly where the count-by-count scan
    would end on it: one candidate per wave (at most 5) instead of every ``sp`` (1,056 for one row on a Hopper GPU,
    0.35 ms of host time each time a new batch size or width met the search in eager decode)."""
    upper = min(max_splits, max(1, (4 * slots) // rows))  # at most about 4 waves
    best, best_score = 1, -1.0
    for waves in range(1, cdiv(rows * upper, slots) + 1):
        sp = min(upper, (waves * slots) // rows)  # the most splits whose programs fit in these waves
        if sp < 1 or cdiv(rows * sp, slots) != waves:
            continue  # no split count needs exactly this many waves
        score = rows * sp / (waves * slots) - 0.1 * (waves - 1)
        if score > best_score + 1e-9:
            best, best_score = sp, score
    return best


@triton.jit
def _products(k, q_t, FP32_DOT: tl.constexpr):
    """k . q_t[:, c] for a key tile k [PAGE, D] and query columns q_t [D, C] (fp32 [PAGE, C])."""
    if FP32_DOT:  # the CPU interpreter's bf16 dot is wrong; exact bf16 products in fp32 agree
        return tl.dot(k.to(tl.float32), q_t.to(tl.float32), input_precision="ieee")
    return tl.dot(k, q_t)  # fp32 accumulate


@triton.jit
def _tile_scores(k, q_t, w, FP32_DOT: tl.constexpr):
    """w[c] * relu(k . q_t[:, c]) (fp32 [PAGE, C])."""
    return tl.maximum(_products(k, q_t, FP32_DOT), 0.0) * w[None, :]


@triton.jit
def _row_sums(s, w, PAGE: tl.constexpr, ROWS: tl.constexpr, H: tl.constexpr):
    """sum over each row's heads of w * relu(s), for products s [PAGE, ROWS * H] of ROWS rows side by side."""
    return tl.sum(tl.reshape(tl.maximum(s, 0.0) * w[None, :], (PAGE, ROWS, H)), axis=2)


@triton.jit
def _half_group(q_ptr, w_ptr, r0, n_rows, stride_q_row, stride_q_head, stride_w_row,
                HALF: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    """Queries [D, HALF * H] and head weights of rows r0 .. r0 + HALF - 1 (a short group repeats its last row)."""
    dims = tl.arange(0, D)
    cols = tl.arange(0, HALF * H)
    c_row = tl.minimum(r0 + cols // H, n_rows - 1).to(tl.int64)
    q_t = tl.load(q_ptr + c_row[None, :] * stride_q_row + (cols % H)[None, :] * stride_q_head + dims[:, None])
    return q_t, tl.load(w_ptr + c_row * stride_w_row + cols % H).to(tl.float32)


@triton.jit
def _store_logits(ptrs, vals, mask, INLINE: tl.constexpr):
    """Store fp32 logits where mask holds. INLINE: one st.global per value in the layout the head sum leaves
    it in; tl.store first moves it to a coalesced layout through shared memory, a round trip and a barrier per
    tile that stalls the next tile's product (Hopper: 5-9% of target-verify, 0.5-1% of decode; the CPU
    interpreter has no inline assembly, so it takes tl.store). A value held by several threads is stored by
    each of them: the same bytes, but in prefill's layout so many times over that tl.store is faster."""
    if INLINE:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }",
                                  "=r,l,f,r", [ptrs.to(tl.int64), vals, mask.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.store(ptrs, vals, mask=mask)


@triton.jit
def _load_row_q(q_ptr, w_ptr, stride_q_head, H: tl.constexpr, D: tl.constexpr):
    """One row's queries as the product's [D, H] operand and its head weights (fp32 [H])."""
    heads = tl.arange(0, H)
    q_t = tl.load(q_ptr + heads[None, :] * stride_q_head + tl.arange(0, D)[:, None])
    return q_t, tl.load(w_ptr + heads).to(tl.float32)


@triton.jit
def _row_group(seq_ptr, pt_ptr, stride_pt_row, n_rows, max_seq_len, R: tl.constexpr):
    """A prefill program's R consecutive rows, the last group first (in causal prefill the longest): its first row,
    the row offsets, the rows (a short last group repeats its last row, with no keys), their lengths, the longest,
    and the page table of a row with the most keys, whose pages the group loads."""
    group = tl.num_programs(0) - 1 - tl.program_id(0)
    r0 = group * R
    rr = tl.arange(0, R)
    rows = tl.minimum(r0 + rr, n_rows - 1).to(tl.int64)
    seqs = tl.where(r0 + rr < n_rows, tl.minimum(tl.load(seq_ptr + rows), max_seq_len), 0)
    seq_hi = tl.max(seqs, axis=0)
    ref = tl.minimum(r0 + tl.argmax(seqs, axis=0), n_rows - 1).to(tl.int64)
    return r0, rr, rows, seqs, seq_hi, pt_ptr + ref * stride_pt_row


@triton.jit
def _score_row(q_t, w, kv_ptr, pt_row, out_row, ref_pt, seq, t0, t1,
               D: tl.constexpr, PAGE: tl.constexpr, TP: tl.constexpr,
               ONLY_OTHER_PAGES: tl.constexpr, FP32_DOT: tl.constexpr, first_page=0, step=1,
               INLINE_STORE: tl.constexpr = False):
    """One query row (q_t [D, H], w [H]) over its key tiles t0, t0 + step, ... < t1, TP pages a tile; pt_row/out_row point
    at the row. With ONLY_OTHER_PAGES, only keys whose page differs from ``ref_pt``'s page are stored.
    """
    dims = tl.arange(0, D)
    offs = tl.arange(0, PAGE)
    in_page = offs[:, None] * D + dims[None, :]  # [PAGE, D] element offsets inside one page
    live_pages = tl.cdiv(seq, PAGE)
    for t in range(t0, t1, step):
        for i in tl.static_range(TP):
            p = t * TP + i
            n = p * PAGE + offs
            live = (n < seq) & (first_page >= 0)  # first_page: the early load of the first page id, always >= 0
            page = tl.load(pt_row + p, mask=p < live_pages, other=0).to(tl.int64)
            k = tl.load(kv_ptr + page * (PAGE * D) + in_page, mask=live[:, None], other=0.0)  # [PAGE, D]
            s = tl.sum(_tile_scores(k, q_t, w, FP32_DOT), axis=1)
            if ONLY_OTHER_PAGES:
                live = live & (page != tl.load(ref_pt + p).to(tl.int64))
            _store_logits(out_row + n, s, live, INLINE_STORE)


# Request-dependent arguments are not specialized: Triton would compile a kernel for each of their values that
# is 1, divisible by 16 or neither, so a new batch size or width would stall a request on a compile. Unspecialized
# they leave the decode builds' PTX (sm_90, sm_120) unchanged; in prefill only the output row stride matters, to
# how the head sums reach the store through shared memory (loop: sm_90 499 -> 496 instructions, sm_120 1253 ->
# 1232; the same products, key-page copies and global stores). The page ids and lengths are read one value at a
# time, so their alignment (a row slice of the metadata) changes no build either. Model-constant strides stay
# specialized.
@triton.jit(do_not_specialize=["stride_pt_row", "stride_out_row", "n_rows", "max_seq_len", "splits", "pt_cols"],
            do_not_specialize_on_alignment=["seq_ptr", "pt_ptr"])
def _logits_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row,
    n_rows, max_seq_len, splits, min_tiles, pt_cols,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr, TP: tl.constexpr,
    FP32_DOT: tl.constexpr, INLINE_STORE: tl.constexpr,
):
    if R == 1:  # decode: program (row, split) scores tiles split, split + P, ... of the row
        row = tl.program_id(0)
        split = tl.program_id(1)
        row64 = row.to(tl.int64)
        pt_row = pt_ptr + row64 * stride_pt_row
        # the first tile's page id and the queries do not depend on the row's length: all three loads
        # are in flight at once, and the pipeline's own load of the page id then finds it on chip
        first_page = tl.load(pt_row + split * TP, mask=split * TP < pt_cols, other=0)
        q_t, w = _load_row_q(q_ptr + row64 * stride_q_row, w_ptr + row64 * stride_w_row, stride_q_head, H, D)
        seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
        n_tiles = tl.cdiv(tl.cdiv(seq, PAGE), TP)
        active = tl.minimum(splits, tl.cdiv(n_tiles, min_tiles))  # programs that share this row's tiles
        if (split < active) & (first_page >= 0):  # (page ids are >= 0: the test keeps the load ahead of the branch)
            _score_row(q_t, w, kv_ptr, pt_row, out_ptr + row64 * stride_out_row, pt_row, seq, split, n_tiles,
                       D, PAGE, TP, False, FP32_DOT, first_page, active, INLINE_STORE)
    else:  # prefill: R consecutive rows per program; a key page they share is loaded once for all R
        r0, rr, rows, seqs, seq_hi, ref_pt = _row_group(seq_ptr, pt_ptr, stride_pt_row, n_rows, max_seq_len, R)
        # the R rows' heads side by side, in two halves scored by two products a tile: one product over all R
        # rows held more registers than a program has and spilled (Triton 3.8: 288 B, two halves 152 B;
        # 3-5% faster on a Hopper GPU). Triton still waits for both before the first head sum. The halves' head sums
        # are joined into one [PAGE, R] store: one layout change through shared memory (and its barrier) a tile
        # instead of two (Hopper, Triton 3.8: 3-6% faster, 136 B spilled; barrier waits were a third of the stalls).
        HALF: tl.constexpr = R // 2
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
            s_a = _products(k, q_a, FP32_DOT)
            s_b = _products(k, q_b, FP32_DOT)
            sums = tl.join(_row_sums(s_a, w_a, PAGE, HALF, H), _row_sums(s_b, w_b, PAGE, HALF, H))  # [PAGE, HALF, 2]
            _store_logits(out_rows + n[:, None], tl.reshape(tl.permute(sums, (0, 2, 1)), (PAGE, R)),
                          (n[:, None] < seqs[None, :]) & (mine == page)[None, :], INLINE_STORE)
        if tl.max(other, axis=0) > 0:  # rows of different requests in one group: each scores its own pages
            tl.debug_barrier()
            for i in tl.static_range(R):
                if tl.sum(tl.where(rr == i, other, 0), axis=0) > 0:
                    row = tl.minimum(r0 + i, n_rows - 1).to(tl.int64)
                    seq = tl.sum(tl.where(rr == i, seqs, 0), axis=0)
                    q_i, w_i = _load_row_q(q_ptr + row * stride_q_row, w_ptr + row * stride_w_row, stride_q_head, H, D)
                    _score_row(q_i, w_i, kv_ptr, pt_ptr + row * stride_pt_row, out_ptr + row * stride_out_row,
                               ref_pt, seq, 0, tl.cdiv(seq, PAGE), D, PAGE, 1, True, FP32_DOT, 0, 1, INLINE_STORE)


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
    # each torch call costs about a microsecond even when it returns its input: called only when needed
    if weights.shape != (rows, heads):
        weights = weights.reshape(rows, heads)
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    if seq_lens.dim() != 1:
        seq_lens = seq_lens.reshape(-1)
    if seq_lens.shape[0] != rows or page_table.dim() != 2 or page_table.shape[0] != rows:
        raise ValueError(f"seq_lens [rows] and page_table [rows, pages] must match q's {rows} rows; got "
                         f"{tuple(seq_lens.shape)} and {tuple(page_table.shape)}")
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
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
    rows_per_program: int | None = None,
    tile_pages: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    inline_store: bool | None = None,
) -> torch.Tensor:
    """fp32 logits [rows, max_seq_len] of bf16 queries against the bf16 index-K pool (see module doc).

    Only ``[0, min(seq_lens[t], max_seq_len))`` of row t is written. With one row per program (decode:
    the default below ``PREFILL_ROWS`` rows), ``splits`` programs share a row (default: enough programs
    to fill the GPU, fewer when the width has too few pages), each taking at least ``min_tiles`` tiles of
    ``tile_pages`` pages of the row's live length. With ``rows_per_program`` R > 1 (prefill), a program
    scores R consecutive rows and loads each key page they share once; rows whose pages differ (another
    request) are scored again on their own pages, so the result does not depend on R. ``inline_store``
    stores the logits with inline st.global (see ``_store_logits``); the default is on a GPU with one row
    per program and at least ``INLINE_STORE_MIN_ROWS`` rows (Hopper, Triton 3.8: target-verify 3-9% faster,
    decode of 1 and 8 rows 1-5% slower), and off in prefill, where the head sum's layout holds each of the
    R rows' logits in many threads (12-18% slower there).

    Everything but the tensors' addresses follows from the arguments' layout, so it is worked out once per
    layout (:func:`_logits_plan`); a call of a known layout allocates the output and launches.
    """
    options = (splits, min_tiles, rows_per_program, tile_pages, num_warps, num_stages, inline_store)
    plan = _plan(q, pages, weights, seq_lens, page_table, max_seq_len, out, options)
    if plan.copies:
        q, weights, seq_lens, page_table = _normalize(q, weights, seq_lens, page_table)
    if out is None:
        out = torch.empty(plan.out_shape, dtype=torch.float32, device=plan.device)
    if plan.launch is not None:
        plan.launch(q, weights, pages, seq_lens, page_table, out)
    return out


# The options of a call that passes none (the model's), read off bf16_paged_mqa_logits' keyword defaults in the
# order the wrapper keys its plans by, so that the two share plans and cannot drift apart.
DEFAULT_OPTIONS = tuple(p.default for p in inspect.signature(bf16_paged_mqa_logits).parameters.values()
                        if p.kind is p.KEYWORD_ONLY and p.name != "out")


class LogitsCall:
    """``bf16_paged_mqa_logits`` with one forward's lengths, page table, width and output bound, default options.

    Every C4 layer of a forward scores its own queries against its own pool with the same lengths, page table and
    width into the same output, so a layer's call keys its plan on its three tensors only; the bound tensors'
    layouts are read once, when the forward binds them (each tensor's layout read costs an eager call
    about a microsecond of a Hopper host's time). The queries and weights are the forward's own buffers, the same
    two tensors at every layer (``model.deepseek_v4.TopkInputs``): their layouts are read again only when other
    tensors come (the last two are held); a pool's page views last as the pool does (``launch.lasting_key``).
    Returns the bound output.
    """

    __slots__ = ("seq_lens", "page_table", "max_seq_len", "out", "_plans", "_last")

    def __init__(self, seq_lens: torch.Tensor, page_table: torch.Tensor, max_seq_len: int, out: torch.Tensor):
        self.seq_lens, self.page_table, self.max_seq_len, self.out = seq_lens, page_table, max_seq_len, out
        self._plans: dict = {}  # (q, weights, pages) layouts -> _Plan; a forward meets one or two
        self._last = (None, None, None)  # the last queries and weights met, and their layouts

    def __call__(self, q: torch.Tensor, pages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        last_q, last_w, layouts = self._last
        if q is not last_q or weights is not last_w:
            layouts = (tensor_key(q), tensor_key(weights))
            self._last = (q, weights, layouts)
        key = (*layouts, lasting_key(pages))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan(q, pages, weights, self.seq_lens, self.page_table, self.max_seq_len,
                                            self.out, DEFAULT_OPTIONS)
        if plan.copies:  # inputs to normalize first: the wrapper's own path
            return bf16_paged_mqa_logits(q, pages, weights, self.seq_lens, self.page_table, self.max_seq_len,
                                         out=self.out)
        if plan.launch is not None:
            plan.launch(q, weights, pages, self.seq_lens, self.page_table, self.out)
        return self.out


def _plan(q, pages, weights, seq_lens, page_table, max_seq_len, out, options: tuple) -> "_Plan":
    """The plan of this argument layout, worked out the first time it is met (:func:`_logits_plan`)."""
    key = (tensor_key(q), tensor_key(weights), tensor_key(seq_lens), tensor_key(page_table), tensor_key(pages),
           None if out is None else tensor_key(out), max_seq_len, options)
    return kept(_PLANS, key, _PLANS_MAX,
                lambda: _logits_plan(q, pages, weights, seq_lens, page_table, max_seq_len, out, *options))


class _Plan(NamedTuple):
    """What a call of one argument layout does besides reading addresses (see :func:`_logits_plan`)."""

    copies: bool  # the inputs need copies (dtype, inner stride) before the kernel reads them: _normalize per call
    out_shape: tuple
    device: torch.device
    launch: Launch | None  # None: nothing to score


def _logits_plan(q, pages, weights, seq_lens, page_table, max_seq_len, out, splits, min_tiles, rows_per_program,
                 tile_pages, num_warps, num_stages, inline_store) -> _Plan:
    """Checks, split count, grid and launch of bf16_paged_mqa_logits for one layout of its arguments: the
    per-call work of a call whose layout was seen before is reading six addresses."""
    check_pages(pages)
    check_one_device(q, pages, weights, seq_lens, page_table, out)
    given = (q, weights, seq_lens, page_table)
    q, weights, seq_lens, page_table = _normalize(*given)
    copies = not all(map(same_memory, given, (q, weights, seq_lens, page_table)))
    rows = q.shape[0]
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (rows, max_seq_len) or out.stride(1) != 1):
        raise ValueError(f"out must be fp32 [{rows}, {max_seq_len}] with unit inner stride")
    r = int(rows_per_program) if rows_per_program is not None else (ROWS_PER_PROGRAM if rows >= PREFILL_ROWS else 1)
    if r < 1 or r & (r - 1):
        raise ValueError(f"rows_per_program must be a power of two; got {r}")
    plan = _Plan(copies, (rows, max_seq_len), q.device, None)
    if rows == 0 or max_seq_len == 0:
        return plan
    cfg = PREFILL_CONFIG if r > 1 else DECODE_CONFIG
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    if r > 1:
        grid = (cdiv(rows, r), 1)
        splits = 1
    else:
        if splits is None:
            splits = decode_splits(rows, max_seq_len, device=q.device, num_stages=num_stages,
                                   min_tiles=min_tiles, tile_pages=tile_pages, num_warps=num_warps, heads=q.shape[1])
        grid = (rows, int(splits))
    interp = interpreting()
    return plan._replace(launch=Launch(
        _logits_kernel, grid,
        dict(stride_q_row=q.stride(0), stride_q_head=q.stride(1), stride_w_row=weights.stride(0),
             stride_pt_row=page_table.stride(0), stride_out_row=max_seq_len if out is None else out.stride(0),
             n_rows=rows, max_seq_len=max_seq_len, splits=int(splits), min_tiles=int(min_tiles),
             pt_cols=page_table.shape[1]),
        dict(H=q.shape[1], D=HEAD_DIM, PAGE=PAGE_SLOTS, R=r, TP=int(tile_pages), FP32_DOT=interp,
             INLINE_STORE=(r == 1 and rows >= INLINE_STORE_MIN_ROWS and not interp) if inline_store is None
             else bool(inline_store)),
        num_warps=num_warps, num_stages=num_stages))


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

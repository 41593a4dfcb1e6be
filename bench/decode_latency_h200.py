"""H200 bench of the latency-bound decode shapes of the bf16 logits kernel against upstream's TileLang fp8 kernel.

Issue 14 asks for ours/fp8 <= 1.00 on every decode shape; the 2026-12-01 headline run missed it only on the
tiny ones (1 x 4k, 1 x 32k, 8 x 4k: 3.5-6 us kernels of 64-512 pages). This script times, in one run and
beside upstream's kernel on the same page draws, the package's kernel (``base``) and candidate decode
kernels defined here, which differ from it only in how a short program starts:

* ``hint``: the page ids of a program's first HINT_TILES tiles are loaded with the row's length (the
  package loads only the first), so the pipeline's own page-id loads find them on chip;
* ``short``: a program with at most HINT_TILES tiles (known on the device from the length; the grid does
  not depend on it, as CUDA graphs need) loads all its key pages at once into registers, with no pipeline
  prologue and no page-id round trip, and scores them with one product; longer programs run the
  package's pipelined loop. Where the host sees that no row of the width can give a program more than
  HINT_TILES tiles, the loop is not compiled in (less shared memory);
* ``qin``: the queries are loaded after the length (short programs: after their key loads), not before;
* ``tma``: the package's pipelined loop with each 16 KiB key page moved by one Hopper TMA copy (host
  tensor descriptors), the queries by TMA too (``qld``: plain loads); ``sK``: K pipeline stages;
* ``half``: the strided split over half pages (32 keys a tile), twice the programs for rows of few pages;
* ``w8``: 8 warps instead of 4; ``sN`` (N >= 16): N programs per row instead of the wave-filling choice;
* ``diag_*``: diagnostics, not candidates (see ``configs_for``); ``diag_floor``: bench/read_floor_h200.py's
  read floors (the same pages read, nothing scored), bf16 and fp8 pages, Triton and Hopper bulk copies, and
  ``diag_probe``: the package's loop with its product or its stores left out.

Results (bench/results/kernels/indexer_h200_2026-12-01_tiny_bb0eeb3.json, ..._6aafe7e_tma.json): ``short`` reaches
0.96 of TileLang at 1 x 4k / width 4k (package 1.02); at 512 pages (1 x 32k, 8 x 4k) the best candidate is
1.08-1.13 (package 1.11-1.14) and at the capture width none beats the package kernel; the page-id hints change
nothing; TMA key pages are slower (1.07-1.20). TileLang's own time moved by up to 9% between runs here
(1 x 32k: 4.96-5.44 us), as much as the gaps being closed. The read floors (..._floors_*.json) put a
Triton read of the keys and queries at 1.01-1.02 of TileLang at 512 pages; half pages and one program a
multiprocessor were no better; ``asmstore`` gains 0.5-1% on decode and 6-9% on target-verify
(..._asmstore_0704fc0.json, ..._probes_04335b1.json); streaming stores and evict-first loads nothing.
Under the pin's Triton 3.8 (bench/triton38_device.sh at commit 6f9738b, removed since;
..._tiny_triton38_eeb4066.json) ``short_w8`` is the fastest on all six tiny pairs (0.96-1.12 of TileLang, the
package kernel 1.09-1.19), but on every shape
(..._decode_triton38_f26718a.json, _b2626c2, _6f2b6f0) it is 8-12% slower than the package at 1 x 128k and
2-8% from 8 x 32k on, and the host cannot tell a 4k row from a 128k row at the capture width: not adopted.
The same runs put the package's inline stores 1-5% behind tl.store on decode of 1 and 8 rows (3-9% ahead on
target-verify): the package now stores inline from ``INLINE_STORE_MIN_ROWS`` (16) rows on. Tried in 6f2b6f0
and dropped: one 128-key product over a pair of pages a tile with 8 warps (1.1-1.4x the package's time
everywhere), queries loaded only by programs that have keys (slower at the capture width, 3.68 against
3.55 us at 1 x 4k), and 6 stages at 1 x 128k (1-2% faster there, 1% slower at 1 x 4k and 1 x 32k).

Timing is bench/indexer_h200.py's: each kernel's launches in one CUDA graph over independent page draws
(at least 512 MiB of keys per replay), alternating rounds (every kernel once a round), the median. Every
configuration is checked on the first draw against the float64 reference (rel err, top-512, nothing
written past a length), and the candidates also on ragged lengths at two widths.

    PYTHONPATH=src COMMIT=$(git rev-parse HEAD) python -m bench.decode_latency_h200 --tilelang PATH/tilelang_kernel.py

writes bench/results/kernels/indexer_h200_2026-12-01_tiny_<commit>.json (or $OUT_JSON). ``--warm N`` compiles every
kernel first in N processes (Triton's and TileLang's caches are shared on disk); ``--dry-cpu`` runs tiny
shapes in Triton's interpreter to check the script and the candidates' results.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench import _gpu_common as g
from bench import indexer_h200 as ih
from bench import read_floor_h200 as rf
from dsv4_sm120.kernels import mqa_logits as ml
from dsv4_sm120.kernels._common import interpreting

PAGE, D, H, TOPK = ih.PAGE, ih.D, ih.H, ih.TOPK
WIDTH = ih.CAPTURE_WIDTH
TINY = ((1, 4096), (1, 32768), (8, 4096))
# programs per row tried beside the wave-filling choice (64 / 264 / 33 there): TileLang's split (64 / 256 / 32
# programs a row: 1 / 2 / 2 tiles each) and half as many programs (fewer copies of the row's queries)
SPLIT_VARIANTS = {(1, 4096): (32,), (1, 32768): (128, 256), (8, 4096): (16, 32)}
# programs per row of the half-page candidate (twice the package's choice, and as many as the halves / 2 / 4)
HALF_SPLITS = {(1, 4096): (128, 64), (1, 32768): (528, 264, 132), (8, 4096): (66, 33, 16)}
DECODE_B, DECODE_LIVE, VERIFY = (1, 8, 64, 256), (4096, 32768, 131072), ((8, 32768), (64, 32768))


# ----------------------------------------------------------------------------- candidate kernels
@triton.jit
def _hinted_page_ids(pt_row, first_page, split, splits, pt_cols, PAGE: tl.constexpr, HINTS: tl.constexpr):
    """Page ids of tiles split, split + splits, ... (HINTS of them, one per key slot: [HINTS * PAGE]), read
    within the table's width (the row's length is not known yet); and a test that they are all >= 0, which
    keeps their loads ahead of the branch on the length."""
    slot_tile = tl.arange(0, HINTS * PAGE) // PAGE
    pages = tl.zeros([HINTS * PAGE], dtype=tl.int32) + first_page
    ok = first_page >= 0
    for j in tl.static_range(1, HINTS):
        t = split + j * splits
        p = tl.load(pt_row + t, mask=t < pt_cols, other=0)
        pages = tl.where(slot_tile == j, p, pages)
        ok = ok & (p >= 0)
    return pages, ok


@triton.jit
def _load_q_t(q_row, stride_q_head, H: tl.constexpr, D: tl.constexpr):
    return tl.load(q_row + tl.arange(0, H)[None, :] * stride_q_head + tl.arange(0, D)[:, None])


@triton.jit
def _score_short(q_row, w, q_t, stride_q_head, kv_ptr, out_row, pages, seq, split, splits,
                 H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILES: tl.constexpr, LOAD_Q: tl.constexpr,
                 FP32_DOT: tl.constexpr):
    """A program of at most TILES tiles: all its key pages loaded at once, then one [TILES * 64] x [128 x H] product."""
    slot = tl.arange(0, TILES * PAGE)
    n = (split + (slot // PAGE) * splits) * PAGE + slot % PAGE
    live = n < seq
    k = tl.load(kv_ptr + pages.to(tl.int64)[:, None] * (PAGE * D) + ((slot % PAGE) * D)[:, None]
                + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
    if LOAD_Q:
        q_t = _load_q_t(q_row, stride_q_head, H, D)
    s = tl.sum(ml._tile_scores(k, q_t, w, FP32_DOT), axis=1)
    tl.store(out_row + n, s, mask=live)


@triton.jit
def _score_long(q_row, w, q_t, stride_q_head, kv_ptr, pt_row, out_row, seq, split, n_tiles, active, first_page,
                H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, LOAD_Q: tl.constexpr, FP32_DOT: tl.constexpr,
                INLINE_STORE: tl.constexpr):
    """The package's pipelined loop over tiles split, split + active, ... (queries loaded here with LOAD_Q)."""
    if LOAD_Q:
        q_t = _load_q_t(q_row, stride_q_head, H, D)
    ml._score_row(q_t, w, kv_ptr, pt_row, out_row, pt_row, seq, split, n_tiles, D, PAGE, 1, False, FP32_DOT,
                  first_page, active, INLINE_STORE)


@triton.jit
def _candidate_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row, max_seq_len, splits, pt_cols,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HINT_TILES: tl.constexpr, SHORT: tl.constexpr,
    Q_IN_BRANCH: tl.constexpr, HAS_LONG: tl.constexpr, FP32_DOT: tl.constexpr, INLINE_STORE: tl.constexpr,
):
    """The package's strided decode split (program p of a row takes tiles p, p + P, ...) with the variants above."""
    row, split, row64, pt_row, out_row, first_page = _program_row(pt_ptr, out_ptr, stride_pt_row, stride_out_row,
                                                                   pt_cols)
    q_row = q_ptr + row64 * stride_q_row
    pages, pages_ok = _hinted_page_ids(pt_row, first_page, split, splits, pt_cols, PAGE, HINT_TILES)
    w = tl.load(w_ptr + row64 * stride_w_row + tl.arange(0, H)).to(tl.float32)
    q_t = 0
    if not Q_IN_BRANCH:
        q_t = _load_q_t(q_row, stride_q_head, H, D)
    seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
    n_tiles = tl.cdiv(seq, PAGE)
    active = tl.minimum(splits, n_tiles)
    if (split < active) & pages_ok:
        if SHORT:
            if not HAS_LONG:
                _score_short(q_row, w, q_t, stride_q_head, kv_ptr, out_row, pages, seq, split, splits,
                             H, D, PAGE, HINT_TILES, Q_IN_BRANCH, FP32_DOT)
            elif n_tiles <= HINT_TILES * splits:
                _score_short(q_row, w, q_t, stride_q_head, kv_ptr, out_row, pages, seq, split, splits,
                             H, D, PAGE, HINT_TILES, Q_IN_BRANCH, FP32_DOT)
            else:
                _score_long(q_row, w, q_t, stride_q_head, kv_ptr, pt_row, out_row, seq, split, n_tiles, active,
                            first_page, H, D, PAGE, Q_IN_BRANCH, FP32_DOT, INLINE_STORE)
        else:
            _score_long(q_row, w, q_t, stride_q_head, kv_ptr, pt_row, out_row, seq, split, n_tiles, active,
                        first_page, H, D, PAGE, Q_IN_BRANCH, FP32_DOT, INLINE_STORE)


@triton.jit
def _program_row(pt_ptr, out_ptr, stride_pt_row, stride_out_row, pt_cols, SPLITS_PER_PAGE: tl.constexpr = 1):
    """A decode program's row and split, its row's page table and output, and its first tile's page id
    (SPLITS_PER_PAGE: tiles of a page, 2 for half pages)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row64 = row.to(tl.int64)
    pt_row = pt_ptr + row64 * stride_pt_row
    first = split // SPLITS_PER_PAGE
    return row, split, row64, pt_row, out_ptr + row64 * stride_out_row, tl.load(pt_row + first, mask=first < pt_cols,
                                                                               other=0)


@triton.jit
def _tma_kernel(
    q_ptr, q_desc, w_ptr, k_desc, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row, max_seq_len, splits, pt_cols,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, Q_TMA: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """The strided decode split with each key page moved by one Hopper TMA copy (``k_desc``: the pool as
    [pages * 64, 128], 64 x 128 boxes) in the pipelined loop; the queries by TMA too with Q_TMA. A page's
    rows past the length are read (the box is the whole page) but not stored."""
    row, split, row64, pt_row, out_row, first_page = _program_row(pt_ptr, out_ptr, stride_pt_row, stride_out_row,
                                                                   pt_cols)
    seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
    w = tl.load(w_ptr + row64 * stride_w_row + tl.arange(0, H)).to(tl.float32)
    if Q_TMA:
        q_t = tl.trans(q_desc.load([row * H, 0]))
    else:
        q_t = _load_q_t(q_ptr + row64 * stride_q_row, stride_q_head, H, D)
    n_tiles = tl.cdiv(seq, PAGE)
    active = tl.minimum(splits, n_tiles)
    offs = tl.arange(0, PAGE)
    if (split < active) & (first_page >= 0):
        for t in range(split, n_tiles, active):
            page = tl.load(pt_row + t)
            k = k_desc.load([page * PAGE, 0])
            s = tl.sum(ml._tile_scores(k, q_t, w, FP32_DOT), axis=1)
            n = t * PAGE + offs
            tl.store(out_row + n, s, mask=n < seq)


@triton.jit
def _half_page_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row, max_seq_len, splits, pt_cols,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """The strided decode split over half pages (32 keys): a row of few pages spreads over twice the programs,
    so each multiprocessor moves half a page of keys (TileLang's fp8 page is about half of ours)."""
    HALF: tl.constexpr = PAGE // 2
    row, split, row64, pt_row, out_row, first_page = _program_row(pt_ptr, out_ptr, stride_pt_row, stride_out_row,
                                                                   pt_cols, SPLITS_PER_PAGE=2)
    q_t, w = ml._load_row_q(q_ptr + row64 * stride_q_row, w_ptr + row64 * stride_w_row, stride_q_head, H, D)
    seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
    n_halves = tl.cdiv(seq, HALF)
    active = tl.minimum(splits, n_halves)
    offs = tl.arange(0, HALF)
    dims = tl.arange(0, D)
    if (split < active) & (first_page >= 0):
        for t in tl.range(split, n_halves, active, num_stages=STAGES):
            page = tl.load(pt_row + t // 2).to(tl.int64)
            n = t * HALF + offs
            live = n < seq
            k = tl.load(kv_ptr + page * (PAGE * D) + ((t % 2) * HALF + offs)[:, None] * D + dims[None, :],
                        mask=live[:, None], other=0.0)
            s = tl.sum(ml._tile_scores(k, q_t, w, FP32_DOT), axis=1)
            tl.store(out_row + n, s, mask=live)


@triton.jit
def _probe_kernel(
    q_ptr, w_ptr, kv_ptr, seq_ptr, pt_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_w_row, stride_pt_row, stride_out_row, max_seq_len, splits, pt_cols,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, DOT: tl.constexpr, STORE: tl.constexpr,
    ASM_STORE: tl.constexpr, STORE_CACHE: tl.constexpr, LOAD_EVICT: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """The package's strided decode loop with one stage left out, to place its time (diagnostics, not logits):
    without DOT a tile's keys are summed instead of scored (no queries, no product); without STORE a program
    stores one sum instead of its 64 logits a tile. ASM_STORE stores each logit with an inline st.global in
    the layout the head sum leaves it in, where tl.store first moves it to a coalesced layout through shared
    memory (ttg.convert_layout: a shared-memory round trip and a barrier a tile). STORE_CACHE / LOAD_EVICT: the
    logits' store cache modifier (".cs": streaming) and the key loads' eviction policy ("evict_first")."""
    row, split, row64, pt_row, out_row, first_page = _program_row(pt_ptr, out_ptr, stride_pt_row, stride_out_row,
                                                                   pt_cols)
    q_t, w = ml._load_row_q(q_ptr + row64 * stride_q_row, w_ptr + row64 * stride_w_row, stride_q_head, H, D)
    seq = tl.minimum(tl.load(seq_ptr + row), max_seq_len)
    n_tiles = tl.cdiv(seq, PAGE)
    active = tl.minimum(splits, n_tiles)
    offs = tl.arange(0, PAGE)
    in_page = offs[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([PAGE], dtype=tl.float32)
    if (split < active) & (first_page >= 0):
        for t in range(split, n_tiles, active):
            n = t * PAGE + offs
            live = n < seq
            page = tl.load(pt_row + t).to(tl.int64)
            k = tl.load(kv_ptr + page * (PAGE * D) + in_page, mask=live[:, None], other=0.0,
                        eviction_policy=LOAD_EVICT)
            if DOT:
                s = tl.sum(ml._tile_scores(k, q_t, w, FP32_DOT), axis=1)
            else:
                s = tl.sum(k.to(tl.float32), axis=1)
            if ASM_STORE:
                ml._store_logits(out_row + n, s, live, True)
            elif STORE:
                tl.store(out_row + n, s, mask=live, cache_modifier=STORE_CACHE)
            else:
                acc += s
        if not STORE and not ASM_STORE:
            tl.store(out_row + split, tl.sum(acc, 0))


def probe_logits(q, pages, weights, seq_lens, page_table, max_seq_len, *, out, dot=True, store=True, asm_store=False,
                 store_cache="", load_evict=""):
    """Launch the probe with the package's decode grid and launch configuration."""
    q, weights, seq_lens, page_table = ml._normalize(q, weights, seq_lens, page_table)
    stages = ml.DECODE_CONFIG["num_stages"]
    splits = ml.decode_splits(q.shape[0], max_seq_len, device=q.device, num_stages=stages)
    _probe_kernel[(q.shape[0], int(splits))](
        q, weights, pages, seq_lens, page_table, out,
        q.stride(0), q.stride(1), weights.stride(0), page_table.stride(0), out.stride(0), max_seq_len, int(splits),
        page_table.shape[1], H=q.shape[1], D=D, PAGE=PAGE, DOT=bool(dot), STORE=bool(store),
        ASM_STORE=bool(asm_store), STORE_CACHE=store_cache, LOAD_EVICT=load_evict, FP32_DOT=interpreting(),
        **ml.DECODE_CONFIG)
    return out


def half_page_logits(q, pages, weights, seq_lens, page_table, max_seq_len, *, out, splits, num_warps=4,
                     num_stages=4):
    """Launch the half-page candidate (``splits`` programs a row)."""
    q, weights, seq_lens, page_table = ml._normalize(q, weights, seq_lens, page_table)
    _half_page_kernel[(q.shape[0], int(splits))](
        q, weights, pages, seq_lens, page_table, out,
        q.stride(0), q.stride(1), weights.stride(0), page_table.stride(0), out.stride(0), max_seq_len, int(splits),
        page_table.shape[1], H=q.shape[1], D=D, PAGE=PAGE, STAGES=num_stages, FP32_DOT=interpreting(),
        num_warps=num_warps, num_stages=num_stages)
    return out


def tma_logits(q, pages, weights, seq_lens, page_table, max_seq_len, *, out, q_tma=True, splits=None, num_warps=4,
               num_stages=8):
    """Launch the TMA candidate (host tensor descriptors: the CUDA graph keeps them as kernel parameters)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    q, weights, seq_lens, page_table = ml._normalize(q, weights, seq_lens, page_table)
    rows, heads = q.shape[0], q.shape[1]
    if splits is None:
        splits = ml.decode_splits(rows, max_seq_len, device=q.device, num_stages=num_stages)
    k_desc = TensorDescriptor.from_tensor(pages.view(-1, D), [PAGE, D])
    q_desc = TensorDescriptor.from_tensor(q.reshape(rows * heads, D), [heads, D])
    _tma_kernel[(rows, int(splits))](
        q, q_desc, weights, k_desc, seq_lens, page_table, out,
        q.stride(0), q.stride(1), weights.stride(0), page_table.stride(0), out.stride(0), max_seq_len, int(splits),
        page_table.shape[1], H=heads, D=D, PAGE=PAGE, Q_TMA=bool(q_tma), FP32_DOT=interpreting(),
        num_warps=num_warps, num_stages=num_stages)
    return out


def candidate_logits(q, pages, weights, seq_lens, page_table, max_seq_len, *, out, hint_tiles=2, short=True,
                     q_in_branch=False, splits=None, num_warps=4, num_stages=8, inline_store=False):
    """Launch a candidate on the package's inputs (decode: one row per program). Returns out."""
    q, weights, seq_lens, page_table = ml._normalize(q, weights, seq_lens, page_table)
    rows = q.shape[0]
    if splits is None:
        splits = ml.decode_splits(rows, max_seq_len, device=q.device, num_stages=num_stages)
    per_program = triton.cdiv(triton.cdiv(max_seq_len, PAGE), splits)  # most tiles a program of this width takes
    hint = max(1, min(int(hint_tiles), per_program))
    has_long = not short or per_program > hint
    _candidate_kernel[(rows, int(splits))](
        q, weights, pages, seq_lens, page_table, out,
        q.stride(0), q.stride(1), weights.stride(0), page_table.stride(0), out.stride(0), max_seq_len, int(splits),
        page_table.shape[1], H=q.shape[1], D=D, PAGE=PAGE, HINT_TILES=hint, SHORT=bool(short),
        Q_IN_BRANCH=bool(q_in_branch), HAS_LONG=bool(has_long), FP32_DOT=interpreting(),
        INLINE_STORE=bool(inline_store) and not interpreting(),
        num_warps=num_warps, num_stages=num_stages)
    return out


# ----------------------------------------------------------------------------- configurations per shape
def configs_for(b, live, width, verify=False):
    """name -> (kind, kwargs): ``base`` is the package's default launch; ``diag_*`` are diagnostics, not
    candidates (``diag_h32``: half the heads, so half the query bytes; ``diag_l2``: every row reads page 0,
    so the keys come from L2: the latency floor without the HBM transfer)."""
    cfg = {"base": ("package", {}),
           "asmstore": ("probe", dict(asm_store=True)),
           "probe": ("probe", {}),
           "probe_cs": ("probe", dict(store_cache=".cs")),
           "probe_ef": ("probe", dict(load_evict="evict_first")),
           "probe_cs_ef": ("probe", dict(store_cache=".cs", load_evict="evict_first")),
           "short": ("candidate", dict(hint_tiles=2, short=True)),
           "short_w8": ("candidate", dict(hint_tiles=2, short=True, num_warps=8)),
           "base_tlstore": ("package", dict(inline_store=False)),
           "base_inline": ("package", dict(inline_store=True)),
           "hint2": ("candidate", dict(hint_tiles=2, short=False)),
           "hint2_inline": ("candidate", dict(hint_tiles=2, short=False, inline_store=True)),
           "tma": ("tma", {}),
           "tma_w8": ("tma", dict(num_warps=8)),
           "tma_qld": ("tma", dict(q_tma=False)),
           "tma_s4": ("tma", dict(num_stages=4))}
    if FLOORS["on"] and not verify:
        cfg.update({"diag_probe": ("diag_probe", {}), "diag_probe_nostore": ("diag_probe", dict(store=False)),
                    "diag_probe_nodot": ("diag_probe", dict(dot=False)),
                    "diag_probe_nodot_nostore": ("diag_probe", dict(dot=False, store=False))})
        cfg.update({n: ("diag_floor", kw) for n, kw in rf.floor_configs(b, live, width, bulk=FLOORS["bulk"]).items()})
    if (b, live) == (1, 131072):  # the one larger shape within 3% of TileLang: deeper or more programs
        cfg.update({"base_st6": ("package", dict(num_stages=6)), "base_st6_tlstore": ("package", dict(num_stages=6,
                    inline_store=False)), "base_s528": ("package", dict(splits=528))})
    if verify or (b, live) not in TINY:
        return cfg
    cfg.update({"base_st4": ("package", dict(num_stages=4)), "base_st6": ("package", dict(num_stages=6)),
                "base_st3": ("package", dict(num_stages=3)), "base_q1": ("package", dict(qloop_tiles=1)),
                "tma_w8_qld": ("tma", dict(num_warps=8, q_tma=False)),
                "tma_s6": ("tma", dict(num_stages=6)),
                "diag_h32": ("diag_h32", {}), "diag_l2": ("diag_l2", {})})
    for sp in HALF_SPLITS.get((b, live), ()):
        cfg[f"half_s{sp}"] = ("half", dict(splits=sp))
        cfg[f"half_s{sp}_st2"] = ("half", dict(splits=sp, num_stages=2))
    if b * live >= 32768:  # one program a multiprocessor: one copy of the queries each, not two
        cfg["base_s132"] = ("package", dict(splits=max(1, 132 // b)))
        cfg["base_s132_st6"] = ("package", dict(splits=max(1, 132 // b), num_stages=6))
    if width == live:  # the grid may change with the width (never with the live length)
        for sp in SPLIT_VARIANTS.get((b, live), ()):
            cfg[f"base_s{sp}"] = ("package", dict(splits=sp))
            cfg[f"tma_s{sp}"] = ("tma", dict(splits=sp))
            cfg[f"short_w8_s{sp}"] = ("candidate", dict(hint_tiles=2, short=True, splits=sp, num_warps=8))
    return cfg


# All-page-0 tables of the diag_l2 launcher, held for the whole run: a captured graph reads the table by address,
# so it must outlive the launcher that made it (held only by that closure, it was freed and its memory reused
# while the graphs of the 04edcfe / 0256c10 / 6aafe7e runs still read it: the illegal accesses of those runs).
_ZERO_TABLES: dict = {}
FLOORS = {"on": False, "bulk": False}
_FP8_POOLS: dict = {}  # bf16 pool's address -> the same keys in upstream's fp8 pages (the TileLang peer's pool)
_BULK: list = []


def floor_launcher(kw, pool):
    """A read floor over the bf16 pool's pages or over the same pages in fp8 (see bench/read_floor_h200.py)."""
    kw = dict(kw)
    impl, pb = kw.pop("impl"), kw["page_bytes"]
    if pb == rf.FP8_PAGE_BYTES:
        if pool.data_ptr() not in _FP8_POOLS:  # made on the eager check call, never inside a graph capture
            _FP8_POOLS[pool.data_ptr()] = ih.fp8_pool(pool)
        src = _FP8_POOLS[pool.data_ptr()]
    else:
        src = pool
    flat = src.view(torch.uint8).reshape(src.shape[0], pb)
    if impl == "triton":
        words = flat.view(torch.int32)
        with_q = kw.pop("read_q", False)
        return lambda q, w, sl, pt, out: rf.triton_read(words, pt, sl, out, pt.shape[1] * PAGE,
                                                        q=q if with_q else None, **kw)
    if not _BULK:
        _BULK.append(rf.BulkReader())
    return lambda q, w, sl, pt, out: _BULK[0](flat, pt, sl, out, pt.shape[1] * PAGE, **kw)


def launcher(kind, kw, pool, width):
    if kind == "package":
        return lambda q, w, sl, pt, out: ml.bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=out, **kw)
    if kind == "tma":
        return lambda q, w, sl, pt, out: tma_logits(q, pool, w, sl, pt, width, out=out, **kw)
    if kind == "diag_floor":
        return floor_launcher(kw, pool)
    if kind in ("diag_probe", "probe"):
        return lambda q, w, sl, pt, out: probe_logits(q, pool, w, sl, pt, width, out=out, **kw)
    if kind == "half":
        return lambda q, w, sl, pt, out: half_page_logits(q, pool, w, sl, pt, width, out=out, **kw)
    if kind == "diag_h32":
        return lambda q, w, sl, pt, out: ml.bf16_paged_mqa_logits(q[:, :32], pool, w[:, :32], sl, pt, width, out=out)
    if kind == "diag_l2":
        def run_l2(q, w, sl, pt, out):
            key = (tuple(pt.shape), str(pt.device))
            if key not in _ZERO_TABLES:  # made on the eager check call, never inside a graph capture
                _ZERO_TABLES[key] = torch.zeros_like(pt)
            return ml.bf16_paged_mqa_logits(q, pool, w, sl, _ZERO_TABLES[key], width, out=out)
        return run_l2
    return lambda q, w, sl, pt, out: candidate_logits(q, pool, w, sl, pt, width, out=out, **kw)


def all_shapes():
    """(tag, B, live, width, rows_per_req) for every decode and target-verify shape of the headline run."""
    out = []
    for b in DECODE_B:
        for live in DECODE_LIVE:
            for width in sorted({live, WIDTH}):
                out.append(("decode", b, live, width, 1))
    for b, live in VERIFY:
        for width in sorted({live, WIDTH}):
            out.append(("target_verify", b, live, width, 2))
    return out


# ----------------------------------------------------------------------------- warm-up in parallel
def _warm_worker(jobs):
    """Compile (launch on lengths 0) every kernel a list of jobs needs, in a fresh process."""
    t0 = time.time()
    torch.cuda.set_device(0)
    pool = torch.zeros((64, PAGE, D), dtype=torch.bfloat16, device="cuda")
    done = 0
    for job in jobs:
        if job[0] == "tilelang":
            _, path, rows, width = job
            fn, why = ih.load_tilelang(path)
            if fn is None:
                return f"tilelang not loaded: {why}"
            pool8 = ih.fp8_pool(pool)
            q8 = torch.zeros((rows, 1, H, D), dtype=torch.float8_e4m3fn, device="cuda")
            w8 = torch.zeros((rows, H), device="cuda")
            sl = torch.zeros((rows,), dtype=torch.int32, device="cuda")
            pt = torch.zeros((rows, width // PAGE), dtype=torch.int32, device="cuda")
            fn(q8, pool8, w8, sl, pt, None, width, False)
        else:
            _, kind, kw, rows, width = job
            q = torch.zeros((rows, H, D), dtype=torch.bfloat16, device="cuda")
            w = torch.zeros((rows, H), device="cuda")
            sl = torch.zeros((rows,), dtype=torch.int32, device="cuda")
            pt = torch.zeros((rows, width // PAGE), dtype=torch.int32, device="cuda")
            out = torch.empty((rows, width), device="cuda")
            launcher(kind, kw, pool, width)(q, w, sl, pt, out)
        done += 1
    torch.cuda.synchronize()
    return f"{done} jobs in {time.time() - t0:.1f} s"


def warm(n_procs, tilelang_path):
    """Every (kernel, specialization) of the run compiled once, spread over n_procs processes."""
    import multiprocessing as mp

    jobs, seen = [], set()
    for tag, b, live, width, rpr in all_shapes():
        rows = b * rpr
        for name, (kind, kw) in configs_for(b, live, width, verify=tag != "decode").items():
            key = (kind, tuple(sorted(kw.items())), rows, width)
            if key not in seen:
                seen.add(key)
                jobs.append(("triton", kind, kw, rows, width))
        if tilelang_path:
            split_kv = max(1, min(width // PAGE, 256 // rows))
            if ("tl", split_kv) not in seen:
                seen.add(("tl", split_kv))
                jobs.append(("tilelang", tilelang_path, rows, width))
    tl_jobs = [j for j in jobs if j[0] == "tilelang"]
    tr_jobs = [j for j in jobs if j[0] != "tilelang"]
    chunks = [[j] for j in tl_jobs] + [tr_jobs[i::max(1, n_procs - len(tl_jobs))]
                                       for i in range(max(1, n_procs - len(tl_jobs)))]
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(n_procs, len(chunks))) as p:
        msgs = p.map(_warm_worker, [c for c in chunks if c])
    print(f"warm: {len(jobs)} jobs ({len(tl_jobs)} TileLang) in {time.time() - t0:.1f} s: {msgs}", flush=True)
    return {"jobs": len(jobs), "tilelang_jobs": len(tl_jobs), "seconds": time.time() - t0}


# ----------------------------------------------------------------------------- graph-replay preflight
def _preflight_worker(kind):
    """Every configuration of one kind on the tiny shapes: eager, captured, replayed 20 times, synchronised.
    In its own process, so an illegal access (which poisons the CUDA context) only loses this kind."""
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    pool = torch.randn((4096, PAGE, D), generator=gen, device="cuda").to(torch.bfloat16)
    done = []
    for b, live in TINY:
        for width in sorted({live, WIDTH}):
            draws = [(q, w, pt[:, : width // PAGE].contiguous()) for q, w, pt in ih.decode_draws(pool, b, live, gen, 8)]
            sl = torch.full((b,), live, dtype=torch.int32, device="cuda")
            out = torch.empty((b, width), device="cuda")
            for name, (k, kw) in configs_for(b, live, width).items():
                if k != kind:
                    continue
                try:
                    run = launcher(k, kw, pool, width)
                    run(*draws[0][:2], sl, draws[0][2], out)
                    torch.cuda.synchronize()
                    graph = ih._capture([(lambda q=q, w=w, pt=pt: run(q, w, sl, pt, out)) for q, w, pt in draws])
                    for _ in range(20):
                        graph.replay()
                    torch.cuda.synchronize()
                    done.append(f"{name}@{b}x{live}/{width}")
                except Exception as exc:
                    return {"kind": kind, "ok": done, "failed": f"{name}@{b}x{live}/{width}",
                            "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"kind": kind, "ok": done, "failed": None}


def preflight(kinds):
    import multiprocessing as mp

    t0 = time.time()
    with mp.get_context("spawn").Pool(len(kinds)) as p:
        out = p.map(_preflight_worker, kinds)
    print(f"preflight in {time.time() - t0:.1f} s: " + "; ".join(
        f"{r['kind']}: {len(r['ok'])} ok" + (f", FAILED {r['failed']} ({r['error']})" if r["failed"] else "")
        for r in out), flush=True)
    return out


# ----------------------------------------------------------------------------- measuring
def reference(q, pool, w, sl, pt, width, rows):
    idx = torch.as_tensor(rows, device=q.device)
    return idx, ml.paged_mqa_logits_ref(q[idx], pool, w[idx], sl[idx], pt[idx], width, dtype=torch.float64,
                                        rows_per_chunk=1)


def check_against(out, idx, ref, sl):
    """bench/indexer_h200's agreement checks on the sampled rows ``idx`` of ``out``."""
    return ih.agreement(out[idx], ref, sl[idx])


def time_shape(peer, pool, draws, sl, width, configs, rounds):
    """Every configuration and upstream's kernel on the same draws: checks on draw 0, then alternating rounds."""
    q0, w0, pt0 = draws[0]
    idx, ref = reference(q0, pool, w0, sl, pt0, width, list(range(min(q0.shape[0], 3))))
    res = {"draws": len(draws), "configs": {}}
    scratch = torch.empty((q0.shape[0], width), device=q0.device)
    timers = {}
    for name, (kind, kw) in configs.items():
        run = launcher(kind, kw, pool, width)
        out = torch.full((q0.shape[0], width), float("nan"), device=q0.device)
        entry = {"kind": kind, **kw}
        try:
            run(q0, w0, sl, pt0, out)
            entry["check"] = None if kind.startswith("diag") else check_against(out, idx, ref, sl)
            if g._DRY["on"]:
                timers[name] = lambda run=run: _wall_ms(lambda: run(q0, w0, sl, pt0, scratch))
            else:
                graph = ih._capture([(lambda q=q, w=w, pt=pt, run=run: run(q, w, sl, pt, scratch)) for q, w, pt in draws])
                timers[name] = lambda gr=graph: ih._replay_ms(gr, len(draws))
        except Exception as exc:  # a candidate failing on a shape is recorded, not fatal
            entry["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        res["configs"][name] = entry
        del out
    if peer is not None:
        try:
            calls = [peer.bind(q, w, sl, pt, width) for q, w, pt in draws]
            if g._DRY["on"]:
                timers["fp8"] = lambda: _wall_ms(calls[0])
            else:
                graph = ih._capture(calls)
                timers["fp8"] = lambda gr=graph: ih._replay_ms(gr, len(draws))
        except Exception as exc:
            res["fp8_error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
    g.preheat()
    times = {}
    ih._time_alternating(times, timers, rounds)
    res["fp8_ms"] = times.get("fp8_ms")
    res["fp8_ms_rounds"] = times.get("fp8_ms_rounds")
    for name, entry in res["configs"].items():
        if f"{name}_ms" in times:
            entry["ms"], entry["ms_rounds"] = times[f"{name}_ms"], times[f"{name}_ms_rounds"]
            entry["ratio"] = entry["ms"] / res["fp8_ms"] if res["fp8_ms"] else None
    ok = {n: e for n, e in res["configs"].items() if "ms" in e and e["check"] and _passes(e["check"])}
    res["best"] = min(ok, key=lambda n: ok[n]["ms"]) if ok else None
    del timers, scratch
    if not g._DRY["on"]:
        torch.cuda.synchronize()
    return res


def _passes(check):
    return (check["rel_err"] <= 1e-5 and check["top512_identical"] and check["live_all_written"]
            and check["past_length_untouched"])


def _wall_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ragged_checks(pool, gen, dev, dry, excluded=()):
    """Each candidate on rows of mixed lengths (short and long programs in one launch) at two widths."""
    out = []
    cases = [((1, 63, 64, 65, 700, 2048, 4095, 4096), 4096), ((1, 63, 64, 65, 700, 4096, 4097, 20000), 32768),
             ((1, 65, 4000, 4096, 33000, 70001, 131072, 2), WIDTH)]
    if dry:
        cases = [((1, 63, 64, 65, 200, 255, 256, 130), 256), ((1, 65, 300, 1000, 64, 7, 1024, 2), 1024)]
    for lens, width in cases:
        q, w, sl, pt = ih.case(pool.shape[0], len(lens), list(lens), width, gen)
        idx, ref = reference(q, pool, w, sl, pt, width, list(range(len(lens))))
        for b_like in (1, 8):
            for name, (kind, kw) in configs_for(b_like, 4096, width).items():
                if kind.startswith("diag") or kind in excluded:
                    continue
                buf = torch.full((len(lens), width), float("nan"), device=dev)
                try:
                    launcher(kind, kw, pool, width)(q, w, sl, pt, buf)
                    out.append({"lens": list(lens), "width": width, "config": name, **check_against(buf, idx, ref, sl)})
                except Exception as exc:
                    out.append({"lens": list(lens), "width": width, "config": name,
                                "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tilelang", help="upstream's tilelang_kernel.py from the sglang==0.5.23 wheel")
    ap.add_argument("--warm", type=int, default=0, help="compile every kernel first in this many processes")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kinds", default="package,candidate,tma,diag_h32,diag_l2",
                    help="configuration kinds to run (comma-separated); the others are left out")
    ap.add_argument("--preflight", action="store_true",
                    help="first replay each kind's graphs in its own process; a kind that faults is left out")
    ap.add_argument("--no-bulk-floor", action="store_true", help="diag_floor without the CUDA bulk-copy floors")
    ap.add_argument("--only-tiny", action="store_true", help="only the six tiny decode pairs")
    ap.add_argument("--dry-cpu", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global DECODE_B, DECODE_LIVE, VERIFY, WIDTH, TINY, SPLIT_VARIANTS, HALF_SPLITS
    dev = "cuda"
    if args.dry_cpu:
        dev = ih.DEV = "cpu"
        ih.SIZES.update(ih.DRY_SIZES)
        g.dry_run_mode()
        DECODE_B, DECODE_LIVE, VERIFY, WIDTH, TINY = (1, 2), (256,), ((2, 256),), 1024, ((1, 256), (2, 256))
        SPLIT_VARIANTS = {(1, 256): (2,)}
        HALF_SPLITS = {(1, 256): (8, 3), (2, 256): (5,)}
    elif args.only_tiny:
        DECODE_B, DECODE_LIVE, VERIFY = (1, 8), (4096, 32768), ()
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    meta = g.run_meta()
    print(meta, flush=True)
    result = {**meta, "capture_width": WIDTH, "rounds": args.rounds, "method": (
        "decode and target-verify as bench/indexer_h200.py: each kernel's launches in one CUDA graph over "
        "independent page draws (>= 512 MiB of keys a replay), every configuration and upstream's TileLang fp8 "
        "kernel once per round in turn, the median of the rounds; checks on draw 0 against the float64 reference")}
    t_start = time.time()
    FLOORS.update(on="diag_floor" in args.kinds.split(","), bulk=not args.dry_cpu and not args.no_bulk_floor)
    if args.warm and not args.dry_cpu:
        try:
            result["warm"] = warm(args.warm, args.tilelang)
        except Exception as exc:  # the run goes on compiling as it goes
            result["warm"] = {"error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
            print("warm failed:", result["warm"], flush=True)
    kinds = args.kinds.split(",")
    excluded = {"package", "candidate", "tma", "half", "probe", "diag_h32", "diag_l2", "diag_floor"} - set(kinds)
    result["kinds"] = kinds
    if args.preflight and not args.dry_cpu:
        result["preflight"] = preflight(kinds)
        excluded |= {r["kind"] for r in result["preflight"] if r["failed"]}
    fn, why_not = ih.load_tilelang(None if args.dry_cpu else args.tilelang)
    result["tilelang"] = {"loaded": fn is not None, "why_not": why_not, "file": args.tilelang}
    pool_pages = max(max(DECODE_B) * max(DECODE_LIVE) // PAGE, 8 * math.ceil(WIDTH / PAGE))
    pool = torch.randn((pool_pages, PAGE, D), generator=gen, device=dev).to(torch.bfloat16)
    peer = ih.Fp8Peer(fn, ih.fp8_pool(pool)) if fn is not None else None  # upstream's TileLang kernel
    if peer is not None:
        _FP8_POOLS[pool.data_ptr()] = peer.pool8
    result["ragged"] = ragged_checks(pool, gen, dev, args.dry_cpu, excluded)
    bad = [r for r in result["ragged"] if "error" in r or not _passes(r)]
    print(f"ragged: {len(result['ragged'])} checks, {len(bad)} failing {bad[:3]}", flush=True)
    commit = meta["commit"][:7]
    default = g.REPO / "bench" / "results" / "kernels" / f"indexer_h200_{time.strftime('%Y-%m-%d')}_tiny_{commit}.json"
    path = Path(os.environ.get("OUT_JSON", "/tmp/decode_latency_dry.json" if args.dry_cpu else default))
    result["shapes"] = []
    for tag, b, live, width, rpr in all_shapes():
        n = 1 if args.dry_cpu else ih.rotation_count(b, live)
        draws = ih.decode_draws(pool, b, live, gen, n, rows_per_req=rpr)
        draws = [(q, w, pt[:, : math.ceil(width / PAGE)].contiguous()) for q, w, pt in draws]
        lens = [live] * b if rpr == 1 else [x for _ in range(b) for x in (live - 1, live)]
        sl = torch.as_tensor(lens, dtype=torch.int32, device=dev)
        configs = {n: c for n, c in configs_for(b, live, width, verify=tag != "decode").items() if c[0] not in excluded}
        res = time_shape(peer, pool, draws, sl, width, configs, 1 if args.dry_cpu else args.rounds)
        res.update(shape=tag, B=b, live=live, width=width, rows=b * rpr)
        result["shapes"].append(res)
        line = " ".join(f"{k}={e['ms'] * 1e3:.2f}" + ("" if not e["check"] or _passes(e["check"]) else "!BAD")
                        for k, e in res["configs"].items() if "ms" in e)
        fp8 = f"{res['fp8_ms'] * 1e3:.2f}" if res.get("fp8_ms") else "-"
        print(f"{tag} B={b} live={live} width={width} fp8={fp8} us | {line} | best {res['best']}", flush=True)
        del draws
        result["seconds"] = time.time() - t_start
        g.write_json(path, result)  # after every shape: a run stopped at its limit keeps what it measured


if __name__ == "__main__":
    main()

"""Compile (or load from Triton's disk cache) every kernel variant a server launches, before it serves.

Without this, the first request of each new shape stalled 1.3-2.1 s on a Hopper GPU while Triton compiled a kernel.
A variant is one entry of Triton's kernel cache: a constexpr branch the wrappers choose (logits:
decode below and from ``INLINE_STORE_MIN_ROWS`` rows, prefill from ``PREFILL_ROWS``; the store, alone under
upstream's multi-stream split and with the query in one launch on one stream: extend and decode plans) times what Triton specializes the runtime arguments on (``launch.specialization_key``). The
arguments that follow the request (rows, widths, splits, page-table width, the metadata slices' alignment) are
left unspecialized in the kernels, so what remains is fixed by the model: its head count, dtypes and strides.
One tiny launch of each branch, through the same public wrappers the model calls, therefore compiles every
variant a request can meet: ``SERVING_VARIANTS`` (one more with the page checksum on). tests/kernels/
test_specialization.py checks that a sweep of request shapes meets no other.
"""

from __future__ import annotations

import time

import torch

from dsv4_sm120.kernels import index_k_store, index_query, mqa_logits, page_checksum, query_store, two_stage_logits
from dsv4_sm120.kernels._common import interpreting
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, ROPE_DIM

SERVING_VARIANTS = 8  # logits 3, store 2, query 1, query and store in one launch 2; the page checksum is one more
TWO_STAGE_VARIANTS = 2  # DSV4_SM120_INDEX_K_SELECT=two_stage: the prefill scan and the re-score


def serving_calls(device: torch.device, *, heads: int, checksum: bool = False, two_stage: bool = False) -> list:
    """(name, call) for each variant, on tiny tensors of the dtypes the model hands the kernels (the AOT specs'
    signatures, which tests/kernels/test_model_build.py checks against the real model): bf16 queries and head
    weights from upstream's bf16 linears, fp32 compressed keys and norm weight, int64 positions and slots."""
    def zeros(*shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=device)

    pages = zeros(4, PAGE_SLOTS, HEAD_DIM, dtype=torch.bfloat16)
    freqs = zeros(PAGE_SLOTS, ROPE_DIM // 2, dtype=torch.complex64)
    keys = 2 * PAGE_SLOTS

    def logits(rows, score=mqa_logits.bf16_paged_mqa_logits, *extra):  # queries, weights as index_query_bf16's
        return lambda: score(
            zeros(rows, heads, HEAD_DIM, dtype=torch.bfloat16), pages, zeros(rows, heads, 1, dtype=torch.float32),
            zeros(rows, dtype=torch.int32), zeros(rows, 2, dtype=torch.int32), *extra, keys)

    def store(mode):  # every slot -1: skipped, so nothing is read through the plan or written
        n = 3
        return lambda: index_k_store.store_index_k_bf16(
            zeros(n, HEAD_DIM, dtype=torch.float32), pages, zeros(n, dtype=torch.int64) - 1,
            norm_weight=zeros(HEAD_DIM, dtype=torch.float32), norm_eps=1e-6, freqs=freqs, mode=mode,
            plan=zeros(n, 16, dtype=torch.uint8), compress_ratio=4)

    def query_and_store(mode):  # as store(mode), with one query row
        n = 3
        out = (zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16), zeros(1, heads, 1, dtype=torch.float32))
        call = query_store.QueryStoreCall(zeros(1, dtype=torch.int64), out, zeros(n, dtype=torch.int64) - 1,
                                          zeros(n, 16, dtype=torch.uint8), mode)
        return lambda: call(zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16), zeros(1, heads, dtype=torch.bfloat16), 1.0,
                            freqs, zeros(n, HEAD_DIM, dtype=torch.float32), pages,
                            norm_weight=zeros(HEAD_DIM, dtype=torch.float32), norm_eps=1e-6, k_freqs=freqs)

    calls = [("logits[decode]", logits(1)),
             ("logits[decode, inline stores]", logits(mqa_logits.INLINE_STORE_MIN_ROWS)),
             ("logits[prefill]", logits(mqa_logits.PREFILL_ROWS)),
             ("index_k_store[extend]", store("extend")),
             ("index_k_store[decode]", store("decode")),
             ("index_query", lambda: index_query.index_query_bf16(
                 zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16), zeros(1, heads, dtype=torch.bfloat16), 1.0, freqs,
                 zeros(1, dtype=torch.int64))),
             ("query_store[extend]", query_and_store("extend")),
             ("query_store[decode]", query_and_store("decode"))]
    if checksum:
        calls.append(("page_checksum", lambda: page_checksum.page_checksum_triton(pages.view(torch.uint8).flatten(1))))
    if two_stage:  # only prefill chunks select in two stages: the prefill scan, then the re-score (no candidate)
        rows = mqa_logits.PREFILL_ROWS
        calls += [("two_stage[prefill scan]", logits(rows, two_stage_logits.fp8_paged_mqa_logits)),
                  ("two_stage[re-score]", logits(rows, two_stage_logits.rescore_candidates,
                                                 zeros(rows, 4, dtype=torch.int32) - 1))]
    return calls


def compile_for_serving(device, *, heads: int, checksum: bool = False, two_stage: bool = False) -> dict:
    """Launch every kernel variant once on ``device`` so no request compiles one; returns
    ``{"variants", "compiled", "seconds"}``: the variants launched, how many of them this process had not
    compiled or loaded yet, and the wall time (a few seconds per variant on a cold Triton cache, well under
    one on a warm one). ``heads`` is the indexer's query heads on this rank (a power of two, at least 16);
    ``checksum`` adds the page checksum (``DSV4_SM120_INDEX_K_CHECKSUM=1``), ``two_stage`` the two-stage
    selection's kernels (``DSV4_SM120_INDEX_K_SELECT=two_stage``). Off CUDA it does nothing."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return {"variants": 0, "compiled": 0, "seconds": 0.0}
    start = time.perf_counter()
    with torch.cuda.device(device):
        index = torch.cuda.current_device()
        kernels = (mqa_logits._logits_kernel, index_k_store._store_kernel, index_query._query_kernel,
                   query_store._query_store_kernel, page_checksum._checksum_kernel, two_stage_logits._scan_kernel,
                   two_stage_logits._rescore_kernel)
        before = sum(len(k.device_caches[index][0]) for k in kernels)  # Triton's compiled kernels per device
        calls = serving_calls(device, heads=heads, checksum=checksum, two_stage=two_stage)
        for _, call in calls:
            call()
        torch.cuda.synchronize()
        compiled = sum(len(k.device_caches[index][0]) for k in kernels) - before
    return {"variants": len(calls), "compiled": compiled, "seconds": time.perf_counter() - start}

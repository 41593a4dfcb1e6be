"""Which Triton specializations the package's kernels meet: the warmup's launches against a sweep of request
shapes, each key told by ``launch.specialization_key`` and by Triton's own binder. Run by
tests/kernels/test_specialization.py in a fresh interpreter without ``TRITON_INTERPRET`` (the kernels must be
``JITFunction``s); prints one ``RESULT {json}`` line.

Nothing is launched or compiled: the tensors live on the ``meta`` device (their addresses are their byte
offsets, so a row slice keeps its alignment) and ``launch.launch`` is replaced by a recorder. Triton's
binder is built for sm_90 (``create_function_from_signature`` with the CUDA backend, as ``JITFunction`` builds
it at its first launch on a GPU) and keyed as ``JITFunction.run`` keys its cache (``compute_cache_key``).
"""

from __future__ import annotations

import json
import sys

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

from dsv4_sm120.kernels import (index_k_store, index_query, launch, mqa_logits, page_checksum, query_store,
                                two_stage_logits, warmup)

HEADS, D, PAGE = 64, 128, 64
CAPTURE_KEYS = 262144  # the decode width the bench captures at (a 1M-token context, compressed by 4)
BACKEND = make_backend(GPUTarget("cuda", 90, 32))
RECORDS: list = []


def record(kernel, grid, args, constexprs, *, num_warps, num_stages):
    RECORDS.append((kernel, launch.all_args(kernel, args, constexprs), num_warps, num_stages))


launch.launch = page_checksum.launch = two_stage_logits.launch = record  # Launch objects launch through launch.launch


def meta(*shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def keys_of(records) -> tuple[dict, list]:
    """Our key -> Triton's cache keys, for each recorded launch (both include the kernel and its options), and
    each launch's kernel, constexprs and pointer types as Triton's binder gives them."""
    out, launches, binders = {}, [], {}
    for kernel, args, num_warps, num_stages in records:
        ours = (kernel.fn.__name__, num_warps, num_stages, launch.specialization_key(kernel, args))
        if kernel not in binders:
            binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
        _, specialization, options = binders[kernel](*args, num_warps=num_warps, num_stages=num_stages)
        theirs = kernel.fn.__name__ + compute_cache_key({}, specialization, options)
        out.setdefault(repr(ours), set()).add(theirs)
        launches.append({"kernel": kernel.fn.__name__,
                         "constexprs": {p.name: a for p, a in zip(kernel.params, args) if p.is_constexpr},
                         "pointers": {p.name: ty for p, (ty, *_) in zip(kernel.params, specialization)
                                      if isinstance(ty, str) and ty.startswith("*")}})
    return out, launches


def model_step(tokens: int, max_seq_len: int, table_pages: int, chunk: int, decode: bool, split: bool = False,
               two_stage: bool = False):
    """The indexer's launches for one step as the model makes them (dsv4_sm120/model/deepseek_v4.py): store the
    step's compressed keys and rotate the queries (one launch on one stream; two under upstream's multi-stream
    split, ``split``), score them chunk by chunk against the pool (``two_stage``: in two stages where the model
    does, ``DSV4_SM120_INDEX_K_SELECT=two_stage``)."""
    pages = meta(64, PAGE, D, dtype=torch.bfloat16)
    freqs = meta(1 << 20, 32, dtype=torch.complex64)
    buf = meta(tokens + 7, dtype=torch.int64)  # metadata kept in longer buffers: the step's rows are a slice
    kv, norm = meta(tokens, D, dtype=torch.float32), meta(D, dtype=torch.float32)
    plan, mode = meta(tokens, 16, dtype=torch.uint8), "decode" if decode else "extend"
    q_in, w_in = meta(tokens, HEADS, D, dtype=torch.bfloat16), meta(tokens, HEADS, dtype=torch.bfloat16)
    if split:
        index_k_store.store_index_k_bf16(kv, pages, buf[:tokens], norm_weight=norm, norm_eps=1e-6, freqs=freqs,
                                         mode=mode, plan=plan)
        q, w = index_query.index_query_bf16(q_in, w_in, 0.01, freqs, buf[:tokens])
    else:
        out = (meta(tokens, HEADS, D, dtype=torch.bfloat16), meta(tokens, HEADS, 1, dtype=torch.float32))
        q, w = query_store.QueryStoreCall(buf[:tokens], out, buf[:tokens], plan, mode)(
            q_in, w_in, 0.01, freqs, kv, pages, norm_weight=norm, norm_eps=1e-6, k_freqs=freqs)
    seq_lens = meta(tokens + 5, dtype=torch.int32)[:tokens]
    table = meta(tokens, table_pages, dtype=torch.int32)
    for start in range(0, tokens, chunk):
        r = slice(start, min(tokens, start + chunk))
        in_two_stages = (two_stage and r.stop - start >= mqa_logits.PREFILL_ROWS  # the model's two_stage_chunk
                         and max_seq_len > two_stage_logits.TOPK + two_stage_logits.MARGIN)
        score = two_stage_logits.two_stage_paged_mqa_logits if in_two_stages else mqa_logits.bf16_paged_mqa_logits
        score(q[r], pages, w[r], seq_lens[r], table[r], max_seq_len)


def sweep_keys() -> dict:
    RECORDS.clear()
    for rows in range(1, 65):  # decode: CUDA-graph batches at the capture width, and eager at growing widths
        model_step(rows, CAPTURE_KEYS, CAPTURE_KEYS // PAGE, rows, decode=True)
        model_step(rows, CAPTURE_KEYS, CAPTURE_KEYS // PAGE, rows, decode=True, split=True)  # a captured graph
        for width in (1, 17, 64, 1000, 4096, 40001):
            model_step(rows, width, -(-width // PAGE), rows, decode=True)
    for rows in (1, 2, 3, 15, 16, 17, 100, 1023, 1024, 1025, 2047, 4096, 4099, 5000):  # extend / prefill
        for width in (1, 5, 16, 17, 333, 1024, 8191):
            for pages in sorted({-(-width // PAGE), -(-width // PAGE) + 3, 129}):
                for chunk in sorted({rows, 1000, 4096}):
                    model_step(rows, width, pages, chunk, decode=False)
        model_step(rows, 8191, 129, rows, decode=False, split=True)  # an extend captured with the split
    for rows in (1024, 1025, 4096, 5000):  # prefill chunks that select in two stages (DSV4_SM120_INDEX_K_SELECT)
        for width in (1025, 8191, 40001):
            for chunk in sorted({rows, 4096}):
                model_step(rows, width, -(-width // PAGE), chunk, decode=False, two_stage=True)
    page_rows = meta(64, PAGE * D * 2, dtype=torch.uint8)
    for n in (1, 2, 17, 64):  # the page checksum (HiCache / PD integrity) on any number of pages
        page_checksum.page_checksum_triton(page_rows[:n])
    return keys_of(RECORDS)[0]


def warmup_keys() -> tuple[dict, list]:
    RECORDS.clear()
    for _, call in warmup.serving_calls(torch.device("meta"), heads=HEADS, checksum=True, two_stage=True):
        call()
    return keys_of(RECORDS)


def mirror_mismatches() -> list:
    """Values on which ``launch``'s per-argument key and Triton's native specialization partition differently."""
    values = [0, 1, 2, 15, 16, 17, 48, -16, -1, (1 << 31) - 16, 1 << 31, -(1 << 31), (1 << 32) + 16,
              (1 << 63) - 16, 1 << 63, (1 << 64) - 16, True, False, 0.5, 1.0]
    tensors = [meta(64, dtype=dt)[off:] for dt in (torch.int32, torch.int64, torch.bfloat16, torch.float32)
               for off in (0, 1, 2, 4, 8)]
    bad = []
    for specialize in (True, False):
        for align in (True, False):
            seen = {}
            for value in values + tensors:
                ours = launch._arg_key(value, specialize, align)
                theirs = native_specialize_impl(BACKEND, value, False, specialize, align)
                seen.setdefault(ours, set()).add(repr(theirs))
            theirs_seen = [t for ts in seen.values() for t in ts]
            if any(len(ts) > 1 for ts in seen.values()) or len(theirs_seen) != len(set(theirs_seen)):
                bad.append({"specialize": specialize, "align": align, "classes": {repr(k): sorted(v) for k, v in seen.items()}})
    return bad


def main() -> None:
    sweep, (warm, warm_launches) = sweep_keys(), warmup_keys()
    both = {**sweep, **warm}
    print("RESULT " + json.dumps({
        "sweep": sorted(sweep), "warmup": sorted(warm), "warmup_launches": warm_launches,
        "ours_split_by_triton": sorted(k for k, v in both.items() if len(v) > 1),
        "triton_keys": len({t for v in both.values() for t in v}), "our_keys": len(both),
        "mirror_mismatches": mirror_mismatches(),
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Ahead-of-time compilation of every kernel for sm_90 and sm_120, without a GPU.

Triton compiles a ``@triton.jit`` function for a named ``GPUTarget`` on a
machine with no GPU, so CI catches a kernel that stops building for Blackwell
(sm_120) or Hopper (sm_90) before anyone deploys it. ``KERNEL_SPECS`` lists
each kernel with the argument types and constexprs it is launched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4_sm120.kernels import (index_k_store, index_query, mqa_logits, page_checksum, page_copy, page_ledger,
                                query_store, two_stage_logits)
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, ROPE_DIM

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_120": GPUTarget("cuda", 120, 32)}
# Shared memory one program may use (the opt-in per-block maximum): 227 KiB on Hopper, 99 KiB on consumer and
# workstation Blackwell (RTX PRO 6000, compute capability 12.0). A kernel over it builds but fails at launch.
SMEM_PER_BLOCK = {"sm_90": 232448, "sm_120": 101376}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3


def _store_spec(mode: int) -> KernelSpec:
    # upstream's compressor hands the store fp32 rows (bf16 x bf16 -> fp32 GEMM, then compress_forward in the
    # input dtype) and the store casts the norm weight to that dtype
    sig = {"kv_ptr": "*fp32", "stride_kv": "i64", "plan_ptr": "*i32", "pos_ptr": "*i64", "loc_ptr": "*i64",
           "w_ptr": "*fp32", "freqs_ptr": "*fp32", "pages_ptr": "*bf16", "n_rows": "i32", "eps": "fp32", "ratio": "i32"}
    return KernelSpec(f"index_k_store[mode={mode}]", index_k_store._store_kernel, sig,
                      {"MODE": mode, "BLOCK_N": index_k_store.BLOCK_N, "D": HEAD_DIM, "ROPE": ROPE_DIM,
                       "PAGE": PAGE_SLOTS})


def _query_store_spec(mode: int) -> KernelSpec:
    # the query's and the store's inputs as the model hands each of them (above and below)
    sig = {"q_ptr": "*bf16", "qw_ptr": "*bf16", "q_out_ptr": "*bf16", "qw_out_ptr": "*fp32", "q_freqs_ptr": "*fp32",
           "q_pos_ptr": "*i64", "kv_ptr": "*fp32", "plan_ptr": "*i32", "k_pos_ptr": "*i64", "loc_ptr": "*i64",
           "norm_w_ptr": "*fp32", "k_freqs_ptr": "*fp32", "pages_ptr": "*bf16", "n_q_rows": "i32", "n_heads": "i32",
           "weight_scale": "fp32", "stride_kv": "i64", "n_k_rows": "i32", "eps": "fp32", "ratio": "i32"}
    return KernelSpec(f"query_store[mode={mode}]", query_store._query_store_kernel, sig,
                      {"MODE": mode, "Q_BLOCK": query_store.QUERY_BLOCK, "K_BLOCK": query_store.STORE_BLOCK,
                       "D": HEAD_DIM, "ROPE": ROPE_DIM, "PAGE": PAGE_SLOTS})


def _logits_spec(rows_per_program: int = 1, inline_store: bool = True) -> KernelSpec:
    sig = {"q_ptr": "*bf16", "w_ptr": "*fp32", "kv_ptr": "*bf16", "seq_ptr": "*i32", "pt_ptr": "*i32",
           "out_ptr": "*fp32", "stride_q_row": "i64", "stride_q_head": "i64", "stride_w_row": "i64",
           "stride_pt_row": "i64", "stride_out_row": "i64", "n_rows": "i32", "max_seq_len": "i32", "splits": "i32",
           "min_tiles": "i32", "pt_cols": "i32"}
    cfg = mqa_logits.PREFILL_CONFIG if rows_per_program > 1 else mqa_logits.DECODE_CONFIG
    name = "mqa_logits[prefill]" if rows_per_program > 1 else "mqa_logits" if inline_store else "mqa_logits[few-rows]"
    return KernelSpec(name, mqa_logits._logits_kernel, sig,
                      {"H": 64, "D": HEAD_DIM, "PAGE": PAGE_SLOTS, "R": rows_per_program, "TP": 1, "FP32_DOT": False,
                       "INLINE_STORE": rows_per_program == 1 and inline_store},
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _scan_spec(rows_per_program: int) -> KernelSpec:
    """Stage 1 of the two-stage indexer: e4m3 queries (quantized by torch once a call), bf16 pages."""
    ts = two_stage_logits
    sig = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "kv_ptr": "*bf16", "seq_ptr": "*i32", "pt_ptr": "*i32",
           "out_ptr": "*fp32", "stride_q_row": "i64", "stride_q_head": "i64", "stride_w_row": "i64",
           "stride_pt_row": "i64", "stride_out_row": "i64", "n_rows": "i32", "max_seq_len": "i32", "splits": "i32"}
    cfg = ts.SCAN_PREFILL_CONFIG if rows_per_program > 1 else ts.SCAN_DECODE_CONFIG
    return KernelSpec(f"two_stage[scan{'-prefill' if rows_per_program > 1 else ''}]", ts._scan_kernel, sig,
                      {"H": 64, "D": HEAD_DIM, "PAGE": PAGE_SLOTS, "R": rows_per_program, "FP32_DOT": False},
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _rescore_spec() -> KernelSpec:
    """Stage 2 of the two-stage indexer: the bf16 queries and weights the single-stage kernel takes."""
    ts = two_stage_logits
    sig = {"q_ptr": "*bf16", "w_ptr": "*fp32", "kv_ptr": "*bf16", "seq_ptr": "*i32", "pt_ptr": "*i32",
           "cand_ptr": "*i32", "out_ptr": "*fp32", "stride_q_row": "i64", "stride_q_head": "i64",
           "stride_w_row": "i64", "stride_pt_row": "i64", "stride_c_row": "i64", "stride_out_row": "i64",
           "n_cand": "i32", "max_seq_len": "i32"}
    return KernelSpec("two_stage[rescore]", ts._rescore_kernel, sig,
                      {"H": 64, "D": HEAD_DIM, "PAGE": PAGE_SLOTS, "FP32_DOT": False},
                      num_warps=ts.RESCORE_CONFIG["num_warps"], num_stages=ts.RESCORE_CONFIG["num_stages"])


KERNEL_SPECS = (
    _store_spec(0), _store_spec(1), _store_spec(2),
    KernelSpec("index_query", index_query._query_kernel,  # q and head weights as upstream's bf16 linears give them
               {"q_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "w_out_ptr": "*fp32", "freqs_ptr": "*fp32",
                "pos_ptr": "*i64", "n_rows": "i32", "n_heads": "i32", "weight_scale": "fp32"},
               {"BLOCK_N": index_query.BLOCK_N, "D": HEAD_DIM, "ROPE": ROPE_DIM}),
    _query_store_spec(1), _query_store_spec(2),
    _logits_spec(),
    _logits_spec(inline_store=False),  # decode below INLINE_STORE_MIN_ROWS rows
    _logits_spec(mqa_logits.ROWS_PER_PROGRAM),
    _scan_spec(1), _scan_spec(two_stage_logits.ROWS_PER_PROGRAM), _rescore_spec(),
    KernelSpec("page_checksum", page_checksum._checksum_kernel,
               {"x_ptr": "*i32", "out_ptr": "*i64", "row_words": "i32", "stride_row": "i64"},
               {"BLOCK": page_checksum.BLOCK}, num_warps=page_checksum.NUM_WARPS),
    KernelSpec("page_ledger[record]", page_ledger._record_kernel,
               {"rows_ptr": "*i32", "stride_row": "i64", "row_words": "i32", "dev_ptr": "*i64", "host_ptr": "*i64",
                "expected_ptr": "*i64", "recorded_ptr": "*u8", "verified_ptr": "*u8", "layer_off": "i64"},
               {"BLOCK": page_ledger.BLOCK}, num_warps=page_ledger.NUM_WARPS),
    KernelSpec("page_ledger[check]", page_ledger._check_kernel,  # upstream's load indices are int64
               {"rows_ptr": "*i32", "stride_row": "i64", "row_words": "i32", "dev_idx_ptr": "*i64",
                "host_idx_ptr": "*i64", "slots_per_page": "i32", "expected_ptr": "*i64", "recorded_ptr": "*u8",
                "verified_ptr": "*u8", "layer_off": "i64", "out_ptr": "*i64"},
               {"BLOCK": page_ledger.BLOCK}, num_warps=page_ledger.NUM_WARPS),
    KernelSpec("page_ledger[key_sums]", page_ledger._key_sums_kernel,
               {"keys_ptr": "*i32", "stride_key": "i64", "key_words": "i32", "slots_ptr": "*i64", "out_ptr": "*i64"},
               {"BLOCK": page_ledger.KEY_BLOCK}, num_warps=1, num_stages=1),
    KernelSpec("page_ledger[lost_keys]", page_ledger._lost_keys_kernel,
               {"keys_ptr": "*i32", "stride_key": "i64", "key_words": "i32", "slots_ptr": "*i64", "sums_ptr": "*i64",
                "keys_per_page": "i32", "out_ptr": "*i64"},
               {"BLOCK": page_ledger.KEY_BLOCK}, num_warps=1, num_stages=1),
    KernelSpec("page_copy", page_copy._copy_pages_kernel,
               {"src_ptr": "*i32", "dst_ptr": "*i32", "src_idx_ptr": "*i32", "dst_idx_ptr": "*i32"},
               {"PAGE_WORDS": 4096, "BLOCK": page_copy.BLOCK}),
)


def _jit_specialization(spec: KernelSpec) -> dict:
    """The divisibility Triton's JIT finds at launch: torch's tensors are 16-byte aligned and the strides the
    kernels get are multiples of 16, except the arguments a kernel leaves unspecialized (``do_not_specialize``,
    ``do_not_specialize_on_alignment``). Without it the build differs from the one that runs: bf16 loads that
    might be unaligned are not vectorized, so the logits kernels' key pages are not pipelined (Triton 3.8)."""
    params = {p.name: p for p in spec.fn.params}
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(spec.signature.items())
            if (ty.startswith("*") or name.startswith("stride"))
            and not params[name].do_not_specialize and not params[name].do_not_specialize_on_alignment}


def compile_for(spec: KernelSpec, target: GPUTarget):
    """Compile one kernel for one target as the JIT would at launch; returns Triton's compiled kernel (.asm,
    .metadata.shared)."""
    signature = dict(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn=spec.fn, signature=signature, constexprs=dict(spec.constexprs),
                    attrs=_jit_specialization(spec))
    return triton.compile(src, target=target, options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})

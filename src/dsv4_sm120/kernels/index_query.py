"""bf16 indexer query: RoPE on the last 64 dims + 128-point Hadamard, kept in bf16.

Upstream's fused query kernel ends in a per-(token, head) fp8 quantization and
folds that scale into the head weights. With bf16 keys there is nothing to
quantize: the rotated query stays bf16 and the head weights are only scaled by
``weight_scale`` (softmax_scale * n_heads^-0.5), returned as fp32 [T, H, 1]
like upstream's ``weights_out``; the same launch scales them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels._common import (cdiv, hadamard_128, hadamard_matrix, rope_tail_interleaved, rope_tail_ref,
                                         to_bf16_rne)
from dsv4_sm120.kernels.index_k_store import as_freqs_real
from dsv4_sm120.kernels.launch import Launch, check_one_device, kept, same_memory, tensor_key
from dsv4_sm120.kernels.layout import HEAD_DIM, ROPE_DIM

BLOCK_N = 32
_PLANS: dict = {}  # index_query_bf16's plans, by argument layout and weight scale
_PLANS_MAX = 1 << 12


# The positions are read one value a row, so their alignment changes no build (sm_90, sm_120): a slice of the
# batch's positions compiles nothing new. n_rows (tokens x heads) is always a multiple of 16 (heads are).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _query_kernel(q_ptr, w_ptr, out_ptr, w_out_ptr, freqs_ptr, pos_ptr, n_rows, n_heads, weight_scale,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr):
    query_block(tl.program_id(0), q_ptr, w_ptr, out_ptr, w_out_ptr, freqs_ptr, pos_ptr, n_rows, n_heads, weight_scale,
                BLOCK_N, D, ROPE)


@triton.jit
def query_block(block, q_ptr, w_ptr, out_ptr, w_out_ptr, freqs_ptr, pos_ptr, n_rows, n_heads, weight_scale,
                BLOCK_N: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr):
    """Block ``block`` of BLOCK_N (token, head) rows: the query kernel's work, also run by the fused
    query-and-store launch (kernels/query_store.py)."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # (token, head) pairs
    ok = rows < n_rows
    # the head weight of each pair, scaled in fp32 as torch's `weights.float() * scale` rounds it: here rather
    # than in two more launches per call
    w = tl.load(w_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + rows, w * weight_scale, mask=ok)
    pos = tl.load(pos_ptr + rows // n_heads, mask=ok, other=0).to(tl.int64)
    cols = tl.arange(0, D)
    base = rows.to(tl.int64)[:, None] * D
    x = tl.load(q_ptr + base + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    xp = tl.load(q_ptr + base + (cols ^ 1)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    is_rope = cols >= (D - ROPE)
    fcol = tl.where(is_rope, (cols - (D - ROPE)) & ~1, 0)
    fmask = ok[:, None] & is_rope[None, :]
    fbase = freqs_ptr + pos[:, None] * ROPE + fcol[None, :]
    cos = tl.load(fbase, mask=fmask, other=1.0)
    sin = tl.load(fbase + 1, mask=fmask, other=0.0)
    y = hadamard_128(rope_tail_interleaved(x, xp, cos, sin, cols, D - ROPE))
    tl.store(out_ptr + base + cols[None, :], to_bf16_rne(y), mask=ok[:, None])


def _check(q, weights, positions):
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must be [T, H, {HEAD_DIM}]; got {tuple(q.shape)}")
    if tuple(weights.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(f"weights must be [T, H] matching q; got {tuple(weights.shape)} for q {tuple(q.shape)}")
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must be [T]; got {tuple(positions.shape)} for {q.shape[0]} tokens")


def index_query_bf16(q, weights, weight_scale: float, freqs, positions, *, out: tuple | None = None):
    """q [T, H, 128] (any float) -> (rotated q bf16 [T, H, 128], weights fp32 [T, H, 1]).

    As bf16_paged_mqa_logits, the checks and the launch are worked out once per argument layout
    (:func:`_query_plan`); a call of a known layout allocates the two outputs and launches. ``out``: the two
    outputs' buffers (contiguous), written instead of allocated: a forward's, which its C4 layers share
    (``model.deepseek_v4.TopkInputs``; the two allocations were 12 of an eager call's 28 us of host time on an
    Hopper host).
    """
    key = (tensor_key(q), tensor_key(weights), tensor_key(positions), tensor_key(freqs), weight_scale,
           None if out is None else (tensor_key(out[0]), tensor_key(out[1])))
    plan = kept(_PLANS, key, _PLANS_MAX, lambda: _query_plan(q, weights, weight_scale, freqs, positions, out))
    if plan.copies:
        q, weights, freqs, positions = _inputs(q, weights, freqs, positions)
    if out is None:
        out = (torch.empty(plan.out_shape, dtype=torch.bfloat16, device=plan.device),
               torch.empty(plan.weights_shape, dtype=torch.float32, device=plan.device))
    if plan.launch is not None:
        plan.launch(q, weights, out[0], out[1], freqs, positions)
    return out


class _Plan(NamedTuple):
    """What a call of one argument layout does besides reading addresses (see :func:`_query_plan`)."""

    copies: bool  # an input needs a copy (layout or dtype) before the kernel reads it: _inputs per call
    out_shape: tuple
    weights_shape: tuple
    device: torch.device
    launch: Launch | None  # None: no rows


def _inputs(q, weights, freqs, positions):
    """The inputs as the kernel reads them: contiguous, the head weights [T, H], the RoPE table fp32 pairs."""
    if not q.is_contiguous():
        q = q.contiguous()
    if weights.dim() != 2:  # [T, H, 1] (_check has matched the first two dims to q's)
        weights = weights.reshape(q.shape[0], q.shape[1])
    if not weights.is_contiguous():
        weights = weights.contiguous()
    if not positions.is_contiguous():
        positions = positions.contiguous()
    return q, weights, as_freqs_real(freqs), positions


def _query_plan(q, weights, weight_scale, freqs, positions, out) -> _Plan:
    """Checks and launch of index_query_bf16 for one layout of its arguments."""
    _check(q, weights, positions)
    check_one_device(q, weights, freqs, positions, *(out or ()))
    if out is not None:
        q_out, w_out = out
        want = ((torch.bfloat16, tuple(q.shape)), (torch.float32, (q.shape[0], q.shape[1], 1)))
        if any(t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous()
               for t, (dtype, shape) in zip((q_out, w_out), want)):
            raise ValueError(f"out must be contiguous (bf16 {want[0][1]}, fp32 {want[1][1]}); got "
                             f"({q_out.dtype} {tuple(q_out.shape)}, {w_out.dtype} {tuple(w_out.shape)})")
    kq, kw, kf, kpos = _inputs(q, weights, freqs, positions)
    # the kernel reads the inputs themselves where _inputs kept them (a complex table's fp32 view is the table)
    copies = not (all(map(same_memory, (q, weights, positions), (kq, kw, kpos))) and kf.data_ptr() == freqs.data_ptr())
    tokens, heads = q.shape[0], q.shape[1]
    n = tokens * heads
    plan = _Plan(copies, tuple(q.shape), (tokens, heads, 1), q.device, None)
    if not n:
        return plan
    return plan._replace(launch=Launch(
        _query_kernel, (cdiv(n, BLOCK_N),), dict(n_rows=n, n_heads=heads, weight_scale=float(weight_scale)),
        dict(BLOCK_N=BLOCK_N, D=HEAD_DIM, ROPE=ROPE_DIM), num_warps=4, num_stages=3,
        views=None if copies else {"freqs_ptr": as_freqs_real}))


def index_query_bf16_ref(q, weights, weight_scale: float, freqs, positions):
    """Plain torch reference of :func:`index_query_bf16` (float64 math)."""
    _check(q, weights, positions)
    x = rope_tail_ref(q.double(), as_freqs_real(freqs).double(), positions, ROPE_DIM)
    y = x @ hadamard_matrix(HEAD_DIM, torch.float64, q.device)
    w = (weights.reshape(q.shape[0], q.shape[1]).double() * float(weight_scale)).float().unsqueeze(-1)
    return y.to(torch.bfloat16), w

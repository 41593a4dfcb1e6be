"""bf16 index-K store: the indexer compressor's output -> bf16 rows in the paged pool.

Upstream fuses RMSNorm, RoPE (last 64 dims, interleaved pairs), the 128-point
Hadamard rotation and an fp8 quantization into one CUDA kernel whose source
forbids a bf16 indexer store. This kernel does the same math in fp32 and stores
the rotated row as bf16 (no quantization, no scale section) at compressed slot
``out_loc`` of the bf16 pool ``[num_pages, 64, 128]``.

Rows are addressed exactly as upstream's store addresses them:

- ``mode="rows"``: row i uses ``positions[i]`` and ``out_loc[i]``;
- ``mode="extend"``: ``plan`` is upstream's 16-byte CompressPlan per row
  (seq_len u32, ragged_id u16, ...); invalid rows (seq_len == 0xFFFFFFFF) are
  skipped, position = seq_len - ratio, slot = out_loc[ragged_id];
- ``mode="decode"``: ``plan`` is upstream's 16-byte DecodePlan per row; rows
  whose seq_len is not a multiple of the ratio are skipped, slot = out_loc[i].

A negative slot is always skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels._common import (cdiv, hadamard_128, hadamard_matrix, rope_tail_interleaved, rope_tail_ref,
                                         to_bf16_rne)
from dsv4_sm120.kernels.launch import Launch, check_one_device, kept, tensor_key
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, ROPE_DIM, check_pages

_MODES = {"rows": 0, "extend": 1, "decode": 2}
BLOCK_N = 16
_FREQS: dict = {}  # (address, shape, device) of a complex64 RoPE table -> its fp32 view (see as_freqs_real)
_FREQS_MAX = 64
_PLANS: dict = {}  # store_index_k_bf16's plans, by argument layout, eps, mode and ratio
_PLANS_MAX = 1 << 12


# n_rows is the step's token count: unspecialized, it costs one comparison (the builds for sm_90 and sm_120
# differ by one setp) instead of a compile per new value class (1, a multiple of 16, other). The plan, positions
# and slots are read one value a row, so their alignment (a slice of the batch's metadata) changes no build.
@triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["plan_ptr", "pos_ptr", "loc_ptr"])
def _store_kernel(
    kv_ptr, stride_kv, plan_ptr, pos_ptr, loc_ptr, w_ptr, freqs_ptr, pages_ptr,
    n_rows, eps, ratio,
    MODE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr,
):
    store_block(tl.program_id(0), kv_ptr, stride_kv, plan_ptr, pos_ptr, loc_ptr, w_ptr, freqs_ptr, pages_ptr,
                n_rows, eps, ratio, MODE, BLOCK_N, D, ROPE, PAGE)


@triton.jit
def store_block(block, kv_ptr, stride_kv, plan_ptr, pos_ptr, loc_ptr, w_ptr, freqs_ptr, pages_ptr, n_rows, eps, ratio,
                MODE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                PAGE: tl.constexpr):
    """Block ``block`` of BLOCK_N compressed rows: the store kernel's work, also run by the fused
    query-and-store launch (kernels/query_store.py)."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = rows < n_rows
    if MODE == 0:
        pos = tl.load(pos_ptr + rows, mask=in_range, other=0).to(tl.int32)
        loc = tl.load(loc_ptr + rows, mask=in_range, other=-1).to(tl.int64)
        valid = in_range
    elif MODE == 1:
        seq = tl.load(plan_ptr + rows * 4, mask=in_range, other=-1)
        ragged = tl.load(plan_ptr + rows * 4 + 1, mask=in_range, other=0) & 0xFFFF
        valid = in_range & (seq != -1)
        pos = seq - ratio
        loc = tl.load(loc_ptr + ragged, mask=valid, other=-1).to(tl.int64)
    else:
        seq = tl.load(plan_ptr + rows * 4, mask=in_range, other=1)
        valid = in_range & ((seq % ratio) == 0)
        pos = seq - ratio
        loc = tl.load(loc_ptr + rows, mask=valid, other=-1).to(tl.int64)
    ok = valid & (loc >= 0)
    pos = tl.where(ok, pos, 0)

    cols = tl.arange(0, D)
    src = kv_ptr + rows.to(tl.int64)[:, None] * stride_kv
    x = tl.load(src + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    xp = tl.load(src + (cols ^ 1)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)
    wp = tl.load(w_ptr + (cols ^ 1)).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    x = x * inv_rms[:, None] * w[None, :]
    xp = xp * inv_rms[:, None] * wp[None, :]

    is_rope = cols >= (D - ROPE)
    fcol = tl.where(is_rope, (cols - (D - ROPE)) & ~1, 0)
    fmask = ok[:, None] & is_rope[None, :]
    fbase = freqs_ptr + pos.to(tl.int64)[:, None] * ROPE + fcol[None, :]
    cos = tl.load(fbase, mask=fmask, other=1.0)
    sin = tl.load(fbase + 1, mask=fmask, other=0.0)
    x = rope_tail_interleaved(x, xp, cos, sin, cols, D - ROPE)
    y = hadamard_128(x)

    page = loc // PAGE
    slot = loc % PAGE
    dst = pages_ptr + (page * (PAGE * D) + slot * D)[:, None] + cols[None, :]
    tl.store(dst, to_bf16_rne(y), mask=ok[:, None])


def as_freqs_real(freqs: torch.Tensor) -> torch.Tensor:
    """Upstream keeps ``freqs_cis`` complex [max_pos, 32]; kernels read fp32 [max_pos, 64] (cos, sin) pairs.

    Every indexer call passes the same table, so the view of a contiguous complex64 table is kept (it shares
    the table's memory, so it can never be stale, and holding it keeps that address from being reused)."""
    if freqs.dtype == torch.complex64 and freqs.is_contiguous():
        return kept(_FREQS, (freqs.data_ptr(), freqs.shape, freqs.device), _FREQS_MAX, lambda: _real(freqs))
    return _real(freqs)


def _real(freqs: torch.Tensor) -> torch.Tensor:
    if freqs.is_complex():
        freqs = torch.view_as_real(freqs).flatten(-2)
    if freqs.dim() != 2 or freqs.shape[-1] != ROPE_DIM:
        raise ValueError(f"freqs must be complex [max_pos, {ROPE_DIM // 2}] or real [max_pos, {ROPE_DIM}]; got {tuple(freqs.shape)}")
    return freqs.to(torch.float32).contiguous()


def _check_inputs(kv, pages, mode, plan, positions, out_loc):
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}; got {mode!r}")
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM or kv.stride(1) != 1:
        raise ValueError(f"kv must be [N, {HEAD_DIM}] with unit inner stride; got {tuple(kv.shape)} strides {kv.stride()}")
    check_pages(pages)
    if mode == "rows":
        if positions is None or positions.shape[0] != kv.shape[0] or out_loc.shape[0] != kv.shape[0]:
            raise ValueError("mode='rows' needs positions [N] and out_loc [N] matching kv rows")
    else:
        if plan is None or plan.dtype != torch.uint8 or tuple(plan.shape) != (kv.shape[0], 16):
            raise ValueError(f"mode={mode!r} needs upstream's plan as uint8 [N, 16] with N = kv rows; got "
                             f"{None if plan is None else (plan.dtype, tuple(plan.shape))}")


def store_index_k_bf16(
    kv: torch.Tensor,
    pages: torch.Tensor,
    out_loc: torch.Tensor,
    *,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freqs: torch.Tensor,
    mode: str = "rows",
    positions: torch.Tensor | None = None,
    plan: torch.Tensor | None = None,
    compress_ratio: int = 4,
) -> None:
    """RMSNorm + RoPE + Hadamard the compressed keys ``kv`` [N, 128] and store them as bf16 into ``pages``.

    The checks and the launch are worked out once per argument layout (:func:`_store_plan`); a call of a known
    layout only launches.
    """
    key = (tensor_key(kv), tensor_key(pages), tensor_key(out_loc), tensor_key(norm_weight), tensor_key(freqs),
           None if positions is None else tensor_key(positions), None if plan is None else tensor_key(plan),
           norm_eps, mode, compress_ratio)
    store = kept(_PLANS, key, _PLANS_MAX, lambda: _store_plan(kv, pages, out_loc, norm_weight, norm_eps, freqs, mode,
                                                             positions, plan, compress_ratio))
    if store.launch is None:
        return
    if store.cast_weight:  # upstream feeds the weight in the input dtype; otherwise a cast per call
        norm_weight = norm_weight.to(kv.dtype).contiguous()
    if store.copy_freqs:
        freqs = as_freqs_real(freqs)
    rows = out_loc if positions is None else positions
    store.launch(kv, out_loc if plan is None else plan, rows, out_loc, norm_weight, freqs, pages)


class _Plan(NamedTuple):
    """What a call of one argument layout does besides reading addresses (see :func:`_store_plan`)."""

    cast_weight: bool  # the norm weight is cast to the keys' dtype per call
    copy_freqs: bool  # the RoPE table is copied to fp32 pairs per call (a contiguous complex64 or fp32 one is not)
    launch: Launch | None  # None: no rows


def _store_plan(kv, pages, out_loc, norm_weight, norm_eps, freqs, mode, positions, plan, compress_ratio) -> _Plan:
    """Checks and launch of store_index_k_bf16 for one layout of its arguments."""
    _check_inputs(kv, pages, mode, plan, positions, out_loc)
    check_one_device(kv, pages, out_loc, norm_weight, freqs, positions, plan)
    n = kv.shape[0]
    copy_freqs = as_freqs_real(freqs).data_ptr() != freqs.data_ptr()
    store = _Plan(norm_weight.dtype != kv.dtype or not norm_weight.is_contiguous(), copy_freqs, None)
    if n == 0:
        return store
    views = {} if copy_freqs else {"freqs_ptr": as_freqs_real}
    if plan is not None:
        views["plan_ptr"] = _plan_words
    return store._replace(launch=Launch(
        _store_kernel, (cdiv(n, BLOCK_N),),
        dict(stride_kv=kv.stride(0), n_rows=n, eps=float(norm_eps), ratio=int(compress_ratio)),
        dict(MODE=_MODES[mode], BLOCK_N=BLOCK_N, D=HEAD_DIM, ROPE=ROPE_DIM, PAGE=PAGE_SLOTS), num_warps=4, num_stages=3,
        views=views))


def _plan_words(plan: torch.Tensor) -> torch.Tensor:
    """Upstream's uint8 [N, 16] plan as the kernel reads it: [N, 4] int32 words."""
    return plan.view(torch.int32)


def rows_from_plan(plan: torch.Tensor, out_loc: torch.Tensor, mode: str, compress_ratio: int):
    """(row_ok, positions, slots) that upstream's plan addresses, for references and tests."""
    words = plan.view(torch.int32).reshape(-1, 4).long()
    seq = words[:, 0]
    n = seq.shape[0]
    if mode == "extend":
        ok = seq != -1
        ragged = words[:, 1] & 0xFFFF
        slots = torch.where(ok, out_loc.long()[ragged.clamp(max=out_loc.shape[0] - 1)], -1)
    elif mode == "decode":
        ok = (seq % compress_ratio) == 0
        slots = torch.where(ok, out_loc.long()[:n], -1)
    else:
        raise ValueError(mode)
    return ok & (slots >= 0), seq - compress_ratio, slots


def store_index_k_bf16_ref(
    kv, pages, out_loc, *, norm_weight, norm_eps, freqs, mode="rows", positions=None, plan=None, compress_ratio=4,
) -> None:
    """Plain torch reference of :func:`store_index_k_bf16` (float64 math, bf16 store)."""
    _check_inputs(kv, pages, mode, plan, positions, out_loc)
    if mode == "rows":
        slots = out_loc.long()
        ok, pos = slots >= 0, positions.long()
    else:
        ok, pos, slots = rows_from_plan(plan, out_loc, mode, compress_ratio)
    if not bool(ok.any()):
        return
    x = kv[ok].double()
    w = norm_weight.to(kv.dtype).double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps) * w
    x = rope_tail_ref(x, as_freqs_real(freqs).double(), pos[ok], ROPE_DIM)
    y = x @ hadamard_matrix(HEAD_DIM, torch.float64, x.device)
    s = slots[ok]
    pages[s // PAGE_SLOTS, s % PAGE_SLOTS] = y.to(torch.bfloat16)

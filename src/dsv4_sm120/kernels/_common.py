"""Shared Triton device helpers: the 128-point Hadamard rotation and interleaved RoPE.

Upstream rotates index keys and queries with a normalized Sylvester Hadamard
matrix (entry (i, j) = (-1)^popcount(i & j) / sqrt(128)) after RoPE on the last
64 dims, where RoPE pairs are interleaved (re, im) and the frequency table row
for a position is (cos0, sin0, cos1, sin1, ...). Both helpers work on a
[BLOCK, 128] fp32 tile in registers.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def hadamard_128(x):
    """x [BLOCK, 128] fp32 -> x @ H / sqrt(128) by the fast Walsh-Hadamard transform.

    Stage s pairs the elements whose indices differ only in bit s, (a, b) -> (a + b, a - b): after the
    seven stages element j holds sum_i x_i (-1)^popcount(i & j), the Sylvester product. Adds only, in fp32,
    in registers: no 128 x 128 matrix is built per program (the matrix and its tf32x3 product made the
    bf16 key store and query kernels several times slower than upstream's fused ones on a Hopper GPU).
    """
    BLOCK: tl.constexpr = x.shape[0]
    for s in tl.static_range(7):
        y = tl.permute(tl.reshape(x, (BLOCK, 64 >> s, 2, 1 << s)), (0, 1, 3, 2))  # the pair's axis last
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK, 128))
    return x * 0.08838834764831845  # 1/sqrt(128)


@triton.jit
def rope_tail_interleaved(x, x_partner, cos, sin, cols, ROPE_START: tl.constexpr):
    """RoPE on columns >= ROPE_START; x_partner[c] = x[c ^ 1]; cos/sin broadcast per column."""
    is_rope = cols >= ROPE_START
    is_odd = (cols & 1) == 1
    rotated = tl.where(is_odd, x * cos + x_partner * sin, x * cos - x_partner * sin)
    return tl.where(is_rope[None, :], rotated, x)


def hadamard_matrix(dim: int = 128, dtype: torch.dtype = torch.float64, device="cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix used by the torch references."""
    idx = torch.arange(dim, device=device)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    for b in range(dim.bit_length()):
        parity ^= (bits >> b) & 1
    return ((1 - 2 * parity).to(dtype)) / (dim**0.5)


def rope_tail_ref(x: torch.Tensor, freqs_real: torch.Tensor, positions: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Interleaved RoPE on the last ``rope_dim`` dims of x [..., N, D] (positions [N]); float math."""
    cs = freqs_real[positions.long()].to(x.dtype)  # [N, rope_dim] (cos, sin) interleaved
    shape = (cs.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cs[:, 0::2].reshape(shape), cs[:, 1::2].reshape(shape)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    re, im = tail[..., 0::2], tail[..., 1::2]
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    tail = torch.stack((out_re, out_im), dim=-1).flatten(-2)
    return torch.cat((head, tail), dim=-1)


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, done on the bits so every backend agrees.

    (The Triton CPU interpreter truncates on ``.to(tl.bfloat16)``; GPUs round.)
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host. ``triton.cdiv`` is a constexpr function in Triton 3.8, about 1.5 us a call
    in Python (measured on the CI host), which the per-call launch paths cannot afford."""
    return -(-a // b)


@functools.cache
def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter used by the CI tests). Read once: Triton reads it
    when ``triton.language`` is first imported, so a later change would not switch the kernels anyway."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

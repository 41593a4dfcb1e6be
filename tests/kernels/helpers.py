"""Input builders and the logits check shared by the kernel tests (CPU, small shapes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch

PAGE, D = 64, 128


def freqs_cis(max_pos: int, gen: torch.Generator) -> torch.Tensor:
    """A complex RoPE table [max_pos, 32] like upstream's ``freqs_cis``."""
    return torch.polar(torch.ones(max_pos, 32), torch.rand(max_pos, 32, generator=gen) * 6.283)


def heavy_tailed(shape, gen: torch.Generator, df: float = 3.0) -> torch.Tensor:
    """Student-t scaled rows: a few keys and heads with far larger norms than the rest."""
    z = torch.randn(shape, generator=gen)
    chi2 = torch.distributions.Chi2(torch.tensor(df)).sample(shape[:-1] + (1,))
    return z / torch.sqrt(chi2 / df)


def logits_case(lens, heads: int, gen: torch.Generator, extra_pages: int = 3, heavy: bool = False):
    """q, weights, pool, seq_lens, page_table for rows of the given key counts; pages drawn at random."""
    max_len = max(lens)
    n_pages_row = math.ceil(max_len / PAGE)
    pool_pages = len(lens) * n_pages_row + extra_pages
    draw = (lambda s: heavy_tailed(s, gen)) if heavy else (lambda s: torch.randn(s, generator=gen))
    pages = draw((pool_pages, PAGE, D)).to(torch.bfloat16)
    q = draw((len(lens), heads, D)).to(torch.bfloat16)
    w = torch.randn(len(lens), heads, generator=gen)
    pt = torch.randperm(pool_pages, generator=gen)[: len(lens) * n_pages_row].view(len(lens), n_pages_row)
    return q, w, pages, torch.tensor(lens, dtype=torch.int32), pt.to(torch.int32)


def compress_plan(rows: list[tuple[int, int]]) -> torch.Tensor:
    """Upstream's 16-byte CompressPlan per row: (seq_len u32, ragged_id u16, buffer_len u16, page0 i32, page1 i32).

    ``(seq_len, ragged_id)``; seq_len -1 marks an invalid row.
    """
    words = torch.zeros(len(rows), 4, dtype=torch.int32)
    for i, (seq, ragged) in enumerate(rows):
        words[i, 0] = seq
        words[i, 1] = ragged & 0xFFFF  # buffer_len (high half) left 0
        words[i, 2:] = -1
    return words.view(torch.uint8).reshape(len(rows), 16)


def decode_plan(seq_lens: list[int]) -> torch.Tensor:
    """Upstream's 16-byte DecodePlan per row: (seq_len u32, write_loc i32, page0 i32, page1 i32)."""
    words = torch.zeros(len(seq_lens), 4, dtype=torch.int32)
    words[:, 0] = torch.tensor(seq_lens, dtype=torch.int32)
    words[:, 1:] = -1
    return words.view(torch.uint8).reshape(len(seq_lens), 16)


def topk_sets(x: torch.Tensor, lens, k: int = 512):
    return [set(torch.topk(x[r, : int(n)], min(k, int(n))).indices.tolist()) for r, n in enumerate(lens)]


def check_logits(out, ref, lens):
    """``out`` (NaN where nothing was written) against the float64 reference ``ref`` (-inf exactly past
    each row's length): every live element written, nothing past a length, rel err < 1e-5, top-512 equal."""
    live = torch.isfinite(ref)
    assert not out[live].isnan().any(), "every live element written"
    assert out[~live].isnan().all(), "nothing written past a row's length (the NaN poison is intact)"
    assert ((out[live] - ref[live]).norm() / ref[live].norm()) < 1e-5
    assert topk_sets(out, lens) == topk_sets(ref, lens)


def harness_result(script, timeout: int = 600) -> dict:
    """The ``RESULT {json}`` line of a harness script run in a fresh interpreter without ``TRITON_INTERPRET``
    (so its kernels are Triton's ``JITFunction``s, as on a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"{script.name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])

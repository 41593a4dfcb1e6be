"""The logits kernel's speed as pytest-benchmark cases: one group per question, one case per shape.

On a GPU host, from the repository root in the unpacked bundle's environment::

    python -m pytest -m gpu bench/tests/test_kernel_speed.py --benchmark-only \\
        --benchmark-columns=min,median,max,iqr,rounds --benchmark-json=/tmp/kernel_speed.json

- decode: one CUDA graph of ``launches`` calls at upstream's capture width (a 1M-token context), each over its
  own page draw, so no call finds its keys in L2 (``bench.indexer.cases.rotation_count``). A round is one
  replay and its synchronize; ``extra_info["launches"]`` divides it into one call's time.
- prefill: one eager call over causal rows (row t scores t + 1 keys), then a synchronize.

These are the kernel's own times. Its ratio to upstream's fp8 kernels, in CUDA graphs and eager, is
``python -m bench.indexer``'s job. Without a CUDA device the cases fail: selected with ``-m gpu`` they must run.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.indexer import cases
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits

pytestmark = pytest.mark.gpu

DECODE = [(1, 4096), (1, 131072), (8, 32768), (64, 4096)]  # (rows, live keys a row)
PREFILL = [4096, 16384]  # causal rows, one request


@pytest.fixture(scope="module")
def gen() -> torch.Generator:
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device: run the kernel benchmarks on the GPU host")
    return torch.Generator(device="cuda").manual_seed(0)


def _pool(pages: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn((pages, cases.PAGE, cases.D), generator=gen, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("rows,live", DECODE, ids=[f"{b}x{n // 1024}k" for b, n in DECODE])
def test_decode_logits(benchmark, gen, rows, live):
    benchmark.group = "mqa_logits decode, CUDA graph"
    pool = _pool(math.ceil(rows * live / cases.PAGE) + 1, gen)
    n = cases.rotation_count(rows, live)
    width = cases.SIZES["width"]
    sl = torch.full((rows,), live, dtype=torch.int32, device="cuda")
    out = torch.empty((rows, width), device="cuda")
    calls = [(lambda q=q, w=w, pt=pt: bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=out))
             for q, w, pt in cases.decode_draws(pool, rows, live, gen, n)]
    graph = cases.capture(calls)
    benchmark.extra_info.update(launches=n, rows=rows, live_keys=live, width=width)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("rows", PREFILL, ids=[f"{t // 1024}k" for t in PREFILL])
def test_prefill_logits(benchmark, gen, rows):
    benchmark.group = "mqa_logits prefill, eager"
    lens = list(range(1, rows + 1))
    pool = _pool(math.ceil(rows / cases.PAGE) + 1, gen)
    q, w, sl, pt = cases.case(pool.shape[0], rows, lens, rows, gen, shared=True)
    out = torch.empty((rows, rows), device="cuda")
    benchmark.extra_info.update(rows=rows, keys=rows * (rows + 1) // 2)
    benchmark.pedantic(lambda: (bf16_paged_mqa_logits(q, pool, w, sl, pt, rows, out=out), torch.cuda.synchronize()),
                       rounds=10, warmup_rounds=2)

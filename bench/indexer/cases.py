"""The inputs every section of the indexer bench times: its shapes, random page tables and queries, the
float64 check of a kernel's output, the CUDA graphs decode is timed in, and the sync every wall-clock timer
ends on.

Keys are gathered through random page permutations, as in serving. ``DEV`` is "cuda", or "cpu" under
``--dry-cpu``, which also puts ``DRY_SIZES`` into ``SIZES``; ``__main__`` sets both before any section runs, so
the other modules read the device as ``cases.DEV``.
"""

from __future__ import annotations

import math

import torch

from bench import _gpu_common as g
from dsv4_sm120.kernels.mqa_logits import paged_mqa_logits_ref


H, D, PAGE, TOPK = 64, 128, 64, 512
CAPTURE_WIDTH = 262144  # a 1M-token context: upstream's decode logits width is the capture width
DEV = "cuda"
SIZES = dict(eager_b=(1, 8, 64), eager_live=(4096, 32768, 131072), eager_calls=200, breakdown_calls=200,
             decode_b=(1, 8, 64, 256), decode_live=(4096, 32768, 131072), width=CAPTURE_WIDTH,
             verify=((8, 32768), (64, 32768)), prefill=(8192, 32768), sweep_n=8192, check_rows=3,
             store_n=16384, store_pool=2048, query_t=8192, ragged_max=70001, max_pos=65536,
             long_rows=8192, long_keys=(4096, 16384, 32768, 65536))
DRY_SIZES = dict(eager_b=(1, 2), eager_live=(256,), eager_calls=3, breakdown_calls=2, decode_b=(1, 2), decode_live=(256,), width=1024, verify=((2, 256),), prefill=(128,), sweep_n=128,
                 check_rows=2, store_n=32, store_pool=4, query_t=4, ragged_max=1100, max_pos=2048,
                 long_rows=8, long_keys=(1100,))


def case(pool_pages, rows, lens, width, gen, shared=False):
    """q, w, seq_lens, page_table [rows, width / 64] (live pages a random draw from the pool, the rest page 0)."""
    width_pages = math.ceil(width / PAGE)
    live_pages = math.ceil(max(lens) / PAGE)
    tables = 1 if shared else rows
    perm = torch.randperm(pool_pages, generator=gen, device=DEV)[: tables * live_pages].view(tables, live_pages)
    pt = torch.zeros((tables, width_pages), dtype=torch.int32, device=DEV)
    pt[:, :live_pages] = perm.to(torch.int32)
    if shared:
        pt = pt.expand(rows, -1).contiguous()
    q = torch.randn((rows, H, D), generator=gen, device=DEV).to(torch.bfloat16)
    w = torch.randn((rows, H), generator=gen, device=DEV)
    sl = torch.as_tensor(lens, dtype=torch.int32, device=DEV)
    return q, w, sl, pt


def check_rows(out, q, pages, w, sl, pt, width, rows):
    """rel err against the float64 reference on sampled rows, top-512 identical, nothing written past a length."""
    idx = torch.as_tensor(rows, device=DEV)
    ref = paged_mqa_logits_ref(q[idx], pages, w[idx], sl[idx], pt[idx], width, dtype=torch.float64, rows_per_chunk=1)
    return agreement(out[idx], ref, sl[idx])


def agreement(got, ref, lens):
    """rel err of ``got`` against the float64 reference ``ref`` (-inf past each row's length, ``lens``),
    top-512 identical, every live column written, nothing written past a length (``got`` starts NaN)."""
    live = torch.isfinite(ref)
    err = float((got[live] - ref[live]).norm() / ref[live].norm())
    same = all(set(torch.topk(got[i, :n], min(TOPK, n)).indices.tolist())
               == set(torch.topk(ref[i, :n], min(TOPK, n)).indices.tolist())
               for i, n in enumerate(lens.tolist()))
    return {"rel_err": err, "top512_identical": same, "live_all_written": not bool(got[live].isnan().any()),
            "past_length_untouched": bool(got[~live].isnan().all())}


ROTATE_BYTES = 512 << 20  # key bytes a CUDA graph of decode launches reads: several times the 60 MB L2


def rotation_count(b, live):
    """How many independent page draws a decode graph rotates through so no launch finds its keys in L2."""
    return max(4, min(200, math.ceil(ROTATE_BYTES / (b * live * D * 2))))


def decode_draws(pool, b, live, gen, n, rows_per_req=1):
    """n independent (q, w, page_table at the capture width) draws; rows_per_req rows share a request's table."""
    draws = []
    for _ in range(n):
        q, w, _, pt = case(pool.shape[0], b, [live] * b, SIZES["width"], gen)
        if rows_per_req > 1:
            q, w, pt = (x.repeat_interleave(rows_per_req, 0) for x in (q, w, pt))
        draws.append((q, w, pt))
    return draws


def capture(fns):
    """One CUDA graph that runs fns in order (each warmed up eagerly first on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


def replay_ms(graph, n_calls, reps=5):
    """Median over reps of one replay's time divided by the launches it holds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n_calls)
    return sorted(times)[len(times) // 2]


def sync():
    if not g._DRY["on"]:
        torch.cuda.synchronize()

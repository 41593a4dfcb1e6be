"""H200 bench of the bf16 indexer kernels against upstream's own fp8 kernels, same page tables, one run (issue 14).

One run measures the ceilings (HBM read bandwidth, dense bf16 and fp8 GEMM rates), checks every kernel
against its torch reference (``doctor --selftest`` included) and times, side by side on the same keys
and page tables, this package's bf16 logits kernel and two upstream peers: the TileLang fp8 kernel
``tilelang_fp8_paged_mqa_logits`` -- the kernel the pin runs by default on sm_120
(``SGLANG_OPT_USE_TILELANG_INDEXER=1`` from ``arg_groups/model_hook.py``), built here for sm_90 -- and,
with ``--deepgemm``, DeepGEMM, the pin's default on sm_90: ``fp8_paged_mqa_logits`` for decode and
target-verify, ``fp8_mqa_logits`` on the request's gathered keys for prefill (``deepgemm_info`` says how
each is called). It writes bench/results/kernels/indexer_h200_<date>.json (or $OUT_JSON); without a peer its
columns are None and the JSON says why.

    PYTHONPATH=src COMMIT=$(git rev-parse HEAD) python -m bench.indexer_h200 --tilelang PATH/tilelang_kernel.py \
        [--deepgemm DEST]   # --deepgemm-warm first compiles its kernels

DEST is a DeepGEMM build as ``bench/build_deepgemm_device.sh build`` made it (that script is at commit 6f9738b,
removed since; git history keeps it).

``PATH/tilelang_kernel.py`` is ``sglang/kernels/ops/attention/dsa/tilelang_kernel.py`` from the
sglang==0.5.23 wheel, run unmodified. The H200 image has no sglang, so the two sglang helpers that file
imports (``is_fp8_fnuz``, ``is_hip``, ``is_gfx95_supported``: platform probes, all False on an NVIDIA
GPU) are given as stand-in modules before it is loaded; nothing else of sglang is involved.

Shapes: decode B in {1, 8, 64, 256} x live keys in {4k, 32k, 128k}, each at width = live and at the
capture width 262144; target-verify (MTP next_n = 2: two rows per request, lengths n - 1 and n, one
page table); prefill dense and causal at 8192 and 32768 (one request: every row shares its page table).
Keys are gathered through random page permutations, as in serving. The fp8 side reads fp8 pages made
from the same keys (per-token e4m3 with an fp32 scale, upstream's 132-byte layout).

Eager host cost (issue 24 d): decode B in {1, 8, 64} x {4k, 32k, 128k} keys at the capture width as eager calls
(wall clock of back-to-back calls, host included), with every host cache and as before issue 24, beside the
CUDA-graph replay and the kernel alone (``eager`` in the JSON; ``eager_section`` says what each field is), and
before it where the host time of one request's decode step goes: each piece of the logits, query and store calls
timed alone (``eager_host_breakdown``; ``BREAKDOWN_FIELDS`` says what each piece is), with a check that the
direct launch writes what Triton's own dispatch writes. The last lines (VERDICT) set the host time an eager
logits call adds against issue 24's 20 us bar. ``--eager-only`` runs only these (under a minute on the H200)
and writes bench/results/indexer_h200_eager_<date>.json (or $OUT_JSON):

    PYTHONPATH=src COMMIT=$(git rev-parse HEAD) python -m bench.indexer_h200 --eager-only

On a GPU host set up from the bundle (``. env.sh``), keep its packages first: ``PYTHONPATH=src:$PYTHONPATH``
(``PYTHONPATH=src`` alone times the host image's torch and Triton instead of the pin's).

Timing: decode and target-verify run as in serving, each kernel's launches captured in one CUDA graph
over independent page draws (at least 512 MiB of keys per replay, so no launch finds its keys in L2),
five alternating rounds, the median; with do_bench (L2 flush before each call, host launch in the
timed region) the 4-10 us kernels read 10-60 us and changed from run to run. Prefill uses do_bench
(milliseconds per call). ``--tune-only`` times launch configurations beside upstream's kernel instead
and writes $OUT_JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from bench import _gpu_common as g
from dsv4_sm120.kernels import launch as kernel_launch
from dsv4_sm120.kernels import mqa_logits
from dsv4_sm120.kernels.index_k_store import store_index_k_bf16, store_index_k_bf16_ref
from dsv4_sm120.kernels.index_query import index_query_bf16, index_query_bf16_ref
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits, decode_splits, paged_mqa_logits_ref

H, D, PAGE, TOPK = 64, 128, 64, 512
CAPTURE_WIDTH = 262144  # a 1M-token context: upstream's decode logits width is the capture width
DEV = "cuda"
SIZES = dict(eager_b=(1, 8, 64), eager_live=(4096, 32768, 131072), eager_calls=200, breakdown_calls=200,
             decode_b=(1, 8, 64, 256), decode_live=(4096, 32768, 131072), width=CAPTURE_WIDTH,
             verify=((8, 32768), (64, 32768)), prefill=(8192, 32768), sweep_n=8192, check_rows=3,
             store_n=16384, store_pool=2048, query_t=8192, ragged_max=70001, max_pos=65536)
DRY_SIZES = dict(eager_b=(1, 2), eager_live=(256,), eager_calls=3, breakdown_calls=2, decode_b=(1, 2), decode_live=(256,), width=1024, verify=((2, 256),), prefill=(128,), sweep_n=128,
                 check_rows=2, store_n=32, store_pool=4, query_t=4, ragged_max=1100, max_pos=2048)


# ----------------------------------------------------------------------------- upstream's fp8 kernel
def load_tilelang(path: str | None):
    """upstream's ``tilelang_fp8_paged_mqa_logits`` from the pinned wheel's file, or (None, why not)."""
    if not path:
        return None, "no --tilelang file given"
    probes = {"sglang.kernels.ops.quantization.fp8_kernel": {"is_fp8_fnuz": lambda: False},
              "sglang.srt.utils": {"is_hip": lambda: False, "is_gfx95_supported": lambda: False}}
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.quantization", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    for name, attrs in probes.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
    try:
        spec = importlib.util.spec_from_file_location("upstream_tilelang_kernel", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.tilelang_fp8_paged_mqa_logits, None
    except Exception as exc:  # reported in the JSON: the run goes on without the peer column
        return None, f"{type(exc).__name__}: {exc}"


def fp8_rows(x):
    """Per-row (last dim) e4m3 with an fp32 scale amax / 448, as upstream's fp8 index keys and queries."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def fp8_pool(pages_bf16):
    """upstream's fp8 index-K page layout: [64 x 128 e4m3 keys | 64 x fp32 scales] = 8448 bytes per page."""
    k8, ks = fp8_rows(pages_bf16)
    n = pages_bf16.shape[0]
    raw = torch.cat([k8.view(torch.uint8).reshape(n, -1), ks.contiguous().view(torch.uint8).reshape(n, -1)], 1)
    return raw.view(n, PAGE, 1, D + 4)


class Fp8Peer:
    """The same queries and keys in upstream's fp8 format, and a call of upstream's TileLang kernel on them."""

    name = "fp8"  # the JSON keys of this peer: fp8_ms, fp8_vs_bf16_*, and "ratio" (ours / fp8)

    def __init__(self, fn, pool8):
        self.fn, self.pool8 = fn, pool8

    def bind(self, q, w, sl, pt, width):
        """The kernel's call on these inputs as a no-argument function; quantising q is outside it."""
        q8, w8 = fp8_query(q, w)
        q8 = q8.unsqueeze(1).contiguous()
        return lambda: self.fn(q8, self.pool8, w8, sl, pt, None, width, False)

    def scored_lens(self, sl):
        return sl

    def setup_ms(self, sl):
        return {}


def fp8_query(q, w):
    """upstream's fp8 query: per-head e4m3 rows, the fp32 row scale folded into the head weights."""
    q8, qs = fp8_rows(q)
    return q8, (w * qs).contiguous()


# ----------------------------------------------------------------------------- upstream's sm_90 default
def load_deepgemm(build: str | None):
    """DeepGEMM as built by bench/build_deepgemm_device.sh at commit 6f9738b (``build`` holds deep_gemm/), or (None, why not)."""
    if not build:
        return None, "no --deepgemm build given (bench/build_deepgemm_device.sh at commit 6f9738b built one on the GPU host)"
    # Imported from that folder by a spec for its package, not by adding the folder to the import path:
    # nothing else there (csrc/, fmt/, the host headers) becomes importable, and no other deep_gemm answers.
    package = Path(build).resolve() / "deep_gemm"
    spec = importlib.util.spec_from_file_location("deep_gemm", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    deep_gemm = importlib.util.module_from_spec(spec)
    sys.modules["deep_gemm"] = deep_gemm  # where its relative imports (``from . import _C``) look for it
    try:
        spec.loader.exec_module(deep_gemm)
        return deep_gemm, None
    except Exception as exc:  # reported in the JSON: the run goes on without the column
        sys.modules.pop("deep_gemm", None)
        return None, f"{type(exc).__name__}: {exc}"


def deepgemm_info(dg, build):
    """What was loaded and how the bench calls it, for the JSON."""
    manifest = Path(build) / "MANIFEST"
    return {"version": getattr(dg, "__version__", None), "num_sms": dg.get_num_sms(),
            "manifest": manifest.read_text().splitlines() if manifest.exists() else None,
            "decode_and_verify": "fp8_paged_mqa_logits(q [rows,1,64,128] e4m3, kv_cache [pages,64,1,132] uint8, "
                                 "weights [rows,64] fp32 (head weight x q scale), context_lens [rows,1] int32, "
                                 "block_table, schedule, width, clean_logits=False): the pin's c4 call on sm_90 "
                                 "(one row per request, target-verify rows too)",
            "schedule": "get_paged_mqa_logits_metadata(context_lens, 64, num_sms), built once per shape outside "
                        "the timed region and the CUDA graph: the pin builds it once per forward in "
                        "PagedIndexerMetadata, shared by every layer, before graph replay. The pin's default "
                        "planner is sglang's own JIT kernel (SGLANG_OPT_USE_JIT_INDEXER_METADATA), which needs "
                        "sglang, absent on the H200 image; this is DeepGEMM's planner; deepgemm_metadata_ms is its time",
            "prefill": "fp8_mqa_logits(q [rows,64,128] e4m3, (keys [n,128] e4m3, scales [n] fp32), weights, "
                       "ks=0, ke=length or 0 where length <= 512, clean_logits=False, max_seqlen_k=align(n, 64)): "
                       "the pin's non-paged path for one request of >= 8192 rows (SGLANG_OPT_DSV4_NONPAGED_INDEXER), "
                       "rows of <= 512 keys left to the SGL top-k as the pin does; the per-layer key gather "
                       "(sglang's kernel) is not timed"}


class DeepGemmPagedPeer:
    """DeepGEMM's paged fp8 kernel on the same fp8 pages and page tables, called as the pin calls it on sm_90."""

    name = "deepgemm"

    def __init__(self, dg, pool8):
        self.dg, self.pool8 = dg, pool8

    def schedule(self, sl):
        return self.dg.get_paged_mqa_logits_metadata(sl.view(-1, 1).contiguous(), PAGE, self.dg.get_num_sms())

    def bind(self, q, w, sl, pt, width):
        q8, w8 = fp8_query(q, w)
        q8 = q8.unsqueeze(1).contiguous()
        lens = sl.view(-1, 1).contiguous()
        meta = self.schedule(sl)
        return lambda: self.dg.fp8_paged_mqa_logits(q8, self.pool8, w8, lens, pt, meta, width, False)

    def scored_lens(self, sl):
        return sl

    def setup_ms(self, sl):
        """The schedule's own time: once per forward in serving, shared by the layers, so not in deepgemm_ms."""
        return {"deepgemm_metadata_ms": g.median_ms(lambda: self.schedule(sl), rep=20)}


class DeepGemmRaggedPeer(DeepGemmPagedPeer):
    """DeepGEMM's non-paged fp8 kernel: the pin's sm_90 prefill of one request (keys gathered once, contiguous)."""

    def bind(self, q, w, sl, pt, width):
        q8, w8 = fp8_query(q, w)
        n = int(sl.max())
        pages = self.pool8[pt[0, : math.ceil(n / PAGE)].long()].view(-1, PAGE * (D + 4))
        keys = pages[:, : PAGE * D].reshape(-1, D)[:n].view(torch.float8_e4m3fn).contiguous()
        scales = pages[:, PAGE * D:].reshape(-1, 4)[:n].contiguous().view(torch.float32).view(-1)
        ks = torch.zeros_like(sl)
        ke = self.scored_lens(sl)
        max_k = math.ceil(n / PAGE) * PAGE
        return lambda: self.dg.fp8_mqa_logits(q8, (keys, scales), w8, ks, ke, clean_logits=False, max_seqlen_k=max_k)

    def scored_lens(self, sl):
        return torch.where(sl > TOPK, sl, torch.zeros_like(sl)).to(torch.int32).contiguous()

    def setup_ms(self, sl):
        return {}


# ----------------------------------------------------------------------------- cases and checks
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


def peer_agreement(ours, theirs, sl, name):
    """How far a peer's fp8 scores are from ours on the rows and keys it scored (small: fp8 rounding, not a bug)."""
    theirs = theirs[:, : ours.shape[1]]  # DeepGEMM's prefill logits are max_seqlen_k (a page multiple) wide
    live = torch.arange(ours.shape[1], device=DEV)[None, :] < sl[:, None]
    if not bool(live.any()):  # e.g. a tiny dry-run prefill: every row left to the top-k
        return {f"{name}_vs_bf16_rel_err": None, f"{name}_vs_bf16_top512_overlap_min": None}
    err = float((theirs[live] - ours[live]).norm() / ours[live].norm())
    scored = [(r, n) for r, n in enumerate(sl.tolist()) if n > 0][:4]
    overlap = [len(set(torch.topk(ours[r, :n], min(TOPK, n)).indices.tolist())
                   & set(torch.topk(theirs[r, :n], min(TOPK, n)).indices.tolist())) / min(TOPK, n)
               for r, n in scored]
    return {f"{name}_vs_bf16_rel_err": err, f"{name}_vs_bf16_top512_overlap_min": min(overlap)}


RATIO_KEY = {"fp8": "ratio", "deepgemm": "ratio_vs_deepgemm"}  # ours / peer


def _peer_fields() -> dict:
    """Every peer's time and ratio keys, None until it runs: an absent peer reads the same in every row."""
    return {k: None for name in RATIO_KEY for k in (f"{name}_ms", RATIO_KEY[name])}


def _bind_peers(peers, q, w, sl, pt, width, res):
    """Each peer's call bound to these inputs and its eager output; a peer that fails is recorded and left out."""
    calls, outs = {}, {}
    for peer in peers:
        try:
            call = peer.bind(q, w, sl, pt, width)
            outs[peer.name] = call()
            calls[peer.name] = call
        except Exception as exc:  # an upstream kernel failing on a shape is a finding, not a crash of the run
            res[f"{peer.name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return calls, outs


def _time_alternating(res: dict, timers: dict, rounds: int) -> None:
    """Each timer once per round, in turn (drift hits every kernel alike); the median and every round into ``res``."""
    times = {k: [] for k in timers}
    for _ in range(rounds):
        for k, timer in timers.items():
            times[k].append(timer())
    for k, ts in times.items():
        res[f"{k}_ms"] = sorted(ts)[len(ts) // 2]
        res[f"{k}_ms_rounds"] = ts


def _compare_with_peers(res: dict, out, outs: dict, peers, sl) -> None:
    """Our time over each peer's, and how far the peer's logits agree with ours (for the peers that ran)."""
    for peer in peers:
        if peer.name in outs:
            res[RATIO_KEY[peer.name]] = res["ours_ms"] / res[f"{peer.name}_ms"]
            res.update(peer_agreement(out, outs[peer.name], peer.scored_lens(sl), peer.name))
            res.update(peer.setup_ms(sl))


def timed_pair(peers, q, w, pages, sl, pt, width, rounds=3, **kw):
    """Our kernel and upstream's on the same inputs, timed in alternating rounds after a pre-heat.

    Each figure is the median over ``rounds`` of do_bench medians (L2 flushed before every call); the
    spread over rounds is kept. Returns the timings and our NaN-poisoned output for the checks.
    """
    out = torch.full((q.shape[0], width), float("nan"), device=DEV)
    bf16_paged_mqa_logits(q, pages, w, sl, pt, width, out=out, **kw)
    scratch = torch.empty_like(out)
    res = _peer_fields()
    calls, outs = _bind_peers(peers, q, w, sl, pt, width, res)
    fns = {"ours": lambda: bf16_paged_mqa_logits(q, pages, w, sl, pt, width, out=scratch, **kw), **calls}
    g.preheat()
    _time_alternating(res, {k: (lambda fn=fn: g.median_ms(fn, rep=60)) for k, fn in fns.items()}, rounds)
    _compare_with_peers(res, out, outs, peers, sl)
    del scratch, outs
    return res, out


# ----------------------------------------------------------------------------- sections
ROTATE_BYTES = 512 << 20  # key bytes a CUDA graph of decode launches reads: several times the 60 MB L2


def rotation_count(b, live):
    """How many independent page draws a decode graph rotates through so no launch finds its keys in L2."""
    return max(4, min(200, math.ceil(ROTATE_BYTES / (b * live * D * 2))))


def _capture(fns):
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


def _replay_ms(graph, n_calls, reps=5):
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


def timed_pair_graph(peers, draws, pages, sl, width, rounds=5, **kw):
    """Decode timing as in serving: each kernel's launches in one CUDA graph, over rotating page draws.

    ``draws`` is a list of (q, w, page_table) with independent random pages, so back-to-back launches
    read keys from HBM, not from L2 (do_bench's L2 flush plus host launch time made 10 us kernels read
    20-60 us here). Every kernel sees the same draws; rounds alternate between them. A peer's per-call
    preparation (query quantisation, DeepGEMM's schedule) happens at bind time, outside its graph. If a
    peer cannot be captured, all are timed with do_bench instead (``timing`` says which).
    """
    if g._DRY["on"]:
        q, w, pt = draws[0]
        return timed_pair(peers, q, w, pages, sl, pt, width, rounds=1, **kw)
    q0, w0, pt0 = draws[0]
    out = torch.full((q0.shape[0], width), float("nan"), device=DEV)
    bf16_paged_mqa_logits(q0, pages, w0, sl, pt0, width, out=out, **kw)
    scratch = torch.empty_like(out)
    ours = [(lambda q=q, w=w, pt=pt: bf16_paged_mqa_logits(q, pages, w, sl, pt, width, out=scratch, **kw))
            for q, w, pt in draws]
    graphs = {"ours": _capture(ours)}
    res = {**_peer_fields(), "timing": "cuda_graph", "draws": len(draws)}
    _, outs = _bind_peers(peers, q0, w0, sl, pt0, width, res)
    ran = [peer for peer in peers if peer.name in outs]
    for peer in ran:
        try:
            graphs[peer.name] = _capture([peer.bind(q, w, sl, pt, width) for q, w, pt in draws])
        except Exception as exc:
            error = {f"{peer.name}_graph_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            del graphs, outs
            torch.cuda.synchronize()
            r, o = timed_pair(ran, q0, w0, pages, sl, pt0, width, rounds=rounds, **kw)
            r.update(timing="do_bench", **error)
            return r, o
    g.preheat()
    _time_alternating(res, {k: (lambda gr=gr: _replay_ms(gr, len(draws))) for k, gr in graphs.items()}, rounds)
    _compare_with_peers(res, out, outs, peers, sl)
    del graphs, scratch, outs
    torch.cuda.synchronize()
    return res, out


def decode_draws(pool, b, live, gen, n, rows_per_req=1):
    """n independent (q, w, page_table at the capture width) draws; rows_per_req rows share a request's table."""
    draws = []
    for _ in range(n):
        q, w, _, pt = case(pool.shape[0], b, [live] * b, SIZES["width"], gen)
        if rows_per_req > 1:
            q, w, pt = (x.repeat_interleave(rows_per_req, 0) for x in (q, w, pt))
        draws.append((q, w, pt))
    return draws


def _fp8_hbm_fraction(res, name, nbytes, read_gbps):
    return nbytes / (res[f"{name}_ms"] * 1e6) / read_gbps if res.get(f"{name}_ms") else None


def decode_section(peers, pool, gen, read_gbps):
    rows_out = []
    for b in SIZES["decode_b"]:
        for live in SIZES["decode_live"]:
            # one set of draws per (batch, live keys): both widths read the same pages, so only the width differs
            draws = decode_draws(pool, b, live, gen, rotation_count(b, live))
            sl = torch.full((b,), live, dtype=torch.int32, device=DEV)
            for width in sorted({live, SIZES["width"]}):
                cut = [(q, w, pt[:, : math.ceil(width / PAGE)].contiguous()) for q, w, pt in draws]
                res, out = timed_pair_graph(peers, cut, pool, sl, width)
                res.update(shape="decode", B=b, live=live, width=width)
                q, w, pt = cut[0]
                res["check"] = check_rows(out, q, pool, w, sl, pt, width, list(range(min(b, SIZES["check_rows"]))))
                nbytes = b * live * D * 2 + b * live * 4 + q.numel() * 2  # keys, logits written, queries
                res["hbm_fraction"] = nbytes / (res["ours_ms"] * 1e6) / read_gbps
                fp8_bytes = b * live * (D + 4) + b * live * 4 + q.numel()  # fp8 keys and scales, logits, queries
                for name in RATIO_KEY:
                    res[f"{name}_hbm_fraction"] = _fp8_hbm_fraction(res, name, fp8_bytes, read_gbps)
                rows_out.append(res)
                print(_row_text(res), flush=True)
                del out, cut
            del draws
    return rows_out


def _sync():
    if not g._DRY["on"]:
        torch.cuda.synchronize()


def _eager_us(fn, calls, before_each=None, rounds=3):
    """Host-inclusive time of one eager call as a user meets it: wall clock of ``calls`` back-to-back calls from a
    sync to the sync after the last, over ``calls``; the median of ``rounds``."""
    times = []
    for _ in range(rounds):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            if before_each is not None:
                before_each()
            fn()
        _sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def _graph_us(fn, calls, rounds=3):
    """One CUDA graph of ``calls`` launches: wall clock of a replay from a sync to its sync, over ``calls``."""
    graph = _capture([fn] * calls)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    del graph
    return sorted(times)[len(times) // 2]


def _kernel_us(fn, calls):
    """Mean duration of the logits kernel itself over ``calls`` eager launches, from the CUDA profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = [e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "_logits_kernel" in e.name]
    if not spans:
        raise RuntimeError("the profiler recorded no _logits_kernel launch")
    return sum(spans) / len(spans)


def _kernels_us(fn, calls, names) -> float:
    """Summed duration per call of the kernels whose names contain one of ``names``, from CUPTI."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = [e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and any(n in e.name for n in names)]
    return sum(spans) / calls


LAYER_KERNELS = ("_query_kernel", "_store_kernel", "_logits_kernel")
FLASH_C4_LAYERS = 21  # DeepSeek-V4-Flash: 43 layers, two sliding-window-only, then C4 and C128 alternating


def layer_section(pool, gen):
    """One C4 layer's whole bf16 indexer in eager decode, as the model calls it: the query (into the forward's
    buffers), the key store (upstream's DecodePlan, every row storing: the step that completes a compressed key)
    and the logits (the forward's bound ``LogitsCall``), back to back for ``eager_calls`` layers.

    Per shape (rows x live keys at the capture width): ``eager_us`` a layer's wall clock with its host time,
    ``kernels_us`` its three kernels alone (CUPTI), ``host_added_us`` their difference; ``plan_us`` what a
    forward pays once when the width or the batch changed (its ``LogitsCall`` built and the first layer's
    plans made, minus a layer), and ``host_added_with_plan_us`` the per-layer figure with that plan spread
    over Flash's ``FLASH_C4_LAYERS`` C4 layers."""
    from dsv4_sm120.kernels import index_k_store, index_query

    rows_out = []
    calls, width, dry = SIZES["eager_calls"], SIZES["width"], g._DRY["on"]
    freqs = torch.polar(torch.ones(SIZES["max_pos"] * 4, 32, device=DEV),
                        torch.rand(SIZES["max_pos"] * 4, 32, generator=gen, device=DEV))
    for b in SIZES["eager_b"]:
        for live in SIZES["eager_live"]:
            q_in = torch.randn((b, H, D), generator=gen, device=DEV).to(torch.bfloat16)  # wq_b's output
            w_in = torch.randn((b, H), generator=gen, device=DEV).to(torch.bfloat16)
            pos = torch.full((b,), live - 1, device=DEV)
            out = (torch.empty_like(q_in), torch.empty((b, H, 1), dtype=torch.float32, device=DEV))
            kv = torch.randn((b, D), generator=gen, device=DEV)  # the compressor's fp32 output
            slots = torch.arange(b, device=DEV) * PAGE + 3
            step = torch.full((b, 4), -1, dtype=torch.int32, device=DEV)
            step[:, 0] = live  # a multiple of 4: every row completes a compressed key
            step = step.view(torch.uint8)
            keys = torch.zeros((b + 1, PAGE, D), dtype=torch.bfloat16, device=DEV)
            norm = torch.ones(D, device=DEV)
            _, _, sl, pt = case(pool.shape[0], b, [live] * b, width, gen)
            scratch = torch.empty((b, width), dtype=torch.float32, device=DEV)

            def layer(bound):
                qr, wr = index_query.index_query_bf16(q_in, w_in, 0.0110485, freqs, pos, out=out)
                index_k_store.store_index_k_bf16(kv, keys, slots, norm_weight=norm, norm_eps=1e-6, freqs=freqs,
                                                 mode="decode", plan=step)
                bound(qr, pool, wr)

            bound = mqa_logits.LogitsCall(sl, pt, width, scratch)
            layer(bound)
            res = {"shape": "eager_layer", "B": b, "live": live, "width": width, "calls": calls,
                   "eager_us": _eager_us(lambda: layer(bound), calls)}

            def new_plan():
                _forget_plans()
                index_query._PLANS.clear()
                index_k_store._PLANS.clear()
                layer(mqa_logits.LogitsCall(sl, pt, width, scratch))

            res["plan_us"] = _eager_us(new_plan, max(3, calls // 20)) - res["eager_us"]
            res["kernels_us"] = res["host_added_us"] = res["host_added_with_plan_us"] = None
            if not dry:
                res["kernels_us"] = _kernels_us(lambda: layer(bound), calls, LAYER_KERNELS)
                res["host_added_us"] = res["eager_us"] - res["kernels_us"]
                res["host_added_with_plan_us"] = res["host_added_us"] + res["plan_us"] / FLASH_C4_LAYERS
            rows_out.append(res)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
            del q_in, w_in, out, kv, keys, sl, pt, scratch
    return rows_out


def _forget_plans():
    mqa_logits._SPLITS.clear()
    mqa_logits._PLANS.clear()


def eager_section(pool, gen):
    """Decode logits as eager calls, host time included, beside CUDA-graph replays and the kernel alone (issue 24 d).

    Per shape (rows x live keys, width = the capture width, the same inputs every call, so keys may sit in L2:
    the decode section has the L2-cold kernel times): ``eager_us`` as the model calls it, with every host cache
    (split counts kept, direct launch): a ``LogitsCall`` with the lengths, page table, width and the forward's logits
    buffer bound (``model.deepseek_v4.TopkInputs``), given each layer's queries, weights and pool;
    ``eager_alloc_us`` the same call allocating its output, as a caller without a buffer meets it;
    ``eager_triton_dispatch_us`` with Triton's own dispatch instead of the direct launch;
    ``eager_before_us`` as before issue 24, the split search run before every call (its cache and the wrapper's
    plans emptied) and Triton's dispatch (the search itself now divides without ``triton.cdiv``, so this
    understates the old cost);
    ``graph_us`` per launch of a captured graph; ``kernel_us`` the kernel alone (CUPTI); ``host_added_us`` =
    eager minus kernel (``host_added_alloc_us`` for the allocating call). ``split_search_us`` is one search on the
    host. Dry runs time eager calls only.
    """
    rows_out = []
    calls, width, dry = SIZES["eager_calls"], SIZES["width"], g._DRY["on"]
    for b in SIZES["eager_b"]:
        for live in SIZES["eager_live"]:
            q, w, sl, pt = case(pool.shape[0], b, [live] * b, width, gen)
            w = w.unsqueeze(-1)  # as index_query_bf16 returns the head weights
            scratch = torch.empty((b, width), dtype=torch.float32, device=DEV)
            bound = mqa_logits.LogitsCall(sl, pt, width, scratch)
            eager = lambda: bound(q, pool, w)  # noqa: E731  (as the model calls it)
            eager_alloc = lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width)  # noqa: E731
            eager()
            eager_alloc()
            res = {"shape": "eager_decode", "B": b, "live": live, "width": width, "calls": calls,
                   "splits": decode_splits(b, width, device=pool.device, num_stages=mqa_logits.DECODE_CONFIG["num_stages"],
                                           heads=H)}
            res["eager_us"] = _eager_us(eager, calls)
            res["eager_alloc_us"] = _eager_us(eager_alloc, calls)
            direct, kernel_launch.DIRECT = kernel_launch.DIRECT, False
            try:
                res["eager_triton_dispatch_us"] = _eager_us(eager, calls)
                res["eager_before_us"] = _eager_us(eager_alloc, calls, before_each=_forget_plans)
            finally:
                kernel_launch.DIRECT = direct
            t0 = time.perf_counter()
            mqa_logits._SPLITS.clear()
            decode_splits(b, width, device=pool.device, num_stages=mqa_logits.DECODE_CONFIG["num_stages"], heads=H)
            res["split_search_us"] = (time.perf_counter() - t0) * 1e6
            res["graph_us"] = res["kernel_us"] = res["host_added_us"] = None
            if not dry:
                res["graph_us"] = _graph_us(eager, calls)
                try:
                    res["kernel_us"] = _kernel_us(eager, calls)
                    res["host_added_us"] = res["eager_us"] - res["kernel_us"]
                    res["host_added_alloc_us"] = res["eager_alloc_us"] - res["kernel_us"]
                    res["host_added_before_us"] = res["eager_before_us"] - res["kernel_us"]
                except Exception as exc:  # no CUPTI: the graph time stands in for the kernel's
                    res["kernel_us_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows_out.append(res)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
            del q, w, sl, pt, scratch
    return rows_out


def _host_us(fn, calls, rounds=5):
    """Host time of one call: wall clock of ``calls`` back-to-back calls from a sync to the return of the last
    (no sync after it: that many launches fit the launch queue, so no call waits for the GPU), over ``calls``;
    the median of ``rounds``."""
    fn()
    times = []
    for _ in range(rounds):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    _sync()
    return sorted(times)[len(times) // 2]


BREAKDOWN_FIELDS = {
    "whole_call": "the wrapper allocating its outputs, steady state (the model's call before issue 24 d's bound call)",
    "whole_call_out_given": "the wrapper with out= given (no allocation): the query as the model calls it",
    "bound_call": "logits only: as the model calls it, a LogitsCall with lengths, page table, width and output bound",
    "whole_call_new_layout": "logits only: a new width every call (max_seq_len grows in eager decode): a plan per call",
    "plan_launch": "the plan's Launch alone: addresses, alignment check, device, the cached launch",
    "torch_empty": "the outputs' torch.empty (the only torch op of a steady-state call)",
    "tensor_keys": "launch.tensor_key of each argument tensor: the reads that key the plan",
    "loop_overhead": "an empty lambda: the timing loop itself",
    "check_pages": "before the plans, per call: layout.check_pages",
    "normalize": "before the plans, per call: mqa_logits._normalize (a reshape of the [T, H, 1] weights)",
    "decode_splits_cached": "before the plans, per call: the cached decode split count",
    "specialization_key": "before the plans, per call: all_args + launch.specialization_key",
    "driver_device_stream": "before, per call: driver.active.get_current_device() + get_current_stream(device)",
    "cached_device_stream": "now: launch._device_getter()() + the _Direct's stream getter",
    "launch_metadata": "before, per call: CompiledKernel.launch_metadata (a dict for the never-None hook chains)",
    "triton_launcher": "before, per call: CompiledKernel.run, Triton's launcher, with launch_metadata (tensors)",
    "c_launch": "now: Triton's C launch function alone, arguments prepared (addresses)",
    "triton_dispatch": "kernel[grid](...): Triton's own dispatch and launch",
    "direct_matches_triton": "the direct path's output equals Triton's dispatch's, bit for bit (GPU runs)",
}


def _launch_pieces(launch, tensors) -> dict:
    """Host pieces of one Launch's call on the GPU (see BREAKDOWN_FIELDS)."""
    from triton import knobs
    from triton.runtime import driver

    args = launch.triton_args(tensors)
    full = kernel_launch.all_args(launch.kernel, args, launch.constexprs)
    direct = launch.direct.get(torch.cuda.current_device())
    if direct is None:  # no direct path on this Triton (kernels/launch.py): only Triton's dispatch to time
        return {"triton_dispatch": lambda: launch.kernel[launch.grid](*args, **launch.constexprs, **launch.options)}
    c = direct.compiled
    stream = direct.stream(direct.device)
    addresses = launch.args([t.data_ptr() for t in tensors] + launch.fixed)
    runtime = knobs.runtime
    return {
        "specialization_key": lambda: kernel_launch.specialization_key(
            launch.kernel, kernel_launch.all_args(launch.kernel, args, launch.constexprs)),
        "driver_device_stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "cached_device_stream": lambda: direct.stream(kernel_launch._device_getter()()),
        "launch_metadata": lambda: c.launch_metadata(launch.grid, stream, *full),
        "triton_launcher": lambda: c.run(*launch.grid3, stream, c.function, c.packed_metadata,
                                         c.launch_metadata(launch.grid, stream, *full), runtime.launch_enter_hook,
                                         runtime.launch_exit_hook, *full),
        "c_launch": (lambda: direct.bare(launch.grid3, stream, addresses)) if direct.bare else None,
        "triton_dispatch": lambda: launch.kernel[launch.grid](*args, **launch.constexprs, **launch.options),
    }


def _the_plan(module, call):
    """The one plan a call of ``module``'s wrapper builds (its plans emptied first)."""
    module._PLANS.clear()
    call()
    (plan,) = module._PLANS.values()
    return plan


def _direct_matches_triton(call, outputs) -> bool:
    """The wrapper's output through the direct path and through Triton's dispatch, compared bit for bit."""
    first = [t.clone() for t in outputs(call())]
    direct, kernel_launch.DIRECT = kernel_launch.DIRECT, False
    try:
        second = outputs(call())
    finally:
        kernel_launch.DIRECT = direct
    return all(torch.equal(a, b) for a, b in zip(first, second))


def host_breakdown(pool, gen):
    """Where an eager call's host time goes (issue 24 d), one piece at a time, for the model's three per-layer
    calls at a decode step of one request (1 x 4096 keys at the capture width): each piece timed alone with
    ``_host_us`` (BREAKDOWN_FIELDS says what each is). Dry runs time the pieces that need no GPU."""
    live = SIZES["eager_live"][0]
    res = {"B": 1, "live": live, "width": SIZES["width"], "calls": SIZES["breakdown_calls"], "rounds": 5,
           "fields": BREAKDOWN_FIELDS}
    freqs = torch.polar(torch.ones(4096, 32, device=DEV), torch.rand(4096, 32, generator=gen, device=DEV))
    res["mqa_logits"] = _logits_pieces(pool, gen, live)
    res["index_query"] = _query_pieces(gen, freqs, live)
    res["store_index_k"] = _store_pieces(gen, freqs, live)
    print(f"\nHOST BREAKDOWN  B=1 live={live} width={res['width']}: us per call, host only "
          f"(median of {res['rounds']} x {res['calls']} calls)", flush=True)
    for name in ("mqa_logits", "index_query", "store_index_k"):
        print(f"  {name:<14} " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in res[name].items()), flush=True)
    return res


def _logits_pieces(pool, gen, live) -> dict:
    from dsv4_sm120.kernels.launch import tensor_key
    from dsv4_sm120.kernels.layout import check_pages

    width, stages = SIZES["width"], mqa_logits.DECODE_CONFIG["num_stages"]
    q, w, sl, pt = case(pool.shape[0], 1, [live], width, gen)
    w = w.unsqueeze(-1)  # as index_query_bf16 returns the head weights
    out = torch.empty((1, width), dtype=torch.float32, device=DEV)
    call = lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width)  # noqa: E731
    plan = _the_plan(mqa_logits, call)
    bound = mqa_logits.LogitsCall(sl, pt, width, out)
    widths = iter(range(width, 0, -1))
    pieces = _time_pieces({
        "whole_call": call,
        "whole_call_out_given": lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=out),
        "bound_call": lambda: bound(q, pool, w),
        "whole_call_new_layout": lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, next(widths)),
        "plan_launch": lambda: plan.launch(q, w, pool, sl, pt, out),
        "torch_empty": lambda: torch.empty((1, width), dtype=torch.float32, device=DEV),
        "tensor_keys": lambda: [tensor_key(t) for t in (q, w, sl, pt, pool)],
        "loop_overhead": lambda: None,
        "check_pages": lambda: check_pages(pool),
        "normalize": lambda: mqa_logits._normalize(q, w, sl, pt),
        "decode_splits_cached": lambda: decode_splits(1, width, device=pool.device, num_stages=stages, heads=H),
    }, plan.launch, (q, w, pool, sl, pt, out), lambda: _direct_matches_triton(call, lambda o: [o[:, :live]]))
    mqa_logits._PLANS.clear()  # the new layouts'
    return pieces


def _query_pieces(gen, freqs, live) -> dict:
    from dsv4_sm120.kernels import index_query
    from dsv4_sm120.kernels.launch import tensor_key

    q = torch.randn((1, H, D), generator=gen, device=DEV).to(torch.bfloat16)  # wq_b's bf16 output
    w = torch.randn((1, H), generator=gen, device=DEV).to(torch.bfloat16)
    pos = torch.tensor([live - 1], device=DEV)
    rotated, scaled = torch.empty_like(q), torch.empty((1, H, 1), dtype=torch.float32, device=DEV)
    call = lambda: index_query.index_query_bf16(q, w, 0.0110485, freqs, pos)  # noqa: E731
    plan = _the_plan(index_query, call)
    return _time_pieces({
        "whole_call": call,
        "whole_call_out_given": lambda: index_query.index_query_bf16(q, w, 0.0110485, freqs, pos, out=(rotated, scaled)),
        "plan_launch": lambda: plan.launch(q, w, rotated, scaled, freqs, pos),
        "torch_empty": lambda: (torch.empty((1, H, D), dtype=torch.bfloat16, device=DEV),
                                torch.empty((1, H, 1), dtype=torch.float32, device=DEV)),
        "tensor_keys": lambda: [tensor_key(t) for t in (q, w, pos, freqs)],
        "loop_overhead": lambda: None,
    }, plan.launch, (q, w, rotated, scaled, freqs, pos), lambda: _direct_matches_triton(call, list))


def _store_pieces(gen, freqs, live) -> dict:
    from dsv4_sm120.kernels import index_k_store
    from dsv4_sm120.kernels.launch import tensor_key

    kv = torch.randn((1, D), generator=gen, device=DEV)  # fp32, the compressor's output
    pages = torch.zeros((4, PAGE, D), dtype=torch.bfloat16, device=DEV)
    slot, norm = torch.tensor([PAGE + 3], device=DEV), torch.ones(D, device=DEV)
    step = torch.tensor([[live, -1, -1, -1]], dtype=torch.int32, device=DEV).view(torch.uint8)  # a DecodePlan row
    call = lambda: index_k_store.store_index_k_bf16(  # noqa: E731
        kv, pages, slot, norm_weight=norm, norm_eps=1e-6, freqs=freqs, mode="decode", plan=step)
    plan = _the_plan(index_k_store, call)
    return _time_pieces({
        "whole_call": call,
        "plan_launch": lambda: plan.launch(kv, step, slot, slot, norm, freqs, pages),
        "tensor_keys": lambda: [tensor_key(t) for t in (kv, pages, slot, norm, freqs, step)],
        "loop_overhead": lambda: None,
    }, plan.launch, (kv, step, slot, slot, norm, freqs, pages),
        lambda: _direct_matches_triton(lambda: (pages.zero_(), call())[0], lambda p: [p.clone()]))


def _time_pieces(pieces: dict, launch, tensors, check) -> dict:
    """Each piece's ``_host_us``, with the GPU-only pieces of ``launch`` on the GPU, and the direct path's check."""
    calls, dry = SIZES["breakdown_calls"], g._DRY["on"]
    if not dry:
        pieces.update(_launch_pieces(launch, tensors))
    out = {name: None if fn is None else _host_us(fn, calls) for name, fn in pieces.items()}
    out["direct_matches_triton"] = None if dry else check()
    return out


HOST_BAR_US = 20.0  # issue 24 d: an eager call adds at most this much host time to its kernel


def _print_verdict(result: dict) -> None:
    """One line per eager shape of one request: the host time an eager logits call adds against the bar."""
    for r in result.get("eager_layer", []):
        if r.get("host_added_with_plan_us") is not None:
            verdict = "within" if r["host_added_with_plan_us"] <= HOST_BAR_US else "OVER"
            print(f"VERDICT eager C4 layer B={r['B']} live={r['live']} (query + store + logits, plan spread): "
                  f"eager {r['eager_us']:.1f} us, kernels {r['kernels_us']:.1f} us, host added "
                  f"{r['host_added_with_plan_us']:.1f} us: {verdict} the {HOST_BAR_US:.0f} us bar", flush=True)
    for r in result["eager"]:
        if r["B"] == 1 and r.get("host_added_us") is not None:
            verdict = "within" if r["host_added_us"] <= HOST_BAR_US else "OVER"
            print(f"VERDICT eager logits B=1 live={r['live']} (as the model calls it): eager {r['eager_us']:.1f} us, "
                  f"kernel {r['kernel_us']:.1f}"
                  f" us, host added {r['host_added_us']:.1f} us: {verdict} the {HOST_BAR_US:.0f} us bar", flush=True)


def verify_section(peers, pool, gen):
    rows_out = []
    for b, live in SIZES["verify"]:
        lens = [n for _ in range(b) for n in (live - 1, live)]  # next_n = 2 draft rows per request
        draws = decode_draws(pool, b, live, gen, rotation_count(b, live), rows_per_req=2)
        sl = torch.as_tensor(lens, dtype=torch.int32, device=DEV)
        for width in sorted({live, SIZES["width"]}):
            cut = [(q, w, pt[:, : math.ceil(width / PAGE)].contiguous()) for q, w, pt in draws]
            res, out = timed_pair_graph(peers, cut, pool, sl, width)
            res.update(shape="target_verify", B=b, next_n=2, rows=2 * b, live=live, width=width)
            q, w, pt = cut[0]
            res["check"] = check_rows(out, q, pool, w, sl, pt, width, [0, 1])
            rows_out.append(res)
            print(_row_text(res), flush=True)
            del out, cut
        del draws
    return rows_out


def prefill_section(peers, pool, gen, gemm_tflops):
    rows_out = []
    for n in SIZES["prefill"]:
        for kind in ("dense", "causal"):
            lens = [n] * n if kind == "dense" else list(range(1, n + 1))
            q, w, sl, pt = case(pool.shape[0], n, lens, n, gen, shared=True)
            res, out = timed_pair(peers, q, w, pool, sl, pt, n)
            flops = 2.0 * float(sl.double().sum()) * H * D
            res.update(shape="prefill", kind=kind, rows=n, keys=n, width=n, flops=flops,
                       ours_tflops=flops / res["ours_ms"] / 1e9)
            res["ours_gemm_fraction"] = res["ours_tflops"] / gemm_tflops
            for name in RATIO_KEY:
                if res[f"{name}_ms"]:
                    res[f"{name}_tflops"] = flops / res[f"{name}_ms"] / 1e9
            res["check"] = check_rows(out, q, pool, w, sl, pt, n, [0, n // 2, n - 1])
            rows_out.append(res)
            print(_row_text(res), flush=True)
            del out, q, w, sl, pt
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return rows_out


PREFILL_SWEEP = [dict(num_warps=nw, num_stages=ns) for nw in (4, 8) for ns in (2, 3, 4)]
DECODE_SWEEP = [dict(splits=sp, min_tiles=1, num_warps=nw, num_stages=ns)
                for sp in (None, 16, 32, 64, 128, 256) for nw in (4,) for ns in (2, 3, 4)]
DECODE_SWEEP_SHAPES = ((8, 32768), (64, 32768), (256, 32768))


def sweep_section(pool, gen):
    """Launch configurations of our kernel: prefill dense 8192, decode at the capture width."""
    n = SIZES["sweep_n"]
    out = {"prefill_dense": [], "decode_wide": []}
    q, w, sl, pt = case(pool.shape[0], n, [n] * n, n, gen, shared=True)
    buf = torch.empty((n, n), device=DEV)
    for cfg in PREFILL_SWEEP:
        try:
            ms = g.median_ms(lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, n, out=buf, **cfg), rep=60)
            out["prefill_dense"].append({**cfg, "ms": ms, "tflops": 2.0 * n * n * H * D / ms / 1e9})
        except Exception as exc:  # e.g. out of shared memory for a large tile: recorded, not fatal
            out["prefill_dense"].append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
        print("sweep prefill", out["prefill_dense"][-1], flush=True)
    shapes = DECODE_SWEEP_SHAPES if not g._DRY["on"] else ((2, 256),)
    for b, live in shapes:
        width = SIZES["width"]
        q, w, sl, pt = case(pool.shape[0], b, [live] * b, width, gen)
        buf = torch.empty((b, width), device=DEV)
        for cfg in DECODE_SWEEP:
            try:
                ms = g.median_ms(lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=buf, **cfg))
                out["decode_wide"].append({"B": b, "live": live, **cfg, "ms": ms})
            except Exception as exc:
                out["decode_wide"].append({"B": b, "live": live, **cfg, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
            print("sweep decode", out["decode_wide"][-1], flush=True)
    return out


TUNE_DECODE_SHAPES = ((1, 4096, CAPTURE_WIDTH), (1, 32768, CAPTURE_WIDTH), (1, 131072, CAPTURE_WIDTH),
                      (8, 4096, CAPTURE_WIDTH), (8, 32768, CAPTURE_WIDTH), (8, 131072, CAPTURE_WIDTH),
                      (64, 4096, CAPTURE_WIDTH), (64, 32768, CAPTURE_WIDTH), (256, 4096, CAPTURE_WIDTH),
                      (256, 32768, CAPTURE_WIDTH), (1, 32768, 32768), (8, 4096, 4096), (256, 4096, 4096))
_TD = dict(programs=None, min_tiles=1, tile_pages=1, num_stages=8, num_warps=4, early_q=False, page_hint=True,
           strided=True, qloop_tiles=0, qloop_stages=3)
TUNE_DECODE = ([dict(_TD)] + [dict(_TD, qloop_tiles=qt, qloop_stages=qs) for qt, qs in ((1, 2), (2, 2), (2, 3), (4, 3), (8, 3))]
               + [dict(_TD, num_stages=6, qloop_tiles=2, qloop_stages=3)])
TUNE_PREFILL = ([dict(rows_per_program=1, num_warps=4, num_stages=3),
                 dict(rows_per_program=4, num_warps=4, num_stages=3, inline_store=True)]
                + [dict(rows_per_program=r, num_warps=4, num_stages=ns) for r in (2, 4) for ns in (2, 3, 4)])
TUNE_PREFILL_LONG = [dict(rows_per_program=1, num_warps=4, num_stages=3), dict(rows_per_program=4, num_warps=4, num_stages=2),
                     dict(rows_per_program=4, num_warps=4, num_stages=3)]


def _decode_splits(rows, width, programs, min_tiles, tile_pages):
    return max(1, min(math.ceil(programs / rows), math.ceil(width / (PAGE * tile_pages * min_tiles))))


def tune_section(peer, pool, gen, rep=60, prefill=True, decode=True):
    """Launch configurations of our kernel beside upstream's fp8 kernel: decode timed in CUDA graphs over
    rotating page draws (as timed_pair_graph), prefill with do_bench."""
    out = {"decode": [], "prefill": []}
    dry = g._DRY["on"]
    dec_shapes = (TUNE_DECODE_SHAPES if not dry else ((2, 256, 1024),)) if decode else ()
    for b, live, width in dec_shapes:
        n = rotation_count(b, live) if not dry else 1
        draws = [(q, w, pt[:, : math.ceil(width / PAGE)].contiguous())
                 for q, w, pt in decode_draws(pool, b, live, gen, n)]
        sl = torch.full((b,), live, dtype=torch.int32, device=DEV)
        q0, w0, pt0 = draws[0]
        buf = torch.empty((b, width), device=DEV)
        ref = torch.full((b, width), float("nan"), device=DEV)
        bf16_paged_mqa_logits(q0, pool, w0, sl, pt0, width, out=ref)
        live_mask = torch.arange(width, device=DEV)[None, :] < sl[:, None]
        entry = {"B": b, "live": live, "width": width, "draws": n, "fp8_ms": [], "configs": []}
        fp8_graph = None
        if peer is not None and not dry:
            try:
                fp8_graph = _capture([peer.bind(q, w, sl, pt, width) for q, w, pt in draws])
            except Exception as exc:
                entry["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        g.preheat()
        if fp8_graph is not None:
            entry["fp8_ms"].append(_replay_ms(fp8_graph, n))
        for cfg in (TUNE_DECODE if not dry else TUNE_DECODE[:2]):
            c = dict(cfg)
            progs = c.pop("programs")
            if progs is None:  # the kernel's own wave-filling choice
                c["splits"] = decode_splits(b, width, device=pool.device, num_stages=c["num_stages"],
                                            min_tiles=c["min_tiles"], tile_pages=c["tile_pages"])
            else:
                c["splits"] = _decode_splits(b, width, progs, c["min_tiles"], c["tile_pages"])
            try:
                buf.fill_(float("nan"))
                bf16_paged_mqa_logits(q0, pool, w0, sl, pt0, width, out=buf, **c)
                err = float((buf[live_mask] - ref[live_mask]).norm() / ref[live_mask].norm())
                if dry:
                    ms = g.median_ms(lambda: bf16_paged_mqa_logits(q0, pool, w0, sl, pt0, width, out=buf, **c))
                else:
                    gr = _capture([(lambda q=q, w=w, pt=pt: bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=buf, **c))
                                   for q, w, pt in draws])
                    ms = _replay_ms(gr, n)
                    del gr
                entry["configs"].append({"programs": progs, **c, "ms": ms, "err_vs_default": err})
            except Exception as exc:
                entry["configs"].append({"programs": progs, **c, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
        if fp8_graph is not None:
            entry["fp8_ms"].append(_replay_ms(fp8_graph, n))
        ok = [c for c in entry["configs"] if "ms" in c]
        best = min(ok, key=lambda c: c["ms"])
        fp8_ms = sorted(entry["fp8_ms"])[0] if entry["fp8_ms"] else None
        print(f"tune decode B={b} live={live} width={width} fp8 {entry['fp8_ms']} best {best}"
              + (f" ratio {best['ms'] / fp8_ms:.3f}" if fp8_ms else ""), flush=True)
        out["decode"].append(entry)
        del draws, buf, ref, fp8_graph
    pre = [(SIZES["prefill"][0], kind, TUNE_PREFILL) for kind in ("dense", "causal")] if prefill else []
    if not dry and prefill:
        pre += [(SIZES["prefill"][-1], kind, TUNE_PREFILL_LONG) for kind in ("dense", "causal")]
    for n, kind, cfgs in pre:
        lens = [n] * n if kind == "dense" else list(range(1, n + 1))
        q, w, sl, pt = case(pool.shape[0], n, lens, n, gen, shared=True)
        buf = torch.empty((n, n), device=DEV)
        ref = torch.full((n, n), float("nan"), device=DEV)
        bf16_paged_mqa_logits(q, pool, w, sl, pt, n, out=ref, rows_per_program=1)
        live_mask = torch.isfinite(ref)
        flops = 2.0 * float(sl.double().sum()) * H * D
        entry = {"kind": kind, "rows": n, "fp8_ms": [], "configs": []}
        fp8 = None
        if peer is not None:
            fp8 = peer.bind(q, w, sl, pt, n)
        g.preheat()
        if fp8 is not None:
            entry["fp8_ms"].append(g.median_ms(fp8, rep=rep))
        for cfg in cfgs if not dry else cfgs[:2]:
            try:
                buf.fill_(float("nan"))
                bf16_paged_mqa_logits(q, pool, w, sl, pt, n, out=buf, **cfg)
                err = float((buf[live_mask] - ref[live_mask]).norm() / ref[live_mask].norm())
                ms = g.median_ms(lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, n, out=buf, **cfg), rep=rep)
                entry["configs"].append({**cfg, "ms": ms, "tflops": flops / ms / 1e9, "err_vs_r1": err})
            except Exception as exc:
                entry["configs"].append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
            print("tune prefill", kind, n, entry["configs"][-1], flush=True)
        if fp8 is not None:
            entry["fp8_ms"].append(g.median_ms(fp8, rep=rep))
        print("tune prefill fp8", kind, n, entry["fp8_ms"], flush=True)
        out["prefill"].append(entry)
        del q, w, sl, pt, buf, live_mask, ref
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def err_over_row_rms(out, ref):
    """max |out - ref| / rms(ref row): bf16 rounding of a 128-wide row is ~2^-9 of its rms."""
    o, r = out.float().reshape(-1, D), ref.float().reshape(-1, D)
    rms = r.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    return float(((o - r).abs() / rms).max())


def store_query_section(gen, read_gbps):
    """Store and query kernels at serving shapes and the dtypes production feeds, against float64 references."""
    res = {}
    max_pos = SIZES["max_pos"]
    freqs = torch.polar(torch.ones(max_pos, 32, device=DEV), torch.rand(max_pos, 32, generator=gen, device=DEV) * 6.28)
    n, pool = SIZES["store_n"], SIZES["store_pool"]
    kv = torch.randn((n, D), generator=gen, device=DEV)  # fp32: upstream's compressor output dtype
    nw = 1 + 0.1 * torch.randn(D, generator=gen, device=DEV)  # fp32, as the compressor's norm weight
    slots = torch.randperm(pool * PAGE, generator=gen, device=DEV)[:n]
    pos = torch.randint(0, max_pos, (n,), generator=gen, device=DEV)
    p1 = torch.full((pool, PAGE, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    p2 = p1.clone()
    kw = dict(norm_weight=nw, norm_eps=1e-6, freqs=freqs, positions=pos)
    store_index_k_bf16(kv, p1, slots, **kw)
    store_index_k_bf16_ref(kv, p2, slots, **kw)
    both = ~p2.isnan()
    res["store_kv_dtype"] = str(kv.dtype)
    res["store_slots_exact"] = bool(torch.equal(both, ~p1.isnan()))
    res["store_mismatch_frac"] = float((p1[both] != p2[both]).float().mean())
    res["store_max_err_over_row_rms"] = err_over_row_rms(p1[both], p2[both])
    res["store_ms"] = g.median_ms(lambda: store_index_k_bf16(kv, p1, slots, **kw))
    res["store_hbm_fraction"] = (n * D * 4 + n * D * 2 + n * 64 * 4) / (res["store_ms"] * 1e6) / read_gbps
    t = SIZES["query_t"]
    q = torch.randn((t, H, D), generator=gen, device=DEV).to(torch.bfloat16)  # wq_b's bf16 output
    wt = torch.randn(t, H, generator=gen, device=DEV).to(torch.bfloat16)
    pq = torch.randint(0, max_pos, (t,), generator=gen, device=DEV)
    a, wa = index_query_bf16(q, wt, 0.0110485, freqs, pq)
    b, wb = index_query_bf16_ref(q, wt, 0.0110485, freqs, pq)
    res["query_mismatch_frac"] = float((a != b).float().mean())
    res["query_max_err_over_row_rms"] = err_over_row_rms(a, b)
    res["query_weights_equal"] = bool(torch.allclose(wa, wb))
    res["query_ms"] = g.median_ms(lambda: index_query_bf16(q, wt, 0.0110485, freqs, pq))
    res["query_hbm_fraction"] = (2 * q.numel() * 2 + t * 64 * 4) / (res["query_ms"] * 1e6) / read_gbps
    return res


def correctness_ragged(pool, gen):
    """Ragged lengths, page boundaries, < 512 keys, 1 key, 64k+ keys; output poisoned with NaN."""
    max_len = SIZES["ragged_max"]
    lens = [x for x in (1, 63, 64, 65, 100, 511, 512, 513, 4096, 8191, 32768) if x < max_len] + [max_len]
    q, w, sl, pt = case(pool.shape[0], len(lens), lens, max_len, gen)
    out = torch.full((len(lens), max_len), float("nan"), device=DEV)
    bf16_paged_mqa_logits(q, pool, w, sl, pt, max_len, out=out)
    res = check_rows(out, q, pool, w, sl, pt, max_len, list(range(len(lens))))
    res["lens"] = lens
    return res


def _row_text(r):
    name = r["shape"] + (f" {r['kind']}" if "kind" in r else "")
    dims = f"B={r['B']}" if "B" in r else f"rows={r['rows']}"

    def fmt(key, spec):
        return format(r[key], spec) if r.get(key) else "-"

    return (f"{name:<22} {dims:<8} live={r['live'] if 'live' in r else r['keys']:<7} width={r['width']:<7} "
            f"ours {r['ours_ms']:.4f} ms  tilelang {fmt('fp8_ms', '.4f')} ms  deepgemm {fmt('deepgemm_ms', '.4f')} ms  "
            f"ours/tilelang {fmt('ratio', '.2f')}  ours/deepgemm {fmt('ratio_vs_deepgemm', '.2f')}  "
            f"err {r['check']['rel_err']:.1e} top512 {'=' if r['check']['top512_identical'] else 'DIFF'}")


def warm_deepgemm(build):
    """JIT-compiles, one process each and all at once, the DeepGEMM kernel variants the run will call.

    nvcc takes tens of seconds a variant; the timed run then finds them in DeepGEMM's on-disk cache.
    The paged kernel and the prefill kernel have one variant for all shapes here; the schedule kernel
    has one per batch rounded up to 32 rows.
    """
    rows = sorted(set(SIZES["decode_b"]) | {2 * b for b, _ in SIZES["verify"]})
    by_aligned = {}
    for r in rows:
        by_aligned.setdefault(math.ceil(r / 32), r)
    specs = [f"paged:{rows[0]}"] + [f"schedule:{r}" for r in by_aligned.values() if r != rows[0]] + ["ragged:256"]
    t0 = datetime.datetime.now()
    procs = {spec: subprocess.Popen([sys.executable, "-m", "bench.indexer_h200", "--deepgemm", build,
                                        "--deepgemm-warm-one", spec])
             for spec in specs}
    codes = {spec: proc.wait() for spec, proc in procs.items()}
    print(f"deepgemm warm-up {codes} in {(datetime.datetime.now() - t0).total_seconds():.0f} s", flush=True)


def warm_deepgemm_one(dg, spec):
    """One variant of warm_deepgemm, on tiny inputs with the run's template parameters (heads, dims, pages)."""
    kind, rows = spec.split(":")
    rows, keys = int(rows), 1024
    pool = torch.randn((keys // PAGE, PAGE, D), device=DEV).to(torch.bfloat16)
    q = torch.randn((rows, H, D), device=DEV).to(torch.bfloat16)
    w = torch.randn((rows, H), device=DEV)
    sl = torch.full((rows,), keys, dtype=torch.int32, device=DEV)
    pt = torch.arange(keys // PAGE, dtype=torch.int32, device=DEV).expand(rows, -1).contiguous()
    peer = (DeepGemmRaggedPeer if kind == "ragged" else DeepGemmPagedPeer)(dg, fp8_pool(pool))
    if kind == "schedule":
        peer.schedule(sl)
    else:
        peer.bind(q, w, sl, pt, keys)()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tilelang", help="upstream's tilelang_kernel.py from the sglang==0.5.23 wheel")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    ap.add_argument("--tune-only", action="store_true", help="only the launch-configuration tuning (its own JSON)")
    ap.add_argument("--tune-decode-only", action="store_true", help="with --tune-only: decode configurations only")
    ap.add_argument("--tune-prefill-only", action="store_true", help="with --tune-only: prefill configurations only")
    ap.add_argument("--dry-cpu", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): checks the script")
    ap.add_argument("--eager-only", action="store_true",
                    help="only the eager-vs-graph host-cost table of decode logits (its own JSON, under a minute)")
    ap.add_argument("--deepgemm",
                    help="a DeepGEMM build (the folder holding deep_gemm/), as bench/build_deepgemm_device.sh at commit 6f9738b made it")
    ap.add_argument("--deepgemm-warm", action="store_true", help="only JIT-compile DeepGEMM's kernel variants, in parallel")
    ap.add_argument("--deepgemm-warm-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.deepgemm_warm:
        return warm_deepgemm(args.deepgemm)
    if args.deepgemm_warm_one:
        return warm_deepgemm_one(load_deepgemm(args.deepgemm)[0], args.deepgemm_warm_one)
    global DEV
    if args.dry_cpu:
        DEV = "cpu"
        SIZES.update(DRY_SIZES)
        g.dry_run_mode()
    gen = torch.Generator(device=DEV)
    gen.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = g.run_meta()
    print(meta, flush=True)
    if args.eager_only:
        pool = torch.randn((max(SIZES["eager_b"]) * max(SIZES["eager_live"]) // PAGE, PAGE, D), generator=gen,
                           device=DEV).to(torch.bfloat16)
        result = {**meta, "capture_width": SIZES["width"], "eager_host_breakdown": host_breakdown(pool, gen),
                  "eager": eager_section(pool, gen), "eager_layer": layer_section(pool, gen)}
        _print_verdict(result)
        date = datetime.date.today().isoformat()
        g.write_json(Path(os.environ.get("OUT_JSON", "/tmp/indexer_eager_dry.json" if args.dry_cpu else
                                         g.REPO / "bench" / "results" / f"indexer_h200_eager_{date}.json")), result)
        return
    ceil = {**g.hbm_ceilings(), **g.gemm_ceiling(), **g.fp8_gemm_ceiling()}
    print(ceil, flush=True)
    result = {**meta, "ceilings": ceil, "capture_width": SIZES["width"]}
    if not args.dry_cpu and not args.tune_only:
        from dsv4_sm120.kernels import selftest

        result["selftest"] = [r.line() for r in selftest.run_all()]
        print("\n".join(result["selftest"]), flush=True)
    fn, why_not = load_tilelang(None if args.dry_cpu else args.tilelang)
    result["tilelang"] = {"loaded": fn is not None, "why_not": why_not, "file": args.tilelang}
    dg, dg_why_not = load_deepgemm(args.deepgemm)
    result["deepgemm"] = {"loaded": dg is not None, "why_not": dg_why_not, "build": args.deepgemm,
                          **(deepgemm_info(dg, args.deepgemm) if dg is not None else {})}
    pool_pages = max(max(SIZES["decode_b"]) * max(SIZES["decode_live"]) // PAGE,
                     12 * math.ceil(SIZES["ragged_max"] / PAGE))  # the ragged case's 12 rows, one table each
    pool = torch.randn((pool_pages, PAGE, D), generator=gen, device=DEV).to(torch.bfloat16)
    pool8 = fp8_pool(pool) if fn is not None or dg is not None else None
    peer = Fp8Peer(fn, pool8) if fn is not None else None
    paged_peers = ([peer] if peer else []) + ([DeepGemmPagedPeer(dg, pool8)] if dg is not None else [])
    prefill_peers = ([peer] if peer else []) + ([DeepGemmRaggedPeer(dg, pool8)] if dg is not None else [])
    if args.tune_only:
        result["tune"] = tune_section(peer, pool, gen, prefill=not args.tune_decode_only,
                                      decode=not args.tune_prefill_only)
        path = Path(os.environ.get("OUT_JSON", "/tmp/indexer_tune_dry.json"))
        g.write_json(path, result)
        return
    date = datetime.date.today().isoformat()
    default = g.REPO / "bench" / "results" / "kernels" / f"indexer_h200_{date}.json"
    path = Path(os.environ.get("OUT_JSON", "/tmp/indexer_dry.json" if args.dry_cpu else default))
    result["correctness_ragged"] = correctness_ragged(pool, gen)
    print("ragged", result["correctness_ragged"], flush=True)
    result["store_query"] = store_query_section(gen, ceil["hbm_read_gbps"])
    print("store/query", result["store_query"], flush=True)
    # the JSON is rewritten after each timed section, so a run cut short keeps what it finished
    result["decode"] = decode_section(paged_peers, pool, gen, ceil["hbm_read_gbps"])
    g.write_json(path, result)
    result["eager_host_breakdown"] = host_breakdown(pool, gen)
    result["eager"] = eager_section(pool, gen)
    _print_verdict(result)
    g.write_json(path, result)
    result["target_verify"] = verify_section(paged_peers, pool, gen)
    g.write_json(path, result)
    result["prefill"] = prefill_section(prefill_peers, pool, gen, ceil["gemm_bf16_tflops"])
    if not args.no_sweep:
        result["sweep"] = sweep_section(pool, gen)
    g.write_json(path, result)
    print("\nTABLE")
    for r in result["decode"] + result["target_verify"] + result["prefill"]:
        print(_row_text(r))


if __name__ == "__main__":
    main()

"""Ours and each upstream peer on the same inputs, timed side by side: our time over the peer's, how far the
peer's scores agree with ours, and the printed line of each row.

Timing: decode and target-verify run as in serving (``timed_pair_graph``), each kernel's launches captured in
one CUDA graph over independent page draws (at least 512 MiB of keys per replay, so no launch finds its keys
in L2), five alternating rounds, the median; with do_bench (L2 flush before each call, host launch in the
timed region) the 4-10 us kernels read 10-60 us and changed from run to run. Prefill uses do_bench
(``timed_pair``, milliseconds per call).
"""

from __future__ import annotations

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import TOPK, capture, replay_ms
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits


RATIO_KEY = {"fp8": "ratio", "deepgemm": "ratio_vs_deepgemm"}  # ours / peer


def peer_agreement(ours, theirs, sl, name):
    """How far a peer's fp8 scores are from ours on the rows and keys it scored (small: fp8 rounding, not a bug)."""
    theirs = theirs[:, : ours.shape[1]]  # DeepGEMM's prefill logits are max_seqlen_k (a page multiple) wide
    live = torch.arange(ours.shape[1], device=cases.DEV)[None, :] < sl[:, None]
    if not bool(live.any()):  # e.g. a tiny dry-run prefill: every row left to the top-k
        return {f"{name}_vs_bf16_rel_err": None, f"{name}_vs_bf16_top512_overlap_min": None}
    err = float((theirs[live] - ours[live]).norm() / ours[live].norm())
    scored = [(r, n) for r, n in enumerate(sl.tolist()) if n > 0][:4]
    overlap = [len(set(torch.topk(ours[r, :n], min(TOPK, n)).indices.tolist())
                   & set(torch.topk(theirs[r, :n], min(TOPK, n)).indices.tolist())) / min(TOPK, n)
               for r, n in scored]
    return {f"{name}_vs_bf16_rel_err": err, f"{name}_vs_bf16_top512_overlap_min": min(overlap)}


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
    out = torch.full((q.shape[0], width), float("nan"), device=cases.DEV)
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
    out = torch.full((q0.shape[0], width), float("nan"), device=cases.DEV)
    bf16_paged_mqa_logits(q0, pages, w0, sl, pt0, width, out=out, **kw)
    scratch = torch.empty_like(out)
    ours = [(lambda q=q, w=w, pt=pt: bf16_paged_mqa_logits(q, pages, w, sl, pt, width, out=scratch, **kw))
            for q, w, pt in draws]
    graphs = {"ours": capture(ours)}
    res = {**_peer_fields(), "timing": "cuda_graph", "draws": len(draws)}
    _, outs = _bind_peers(peers, q0, w0, sl, pt0, width, res)
    ran = [peer for peer in peers if peer.name in outs]
    for peer in ran:
        try:
            graphs[peer.name] = capture([peer.bind(q, w, sl, pt, width) for q, w, pt in draws])
        except Exception as exc:
            error = {f"{peer.name}_graph_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            del graphs, outs
            torch.cuda.synchronize()
            r, o = timed_pair(ran, q0, w0, pages, sl, pt0, width, rounds=rounds, **kw)
            r.update(timing="do_bench", **error)
            return r, o
    g.preheat()
    _time_alternating(res, {k: (lambda gr=gr: replay_ms(gr, len(draws))) for k, gr in graphs.items()}, rounds)
    _compare_with_peers(res, out, outs, peers, sl)
    del graphs, scratch, outs
    torch.cuda.synchronize()
    return res, out


def row_text(r):
    name = r["shape"] + (f" {r['kind']}" if "kind" in r else "")
    dims = f"B={r['B']}" if "B" in r else f"rows={r['rows']}"

    def fmt(key, spec):
        return format(r[key], spec) if r.get(key) else "-"

    return (f"{name:<22} {dims:<8} live={r['live'] if 'live' in r else r['keys']:<7} width={r['width']:<7} "
            f"ours {r['ours_ms']:.4f} ms  tilelang {fmt('fp8_ms', '.4f')} ms  deepgemm {fmt('deepgemm_ms', '.4f')} ms  "
            f"ours/tilelang {fmt('ratio', '.2f')}  ours/deepgemm {fmt('ratio_vs_deepgemm', '.2f')}  "
            f"err {r['check']['rel_err']:.1e} top512 {'=' if r['check']['top512_identical'] else 'DIFF'}")

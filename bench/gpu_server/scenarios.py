"""What a GPU serving run does with its servers, and the figures it keeps.

``serve`` (issue scenarios a, b, e, f) on the ``tiny`` checkpoint: upstream (``--model-impl sglang``), the
package with bf16 keys and the package with fp8 keys, eager and with decode CUDA graphs, serve a grid of
greedy batches (1, 8 and 64 prompts, 128 to 16384 tokens: past 2048 tokens the top-512 selection is
active); every batch is sent three times with prompts of the same shape, so the first request of each new
shape can be held against the same shape's steady state. The fp8 package server must give upstream's
tokens request for request; the bf16 and fp8 top-512 selections of the same rows are compared on one
forward each; every package server must say once, in its log, what it built.

``cost`` (scenario c) on ``flash12``: decode step and prefill time of the package (bf16 keys) against
upstream with each of its production fp8 indexer kernels, servers visited in shuffled rounds, each step
measured by the client and from sglang's own decode log, and every step's kernels side by side.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.gpu_server import step_log, traffic
from bench.gpu_server.servers import ServerSpec
from harness import dsv4_checkpoints

GRID = [(1, 128), (1, 2048), (1, 4096), (1, 16384), (8, 128), (8, 4096), (8, 16384), (64, 128), (64, 2048)]
NEW_TOKENS = 16
REPEATS = 3  # the first call of a shape, then two of the same shape with other prompts
OVERLAP_CONTEXTS = [4096, 8192, 16384]
MODEL_BUILT_MARK = "dsv4-sm120: built"


def serve_specs() -> list[ServerSpec]:
    capture = ["--enable-return-indexer-topk"]
    return [
        ServerSpec("sglang_graph", "tiny", "sglang"),
        ServerSpec("dsv4_graph", "tiny", "dsv4"),
        ServerSpec("dsv4fp8_graph", "tiny", "dsv4", index_k="fp8"),
        ServerSpec("sglang_eager", "tiny", "sglang", graphs=False, extra_args=capture),
        ServerSpec("dsv4_eager", "tiny", "dsv4", graphs=False, extra_args=capture),
    ]


def _grid(url: str, vocab: int) -> list[dict]:
    points = []
    for i, (batch, length) in enumerate(GRID):
        calls = []
        for rep in range(REPEATS):
            ids = traffic.prompts(100 * i + rep, batch, length, vocab)
            seconds, results = traffic.generate(url, ids, NEW_TOKENS)
            calls.append({"seconds": round(seconds, 4), "outputs": [traffic.digest(r) for r in results],
                          "first_tokens": traffic.output_ids(results[0])[:8]})
        steady = statistics.median(c["seconds"] for c in calls[1:])
        points.append({"batch": batch, "prompt_tokens": length, "calls": calls,
                       "first_over_steady": round(calls[0]["seconds"] / steady, 3)})
    return points


def _overlap_requests(url: str, vocab: int, layers: int, topk: int) -> dict:
    out = {}
    for ctx in OVERLAP_CONTEXTS:
        _, results = traffic.generate(url, [traffic.prompt(9000 + ctx, ctx, vocab)], 2, return_indexer_topk=True)
        out[ctx] = traffic.indexer_topk(results[0], layers, topk)
    return out


def topk_overlap(a, b, *, first_row: int) -> dict:
    """Share of the top-k of ``b`` (per row and layer) that ``a`` selects too, over rows from ``first_row``
    (before it every compressed key is selected and the two agree trivially)."""
    import numpy as np

    rows = min(a.shape[0], b.shape[0])
    shares = []
    for r in range(first_row, rows):
        for layer in range(a.shape[1]):
            sa = set(int(x) for x in a[r, layer] if x >= 0)
            sb = set(int(x) for x in b[r, layer] if x >= 0)
            if sb:
                shares.append(len(sa & sb) / len(sb))
    if not shares:
        return {"rows": 0}
    arr = np.array(shares)
    return {"rows": rows - first_row, "pairs": len(shares), "mean": round(float(arr.mean()), 4),
            "p10": round(float(np.percentile(arr, 10)), 4), "min": round(float(arr.min()), 4)}


def built_lines(log_text: str) -> list[str]:
    return [ln.strip() for ln in log_text.splitlines() if MODEL_BUILT_MARK in ln]


def run_serve(servers: dict, logs: dict, work_dir=None, out: dict | None = None) -> dict:
    """Scenarios a, b, e, f over the started servers (name -> url); ``logs``: name -> callable giving the log.
    ``out`` is filled as the figures come in (a run stopped early keeps what it measured)."""
    cfg = dsv4_checkpoints.config("tiny")
    vocab, topk, layers = cfg["vocab_size"], cfg["index_topk"], dsv4_checkpoints.c4_layers("tiny")
    result = out if out is not None else {}
    result["grid"] = {}
    captured = {}
    for name, url in servers.items():
        if name.endswith("_eager"):  # capture first, so both eager servers have the same history
            captured[name] = _overlap_requests(url, vocab, layers, topk)
        result["grid"][name] = _grid(url, vocab)
    result["a_served"] = {name: all(o.endswith(f"/{NEW_TOKENS}") for p in pts for c in p["calls"] for o in c["outputs"])
                          for name, pts in result["grid"].items()}
    result["b_fp8_equals_upstream"] = compare(result["grid"], "dsv4fp8_graph", "sglang_graph")
    result["b_bf16_vs_upstream"] = compare(result["grid"], "dsv4_graph", "sglang_graph")
    result["eager_vs_graph"] = {impl: compare(result["grid"], f"{impl}_eager", f"{impl}_graph")
                                for impl in ("sglang", "dsv4")}
    if "dsv4_eager" in captured and "sglang_eager" in captured:
        result["b_topk_overlap_bf16_vs_fp8"] = {
            ctx: (topk_overlap(captured["dsv4_eager"][ctx], captured["sglang_eager"][ctx], first_row=4 * topk + 64)
                  if captured["dsv4_eager"][ctx] is not None and captured["sglang_eager"][ctx] is not None
                  else {"error": "no indexer_topk in the response"})
            for ctx in OVERLAP_CONTEXTS}
    result["e_first_over_steady"] = {name: {f"{p['batch']}x{p['prompt_tokens']}": p["first_over_steady"]
                                            for p in pts} for name, pts in result["grid"].items()}
    result["f_model_built_lines"] = {name: built_lines(logs[name]()) for name in servers}
    return result


def compare(grid: dict, a: str, b: str) -> dict:
    """Requests whose greedy tokens are equal on servers ``a`` and ``b``, per grid point and in all."""
    if a not in grid or b not in grid:
        return {"error": f"missing {a} or {b}"}
    per_point, same, total = {}, 0, 0
    for pa, pb in zip(grid[a], grid[b]):
        eq = sum(oa == ob for ca, cb in zip(pa["calls"], pb["calls"]) for oa, ob in zip(ca["outputs"], cb["outputs"]))
        n = sum(len(c["outputs"]) for c in pa["calls"])
        per_point[f"{pa['batch']}x{pa['prompt_tokens']}"] = f"{eq}/{n}"
        same, total = same + eq, total + n
    return {"equal": same, "requests": total, "per_point": per_point}


# --- scenario c -------------------------------------------------------------------------------------------

DECODE_POINTS = [(b, ctx) for ctx in (32768, 4096) for b in (8, 64, 1)]  # the long context first
PREFILL_POINTS = [4096, 16384]
PROFILE_POINTS = DECODE_POINTS  # every point, every server: the kernel-by-kernel difference of the steps
PROFILE_TOKENS = 1024
DECODE_SHORT, DECODE_STEPS = 8, 64
# Rounds per point, each visiting every server once in an order of its own (``_visit_order``: ABBA over a
# shuffle per point); a figure is the median of a server's visits, its spread their min-max: on an H200 one visit in a
# pair of two was 6% off its partner (3.397 vs 3.193 ms), more than the bar the figure is held to.
DECODE_ROUNDS = PREFILL_ROUNDS = 5
# sglang logs a decode line every this many steps: a visit's 72 steps give 8 clean windows (step_log.py)
DECODE_LOG_INTERVAL = 8
# The two measures of a ratio "disagree" past this (0.5%): the client's stream against sglang's own log.
DISAGREE = 0.005
TAIL = 32  # each decode prompt: the shared context prefix plus a tail of its own


def cost_specs() -> list[ServerSpec]:
    # Half the pool for the sliding-window layers (upstream's default is a tenth): with 64 requests running, a
    # tenth was nearly full, evicted the cached context's window and sent part of each batch back to prefill.
    common = dict(mem_fraction=0.4, max_total_tokens=393216, context_length=40960, chunked_prefill=16384,
                  extra_args=["--swa-full-tokens-ratio", "0.5", "--decode-log-interval", str(DECODE_LOG_INTERVAL)])
    return [
        ServerSpec("dsv4_bf16", "flash12", "dsv4", **common),
        ServerSpec("sglang_tilelang", "flash12", "sglang", upstream_indexer="tilelang", **common),
        ServerSpec("sglang_deepgemm", "flash12", "sglang", upstream_indexer="deepgemm", **common),
    ]


def warm_every_shape(servers: dict, prefixes: dict, vocab: int, prefill_points=None, decode_points=None,
                     new_tokens: int | None = None) -> dict:
    """Each timed shape once on every server (by default the cost set's points), untimed by the cost figures: on a cold JIT cache the first request
    of a shape compiles kernels for it (minutes on Flash's dimensions: on a cold cache an H200 server was still
    capturing its first decode batch size after 4 minutes), which no timed visit may include (a decode visit is
    the difference of two requests, so a compile in the first would come out as a negative step). Kept per shape
    in ms, so that each can be held against the same shape's steady state (scenario e on Flash's dimensions)."""
    first: dict = {name: {} for name in servers}
    for name, url in servers.items():
        for i, length in enumerate(PREFILL_POINTS if prefill_points is None else prefill_points):
            first[name][f"prefill {length}"] = traffic.generate(url, [traffic.prompt(40000 + i, length, vocab)], 1)[0] * 1e3
        for i, (batch, ctx) in enumerate(DECODE_POINTS if decode_points is None else decode_points):
            ids = traffic.prompts(900000 + 10 * i, batch, ctx, vocab, prefix=prefixes[ctx])
            tokens = DECODE_SHORT + DECODE_STEPS if new_tokens is None else new_tokens
            first[name][f"decode {batch}x{ctx}"] = traffic.generate(url, ids, tokens)[0] * 1e3
    return {name: {shape: round(ms, 1) for shape, ms in shapes.items()} for name, shapes in first.items()}


def first_vs_steady(first: dict, decode: dict, prefill: dict) -> dict:
    """Each server's first request of a shape over the median of the same request's timed visits."""
    out: dict = {}
    for name, shapes in first.items():
        for shape, ms in shapes.items():
            kind, point = shape.split(" ")
            visits = (prefill.get(point, {}).get(name, {}).get("visits_ms") if kind == "prefill"
                      else decode.get(point, {}).get(name, {}).get("long_visits_ms"))
            if visits:
                out.setdefault(name, {})[shape] = round(ms / statistics.median(visits), 2)
    return out


def _visit_order(names: list[str], point: str, rnd: int) -> list[str]:
    """Every server once, in round ``rnd``'s order at ``point``: one shuffle per point (seeded by it), turned by one
    place every two rounds, and each odd round the even one before it reversed (ABBA). Over five rounds of three
    servers every two of them are met in each order two or three times; a shuffle seeded by point and round had
    visited one server before another in all five rounds of some points."""
    base = sorted(names)
    random.Random(point).shuffle(base)
    turn = (rnd // 2) % len(base)
    order = base[turn:] + base[:turn]
    return order[::-1] if rnd % 2 else order


def _spread(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    return {"min": round(min(vals), 4), "max": round(max(vals), 4), "n": len(vals)} if vals else None


def run_cost(servers: dict, logs: dict | None = None, work_dir=None, out: dict | None = None) -> dict:
    """Decode step (ms) at batch 1/8/64 x context 4k/32k and prefill (ms) of 4k/16k, every server visited once
    per round in a shuffled order (``DECODE_ROUNDS``, ``PREFILL_ROUNDS``; the orders are in the record), each
    figure the median of a server's visits with their min-max. A decode visit streams one batch whose context
    prefix is cached, measured twice: by the client, from each prompt's ``DECODE_SHORT``-th token to its last
    over the ``DECODE_STEPS`` tokens between (the median prompt), so prefill is outside it (timing the
    difference of two requests instead carried each request's own extend: on an H200 that gave steps from -8
    to +12 ms for one point); and by the server, from sglang's own decode log written during the visit
    (``step_log.py``; ``logs`` gives each server's log). Where the two ratios differ by more than
    ``DISAGREE`` the record says so. Then, with ``work_dir``, a profile of a few steps of every point on every
    server, and the package's step against each upstream kernel's, kernel by kernel."""
    cfg = dsv4_checkpoints.config("flash12")
    vocab = cfg["vocab_size"]
    names = list(servers)
    result = out if out is not None else {}
    decode, prefill, shares = result.setdefault("decode", {}), result.setdefault("prefill", {}), {}
    prefixes = {ctx: traffic.prompt(70000 + ctx, ctx - TAIL, vocab) for ctx in sorted({c for _, c in DECODE_POINTS})}
    for ctx, prefix in prefixes.items():  # every server caches the same prefix before any timing
        for name in names:
            traffic.generate(servers[name], [prefix + traffic.prompt(1, TAIL, vocab)], 1)
    result["first_ms"] = first = warm_every_shape(servers, prefixes, vocab)
    order = result.setdefault("visit_order", {})
    for i, length in enumerate(PREFILL_POINTS):
        visits = {n: [] for n in names}
        for rep in range(PREFILL_ROUNDS):
            order[f"prefill {length} round {rep}"] = names_now = _visit_order(names, f"prefill {length}", rep)
            for v, name in enumerate(names_now):  # a fresh prompt each visit: nothing cached
                t, _ = traffic.generate(servers[name], [traffic.prompt(50000 + 100 * i + 10 * rep + v, length, vocab)], 1)
                visits[name].append(t * 1e3)
        prefill[str(length)] = {n: {"ms": round(statistics.median(v), 3), "spread": _spread(v),
                                    "visits_ms": [round(x, 3) for x in v]} for n, v in visits.items()}
    for i, (batch, ctx) in enumerate(DECODE_POINTS):
        visits: dict = {n: [] for n in names}
        server: dict = {n: [] for n in names}
        long_visits: dict = {n: [] for n in names}
        for rep in range(DECODE_ROUNDS):
            order[f"decode {batch}x{ctx} round {rep}"] = names_now = _visit_order(names, f"decode {batch}x{ctx}", rep)
            for v, name in enumerate(names_now):
                ids = traffic.prompts(1000 * i + 100 * rep + 10 * v, batch, ctx, vocab, prefix=prefixes[ctx])
                logged = len(logs[name]()) if logs else None
                seconds, arrivals = traffic.stream_token_times(servers[name], ids, DECODE_SHORT + DECODE_STEPS)
                visits[name].append(traffic.step_seconds(arrivals, DECODE_SHORT) * 1e3)
                long_visits[name].append(seconds * 1e3)
                server[name].append(step_log.visit_step_ms(logs[name]()[logged:], batch) if logs else None)
        decode[f"{batch}x{ctx}"] = {
            n: {"step_ms": round(statistics.median(v), 3), "spread": _spread(v), "visits_ms": [round(x, 3) for x in v],
                "server_step_ms": (round(statistics.median([x for x in server[n] if x is not None]), 4)
                                   if any(x is not None for x in server[n]) else None),
                "server_spread": _spread(server[n]), "server_visits_ms": server[n],
                "long_visits_ms": [round(x, 1) for x in long_visits[n]]}
            for n, v in visits.items()}
    result["ratios"] = ratios(decode, prefill)
    result["measures_disagree"] = disagreements(result["ratios"])
    result["first_vs_steady"] = first_vs_steady(first, decode, prefill)
    result["indexer_share"] = shares
    if work_dir is not None:  # after the timed visits: a profile window slows the step it records
        for batch, ctx in PROFILE_POINTS:
            for name in names:
                try:
                    shares[f"{name} decode {batch}x{ctx}"] = profile_decode(
                        servers[name], work_dir, f"{name}_{batch}x{ctx}", batch, ctx, prefixes[ctx], vocab)
                except Exception as exc:  # a figure the run could not take is said, not fatal
                    shares[f"{name} decode {batch}x{ctx}"] = {"error": f"{type(exc).__name__}: {exc}"}
        result["kernel_diff"] = {
            f"dsv4_bf16 - {base} decode {batch}x{ctx}": step_log.kernel_diff(ours["table"], theirs["table"])
            for batch, ctx in PROFILE_POINTS for base in ("sglang_tilelang", "sglang_deepgemm")
            if "table" in (ours := shares.get(f"dsv4_bf16 decode {batch}x{ctx}", {}))
            and "table" in (theirs := shares.get(f"{base} decode {batch}x{ctx}", {}))}
    return result


def ratios(decode: dict, prefill: dict) -> dict:
    """The package's time over each upstream kernel's, per point."""
    def ratio(a: float, b: float):
        return round(a / b, 4) if b > 0 else None

    out = {}
    for base in ("sglang_tilelang", "sglang_deepgemm"):
        out[f"dsv4_bf16/{base}"] = {
            **{f"decode {k}": ratio(v["dsv4_bf16"]["step_ms"], v[base]["step_ms"]) for k, v in decode.items()
               if base in v and "dsv4_bf16" in v},
            **{f"prefill {k}": ratio(v["dsv4_bf16"]["ms"], v[base]["ms"]) for k, v in prefill.items()
               if base in v and "dsv4_bf16" in v},
        }
        out[f"dsv4_bf16/{base} server"] = {  # sglang's own decode log (step_log.py)
            f"decode {k}": ratio(v["dsv4_bf16"]["server_step_ms"], v[base]["server_step_ms"]) for k, v in decode.items()
            if base in v and "dsv4_bf16" in v and v[base].get("server_step_ms") and v["dsv4_bf16"].get("server_step_ms")}
    return out


def disagreements(ratio_table: dict) -> dict:
    """The decode points where the client's ratio and the server's differ by more than ``DISAGREE``."""
    out = {}
    for base in ("sglang_tilelang", "sglang_deepgemm"):
        client, server = ratio_table.get(f"dsv4_bf16/{base}", {}), ratio_table.get(f"dsv4_bf16/{base} server", {})
        for point, r in server.items():
            if client.get(point) and r and abs(client[point] - r) > DISAGREE:
                out[f"{base} {point}"] = {"client": client[point], "server": r}
    return out


# The indexer's kernels by name in a torch-profiler trace: the package's Triton logits kernel, DeepGEMM's and
# TileLang's fp8 paged MQA logits, and the top-k transforms all of them feed.
INDEXER_KERNELS = {"logits": r"_logits_kernel|paged_mqa_logits|mqa_logits", "topk": r"topk"}


def kernel_shares(trace_path) -> dict:
    """GPU time per kernel family of one sglang profile (``*.trace.json.gz``): the indexer's share of it."""
    import gzip
    import json
    import re
    from collections import Counter

    with gzip.open(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    per_name: Counter = Counter()
    for ev in events:
        if ev.get("cat") == "kernel" and "dur" in ev:
            per_name[ev["name"]] += float(ev["dur"])
    total = sum(per_name.values())
    out = {"kernel_us": round(total, 1), "kernels": sum(1 for ev in events if ev.get("cat") == "kernel")}
    for family, pattern in INDEXER_KERNELS.items():
        us = sum(v for k, v in per_name.items() if re.search(pattern, k, re.I))
        out[f"{family}_us"] = round(us, 1)
        out[f"{family}_share"] = round(us / total, 4) if total else None
    out["top"] = [(k[:80], round(v, 1)) for k, v in per_name.most_common(6)]
    return out


def profile_decode(url: str, out_dir, name: str, batch: int, ctx: int, prefix: list[int], vocab: int,
                   steps: int = 4, timeout: float = 60) -> dict:
    """Profile ``steps`` decode steps of a running batch on one server; the kernel shares of that window."""
    from pathlib import Path

    out_dir = Path(out_dir) / name
    ids = traffic.prompts(424242 + batch, batch, ctx, vocab, prefix=prefix)
    # Long enough to still decode when the profile starts: 96 tokens of one request at 32k were over (3 ms a
    # step on an H200) before it did, and the profiler then waited for steps that never came. The profile
    # starts 1 s in: the batch's short prefill is over; it decodes.
    trace = traffic.profile_window(url, out_dir, lambda: traffic.generate(url, ids, PROFILE_TOKENS), wait_s=1.0,
                                   steps=steps, activities=["GPU"], name=name, timeout=timeout)
    if trace is not None:
        return {"steps": steps, **kernel_shares(trace), "table": step_log.kernel_table(trace, steps)}
    return {"error": f"no trace in {out_dir} after {timeout:.0f}s"}

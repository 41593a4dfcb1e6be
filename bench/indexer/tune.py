"""Which launch configuration of our logits kernel is fastest, and how does it stand against upstream's?

``sweep_section`` (part of the full run; ``--no-sweep`` skips it): warps and stages for prefill dense 8192,
decode splits at the capture width. ``tune_section`` (``--tune-only``, with ``--tune-decode-only`` or
``--tune-prefill-only``): configurations beside upstream's TileLang fp8 kernel, decode in CUDA graphs over
rotating page draws (as ``paired.timed_pair_graph``), prefill with do_bench, each with its error against a
reference launch's output.
"""

from __future__ import annotations

import math

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import CAPTURE_WIDTH, D, H, PAGE, SIZES, capture, case, decode_draws, replay_ms, rotation_count
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits, decode_splits


PREFILL_SWEEP = [dict(num_warps=nw, num_stages=ns) for nw in (4, 8) for ns in (2, 3, 4)]
DECODE_SWEEP = [dict(splits=sp, min_tiles=1, num_warps=nw, num_stages=ns)
                for sp in (None, 16, 32, 64, 128, 256) for nw in (4,) for ns in (2, 3, 4)]
DECODE_SWEEP_SHAPES = ((8, 32768), (64, 32768), (256, 32768))


def sweep_section(pool, gen):
    """Launch configurations of our kernel: prefill dense 8192, decode at the capture width."""
    n = SIZES["sweep_n"]
    out = {"prefill_dense": [], "decode_wide": []}
    q, w, sl, pt = case(pool.shape[0], n, [n] * n, n, gen, shared=True)
    buf = torch.empty((n, n), device=cases.DEV)
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
        buf = torch.empty((b, width), device=cases.DEV)
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
_TD = dict(programs=None, min_tiles=1, tile_pages=1, num_stages=8, num_warps=4)
TUNE_DECODE = ([dict(_TD)] + [dict(_TD, num_stages=ns) for ns in (4, 6)] + [dict(_TD, min_tiles=mt) for mt in (2, 4)]
               + [dict(_TD, tile_pages=2)])
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
        sl = torch.full((b,), live, dtype=torch.int32, device=cases.DEV)
        q0, w0, pt0 = draws[0]
        buf = torch.empty((b, width), device=cases.DEV)
        ref = torch.full((b, width), float("nan"), device=cases.DEV)
        bf16_paged_mqa_logits(q0, pool, w0, sl, pt0, width, out=ref)
        live_mask = torch.arange(width, device=cases.DEV)[None, :] < sl[:, None]
        entry = {"B": b, "live": live, "width": width, "draws": n, "fp8_ms": [], "configs": []}
        fp8_graph = None
        if peer is not None and not dry:
            try:
                fp8_graph = capture([peer.bind(q, w, sl, pt, width) for q, w, pt in draws])
            except Exception as exc:
                entry["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        g.preheat()
        if fp8_graph is not None:
            entry["fp8_ms"].append(replay_ms(fp8_graph, n))
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
                    gr = capture([(lambda q=q, w=w, pt=pt: bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=buf, **c))
                                   for q, w, pt in draws])
                    ms = replay_ms(gr, n)
                    del gr
                entry["configs"].append({"programs": progs, **c, "ms": ms, "err_vs_default": err})
            except Exception as exc:
                entry["configs"].append({"programs": progs, **c, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
        if fp8_graph is not None:
            entry["fp8_ms"].append(replay_ms(fp8_graph, n))
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
        buf = torch.empty((n, n), device=cases.DEV)
        ref = torch.full((n, n), float("nan"), device=cases.DEV)
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
        if cases.DEV == "cuda":
            torch.cuda.empty_cache()
    return out

"""``python -m bench.indexer``: the bf16 indexer kernels against upstream's own fp8 kernels, same page tables,
one run.

One run measures the ceilings (HBM read bandwidth, dense bf16 and fp8 GEMM rates), checks every kernel
against its torch reference (``doctor --selftest`` included; ``checks``) and times, side by side on the same
keys and page tables, this package's bf16 logits kernel and two upstream peers (``peers``): the TileLang fp8
kernel, the pin's default on sm_120, and, with ``--deepgemm``, DeepGEMM, its default on sm_90, for decode and
target-verify (``decode``) and prefill (``prefill``); then the eager host cost (``eager``, ``breakdown``) and the
launch-configuration sweep (``tune``). It writes bench/results/kernels/indexer_h200_<date>.json (or
$OUT_JSON), rewritten after each timed section, so a run cut short keeps what it finished:

    PYTHONPATH=src COMMIT=$(git rev-parse HEAD) python -m bench.indexer --tilelang PATH/tilelang_kernel.py \
        [--deepgemm DEST]   # --deepgemm-warm first compiles its kernels

``--eager-only`` runs only the eager host cost and writes bench/results/indexer_h200_eager_<date>.json (or
$OUT_JSON; ``--eager-repeats N`` sweeps the eager C4 layer's shapes N times and keeps each shape's median sweep
with every sweep's figure beside it); ``--tune-only`` times launch configurations beside upstream's kernel
instead and writes $OUT_JSON;
``--two-stage-only`` times the two-stage selection of long prefill chunks beside single-stage bf16 and upstream's
fp8 kernels (``two_stage``), after ``doctor --selftest``, and writes $OUT_JSON;
``--dry-cpu`` checks the script on the CPU with tiny shapes and no peer (``TRITON_INTERPRET=1``), writing under
/tmp unless $OUT_JSON is set:

    PYTHONPATH=src COMMIT=$(git rev-parse HEAD) python -m bench.indexer --eager-only

On a GPU host set up from the bundle (``. env.sh``), keep its packages first: ``PYTHONPATH=src:$PYTHONPATH``
(``PYTHONPATH=src`` alone times the host image's torch and Triton instead of the pin's).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from pathlib import Path

import torch

from bench import _gpu_common as g
from bench.indexer import breakdown, cases, checks, decode, eager, prefill, tune, two_stage
from bench.indexer.cases import D, DRY_SIZES, PAGE, SIZES
from bench.indexer.paired import row_text
from bench.indexer.peers import (DeepGemmPagedPeer, DeepGemmRaggedPeer, Fp8Peer, deepgemm_info, fp8_pool,
                                 load_deepgemm, load_tilelang, warm_deepgemm, warm_deepgemm_one)
from harness import run_record


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.indexer")
    ap.add_argument("--tilelang", help="upstream's tilelang_kernel.py from the sglang==0.5.23 wheel")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    ap.add_argument("--tune-only", action="store_true", help="only the launch-configuration tuning (its own JSON)")
    ap.add_argument("--tune-decode-only", action="store_true", help="with --tune-only: decode configurations only")
    ap.add_argument("--tune-prefill-only", action="store_true", help="with --tune-only: prefill configurations only")
    ap.add_argument("--two-stage-only", action="store_true",
                    help="only the two-stage selection of long prefill chunks against bf16 and the fp8 peers")
    ap.add_argument("--dry-cpu", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): checks the script")
    ap.add_argument("--eager-only", action="store_true",
                    help="only the eager-vs-graph host-cost table of decode logits (its own JSON, under a minute)")
    ap.add_argument("--eager-repeats", type=int, default=1,
                    help="with --eager-only: sweeps of the eager C4 layer's shapes; each shape's median sweep is kept")
    ap.add_argument("--deepgemm",
                    help="a DeepGEMM build (the folder holding deep_gemm/), as bench/build_deepgemm_device.sh at commit 6f9738b made it")
    ap.add_argument("--deepgemm-warm", action="store_true", help="only JIT-compile DeepGEMM's kernel variants, in parallel")
    ap.add_argument("--deepgemm-warm-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.deepgemm_warm:
        return warm_deepgemm(args.deepgemm)
    if args.deepgemm_warm_one:
        return warm_deepgemm_one(load_deepgemm(args.deepgemm)[0], args.deepgemm_warm_one)
    if args.dry_cpu:
        cases.DEV = "cpu"
        SIZES.update(DRY_SIZES)
        g.dry_run_mode()
    gen = torch.Generator(device=cases.DEV)
    gen.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = g.run_meta()
    print(meta, flush=True)
    if args.eager_only:
        pool = torch.randn((max(SIZES["eager_b"]) * max(SIZES["eager_live"]) // PAGE, PAGE, D), generator=gen,
                           device=cases.DEV).to(torch.bfloat16)
        result = {**meta, "capture_width": SIZES["width"], "eager_host_breakdown": breakdown.host_breakdown(pool, gen),
                  "eager": eager.eager_section(pool, gen),
                  "eager_layer": eager.repeated_layer_section(pool, gen, args.eager_repeats)}
        eager.print_verdict(result)
        date = datetime.date.today().isoformat()
        run_record.write(Path(os.environ.get("OUT_JSON", "/tmp/indexer_eager_dry.json" if args.dry_cpu else
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
    if args.two_stage_only:  # one shared table of the longest context's keys
        pool_pages = 2 * math.ceil(max(SIZES["long_keys"]) / PAGE)
    pool = torch.randn((pool_pages, PAGE, D), generator=gen, device=cases.DEV).to(torch.bfloat16)
    pool8 = fp8_pool(pool) if fn is not None or dg is not None else None
    peer = Fp8Peer(fn, pool8) if fn is not None else None
    paged_peers = ([peer] if peer else []) + ([DeepGemmPagedPeer(dg, pool8)] if dg is not None else [])
    prefill_peers = ([peer] if peer else []) + ([DeepGemmRaggedPeer(dg, pool8)] if dg is not None else [])
    if args.two_stage_only:
        out = Path(os.environ.get("OUT_JSON", "/tmp/indexer_two_stage_dry.json"))
        two_stage.long_prefill_section(prefill_peers, pool, gen,
                                       on_row=lambda rows: run_record.write(out, {**result, "long_prefill": rows}))
        return
    if args.tune_only:
        result["tune"] = tune.tune_section(peer, pool, gen, prefill=not args.tune_decode_only,
                                           decode=not args.tune_prefill_only)
        path = Path(os.environ.get("OUT_JSON", "/tmp/indexer_tune_dry.json"))
        run_record.write(path, result)
        return
    date = datetime.date.today().isoformat()
    default = g.REPO / "bench" / "results" / "kernels" / f"indexer_h200_{date}.json"
    path = Path(os.environ.get("OUT_JSON", "/tmp/indexer_dry.json" if args.dry_cpu else default))
    result["correctness_ragged"] = checks.correctness_ragged(pool, gen)
    print("ragged", result["correctness_ragged"], flush=True)
    result["store_query"] = checks.store_query_section(gen, ceil["hbm_read_gbps"])
    print("store/query", result["store_query"], flush=True)
    # the JSON is rewritten after each timed section, so a run cut short keeps what it finished
    result["decode"] = decode.decode_section(paged_peers, pool, gen, ceil["hbm_read_gbps"])
    run_record.write(path, result)
    result["eager_host_breakdown"] = breakdown.host_breakdown(pool, gen)
    result["eager"] = eager.eager_section(pool, gen)
    eager.print_verdict(result)
    run_record.write(path, result)
    result["target_verify"] = decode.verify_section(paged_peers, pool, gen)
    run_record.write(path, result)
    result["prefill"] = prefill.prefill_section(prefill_peers, pool, gen, ceil["gemm_bf16_tflops"])
    if not args.no_sweep:
        result["sweep"] = tune.sweep_section(pool, gen)
    run_record.write(path, result)
    print("\nTABLE")
    for r in result["decode"] + result["target_verify"] + result["prefill"]:
        print(row_text(r))


if __name__ == "__main__":
    main()

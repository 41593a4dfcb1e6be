"""How fast is our prefill logits kernel against upstream's?

Dense and causal at 8192 and 32768 rows (one request: every row shares its page table), timed with do_bench
(``paired.timed_pair``): milliseconds, TFLOP/s against the measured bf16 GEMM rate, the ratios and the check
against the float64 reference.
"""

from __future__ import annotations

import torch

from bench.indexer import cases
from bench.indexer.cases import D, H, SIZES, case, check_rows
from bench.indexer.paired import RATIO_KEY, row_text, timed_pair


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
            print(row_text(res), flush=True)
            del out, q, w, sl, pt
            if cases.DEV == "cuda":
                torch.cuda.empty_cache()
    return rows_out

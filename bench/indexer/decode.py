"""How fast is our decode and target-verify logits kernel against upstream's, as serving replays it?

Decode B in {1, 8, 64, 256} x live keys in {4k, 32k, 128k}, each at width = live and at the capture width
262144; target-verify (MTP next_n = 2: two rows per request, lengths n - 1 and n, one page table). Each row:
ours and each peer in CUDA graphs (``paired.timed_pair_graph``), the ratios, the check against the float64
reference and the share of the measured HBM read bandwidth each kernel reaches.
"""

from __future__ import annotations

import math

import torch

from bench.indexer import cases
from bench.indexer.cases import D, PAGE, SIZES, check_rows, decode_draws, rotation_count
from bench.indexer.paired import RATIO_KEY, row_text, timed_pair_graph


def _fp8_hbm_fraction(res, name, nbytes, read_gbps):
    return nbytes / (res[f"{name}_ms"] * 1e6) / read_gbps if res.get(f"{name}_ms") else None


def decode_section(peers, pool, gen, read_gbps):
    rows_out = []
    for b in SIZES["decode_b"]:
        for live in SIZES["decode_live"]:
            # one set of draws per (batch, live keys): both widths read the same pages, so only the width differs
            draws = decode_draws(pool, b, live, gen, rotation_count(b, live))
            sl = torch.full((b,), live, dtype=torch.int32, device=cases.DEV)
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
                print(row_text(res), flush=True)
                del out, cut
            del draws
    return rows_out


def verify_section(peers, pool, gen):
    rows_out = []
    for b, live in SIZES["verify"]:
        lens = [n for _ in range(b) for n in (live - 1, live)]  # next_n = 2 draft rows per request
        draws = decode_draws(pool, b, live, gen, rotation_count(b, live), rows_per_req=2)
        sl = torch.as_tensor(lens, dtype=torch.int32, device=cases.DEV)
        for width in sorted({live, SIZES["width"]}):
            cut = [(q, w, pt[:, : math.ceil(width / PAGE)].contiguous()) for q, w, pt in draws]
            res, out = timed_pair_graph(peers, cut, pool, sl, width)
            res.update(shape="target_verify", B=b, next_n=2, rows=2 * b, live=live, width=width)
            q, w, pt = cut[0]
            res["check"] = check_rows(out, q, pool, w, sl, pt, width, [0, 1])
            rows_out.append(res)
            print(row_text(res), flush=True)
            del out, cut
        del draws
    return rows_out

"""How fast is the two-stage selection of a long prefill chunk against single-stage bf16 and upstream's fp8 kernels?

One prefill chunk of ``SIZES["long_rows"]`` query rows at the end of a long context, every row seeing all of
its keys (the chunk that costs most), at the key counts of 16k to 256k-token contexts (``SIZES["long_keys"]``,
compressed by 4). Timed with do_bench in alternating rounds (``paired._time_alternating``), the median of each:

- ``ours``: the single-stage bf16 logits (``bf16_paged_mqa_logits``);
- ``two_stage``: what ``DSV4_SM120_INDEX_K_SELECT=two_stage`` hands upstream's transform
  (``two_stage_paged_mqa_logits``: the fp8 scan, the top 1,024 by it, the bf16 re-score, the -inf fill);
- ``fp8`` / ``deepgemm``: upstream's TileLang and DeepGEMM fp8 logits on the same keys in upstream's fp8 pool.

Each is the work before upstream's top-k transform, which every path then runs alike on logits of the same
shape, so the ratios are of what differs; the transform's own time (``torch.topk`` of 512, the torch
backend's) is recorded beside them for scale. Checks: the rows where two-stage's top 512 equals the bf16
kernel's, the bf16 kernel against the float64 reference on sampled rows, and each peer's agreement with it
(``paired._compare_with_peers``).
"""

from __future__ import annotations

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import D, H, SIZES, TOPK, case, check_rows
from bench.indexer.paired import _bind_peers, _compare_with_peers, _time_alternating
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits
from dsv4_sm120.kernels.two_stage_logits import two_stage_paged_mqa_logits


def _top(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top 512 key indices, ascending (every row here scores all ``logits.shape[1]`` keys)."""
    return torch.topk(logits, min(TOPK, logits.shape[1]), dim=1, sorted=False).indices.sort(dim=1).values


def long_prefill_section(peers, pool, gen, rounds: int = 3, on_row=None) -> list[dict]:
    """One row per key count (module doc); ``on_row(rows so far)`` after each, so a run cut short keeps them."""
    rows_out = []
    rows = SIZES["long_rows"]
    for keys in SIZES["long_keys"]:
        q, w, sl, pt = case(pool.shape[0], rows, [keys] * rows, keys, gen, shared=True)
        exact = torch.empty((rows, keys), dtype=torch.float32, device=cases.DEV)
        bf16_paged_mqa_logits(q, pool, w, sl, pt, keys, out=exact)
        two = torch.full_like(exact, float("nan"))
        two_stage_paged_mqa_logits(q, pool, w, sl, pt, keys, out=two)
        res = {"shape": "long prefill", "rows": rows, "keys": keys, "context_tokens": 4 * keys,
               "flops_scored": 2.0 * rows * keys * H * D}
        calls, outs = _bind_peers(peers, q, w, sl, pt, keys, res)
        scratch = torch.empty_like(exact)
        timers = {"ours": lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, keys, out=scratch),
                  "two_stage": lambda: two_stage_paged_mqa_logits(q, pool, w, sl, pt, keys, out=scratch),
                  "topk_transform": lambda: torch.topk(exact, TOPK, dim=1, sorted=False), **calls}
        g.preheat()
        _time_alternating(res, {k: (lambda fn=fn: g.median_ms(fn, rep=20)) for k, fn in timers.items()}, rounds)
        for name, denominator in (("two_stage_vs_ours", "ours_ms"), *((f"two_stage_vs_{p.name}", f"{p.name}_ms")
                                                                       for p in peers if p.name in calls)):
            res[name] = res["two_stage_ms"] / res[denominator]
        _compare_with_peers(res, exact, outs, peers, sl)
        same = (_top(two) == _top(exact)).all(dim=1)
        res["two_stage_rows_equal_to_bf16"] = f"{int(same.sum())}/{rows}"
        res["check_bf16"] = check_rows(exact, q, pool, w, sl, pt, keys, [0, rows // 2, rows - 1])
        rows_out.append(res)
        print(row_text(res), flush=True)
        if on_row is not None:
            on_row(rows_out)
        del exact, two, scratch, outs, q, w, sl, pt
        if cases.DEV == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def row_text(r: dict) -> str:
    def ms(key):
        return f"{r[key]:.3f}" if r.get(key) else "-"

    def ratio(key):
        return f"{r[key]:.2f}" if r.get(key) else "-"

    return (f"long prefill rows={r['rows']} keys={r['keys']:<6} (context {r['context_tokens'] // 1024}k)  "
            f"bf16 {ms('ours_ms')} ms  two-stage {ms('two_stage_ms')} ms  tilelang {ms('fp8_ms')} ms  "
            f"deepgemm {ms('deepgemm_ms')} ms  top-k {ms('topk_transform_ms')} ms  two-stage/bf16 "
            f"{ratio('two_stage_vs_ours')}  two-stage/deepgemm {ratio('two_stage_vs_deepgemm')}  two-stage/tilelang "
            f"{ratio('two_stage_vs_fp8')}  rows equal {r['two_stage_rows_equal_to_bf16']}")

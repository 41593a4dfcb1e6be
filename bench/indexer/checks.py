"""Are the kernels right where serving takes them?

The logits kernel on ragged lengths (page boundaries, under 512 keys, one key, 64k+ keys) against the float64
reference, its output poisoned with NaN; the key store and query kernels at serving shapes and the dtypes
production feeds, against their references, with their time and share of the HBM read bandwidth.
"""

from __future__ import annotations

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import D, H, PAGE, SIZES, case, check_rows
from dsv4_sm120.kernels.index_k_store import store_index_k_bf16, store_index_k_bf16_ref
from dsv4_sm120.kernels.index_query import index_query_bf16, index_query_bf16_ref
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits


def correctness_ragged(pool, gen):
    """Ragged lengths, page boundaries, < 512 keys, 1 key, 64k+ keys; output poisoned with NaN."""
    max_len = SIZES["ragged_max"]
    lens = [x for x in (1, 63, 64, 65, 100, 511, 512, 513, 4096, 8191, 32768) if x < max_len] + [max_len]
    q, w, sl, pt = case(pool.shape[0], len(lens), lens, max_len, gen)
    out = torch.full((len(lens), max_len), float("nan"), device=cases.DEV)
    bf16_paged_mqa_logits(q, pool, w, sl, pt, max_len, out=out)
    res = check_rows(out, q, pool, w, sl, pt, max_len, list(range(len(lens))))
    res["lens"] = lens
    return res


def err_over_row_rms(out, ref):
    """max |out - ref| / rms(ref row): bf16 rounding of a 128-wide row is ~2^-9 of its rms."""
    o, r = out.float().reshape(-1, D), ref.float().reshape(-1, D)
    rms = r.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    return float(((o - r).abs() / rms).max())


def store_query_section(gen, read_gbps):
    """Store and query kernels at serving shapes and the dtypes production feeds, against float64 references."""
    res = {}
    max_pos = SIZES["max_pos"]
    freqs = torch.polar(torch.ones(max_pos, 32, device=cases.DEV), torch.rand(max_pos, 32, generator=gen, device=cases.DEV) * 6.28)
    n, pool = SIZES["store_n"], SIZES["store_pool"]
    kv = torch.randn((n, D), generator=gen, device=cases.DEV)  # fp32: upstream's compressor output dtype
    nw = 1 + 0.1 * torch.randn(D, generator=gen, device=cases.DEV)  # fp32, as the compressor's norm weight
    slots = torch.randperm(pool * PAGE, generator=gen, device=cases.DEV)[:n]
    pos = torch.randint(0, max_pos, (n,), generator=gen, device=cases.DEV)
    p1 = torch.full((pool, PAGE, D), float("nan"), dtype=torch.bfloat16, device=cases.DEV)
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
    q = torch.randn((t, H, D), generator=gen, device=cases.DEV).to(torch.bfloat16)  # wq_b's bf16 output
    wt = torch.randn(t, H, generator=gen, device=cases.DEV).to(torch.bfloat16)
    pq = torch.randint(0, max_pos, (t,), generator=gen, device=cases.DEV)
    a, wa = index_query_bf16(q, wt, 0.0110485, freqs, pq)
    b, wb = index_query_bf16_ref(q, wt, 0.0110485, freqs, pq)
    res["query_mismatch_frac"] = float((a != b).float().mean())
    res["query_max_err_over_row_rms"] = err_over_row_rms(a, b)
    res["query_weights_equal"] = bool(torch.allclose(wa, wb))
    res["query_ms"] = g.median_ms(lambda: index_query_bf16(q, wt, 0.0110485, freqs, pq))
    res["query_hbm_fraction"] = (2 * q.numel() * 2 + t * 64 * 4) / (res["query_ms"] * 1e6) / read_gbps
    return res

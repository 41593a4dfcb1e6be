"""How many of the C4 indexer's top-512 keys does each key precision keep, at 16k-256k keys a row, and how many
extra candidates would a two-stage indexer (fp8 scan, bf16 re-score) need to select exactly what bf16 keys do?

CPU only, torch emulation, no kernel runs:

    python -m bench.indexer.precision --out bench/results/kernels/index_k_precision_cpu.json \\
        [--lengths 16384,65536,131072,262144] [--rows 64] [--seed 0]

Lengths count compressed keys a row scores (the logits width; the token context is 4x: 262144 keys is a 1M-token
context). Each length's rows are decode-like rows at that depth: every row scores keys [0, L) of one context, each
row its own query and head weights.

Math. For a query row with heads h (64, head dim 128) and key t,

    logit[t] = sum_h w_h * relu(q_h . k_t)

and the indexer keeps the 512 largest (ties: the lower index, here and in every selection below). Keys and queries
are the rotated vectors both upstream and the package store (RMSNorm'd compressed key, RoPE on the last 64 dims,
the 128-point Hadamard rotation); w is weights_proj's bf16 output (signed, no activation) times upstream's
weight_scale = 128^-0.5 * 64^-0.5. The scorers:

- fp64: the rotated fp64 vectors and the bf16 weights in fp64 (the reference).
- bf16 (the package): keys and queries rounded fp64 -> fp32 -> bf16, products and head sum in fp32.
- fp8 (upstream): from the fp32 rotated vectors, one scale per 128-value row, s = max(1e-4, amax) / 448 in fp32,
  x8 = e4m3(clip(x * (1/s), +-448)) (round to nearest even); keys keep s_k per token, a query's s_q (per token and
  head) folds into its weight, w' = (w * weight_scale) * s_q, and the key scale multiplies after the head sum:
  logit[t] = s_k[t] * sum_h w'_h relu(q8_h . k8_t). The fp8 products are exact in fp32 and summed in fp32
  (Hopper's fp8 MMA keeps fewer accumulator bits; over 128 terms that is well under the e4m3 rounding).
- two-stage, margin m: stage 1 is the fp8 recipe applied to the bf16 keys and queries (what a pool that keeps bf16
  keys could derive); it keeps its best 512 + m keys a row; stage 2 takes the bf16 scorer's logits of those
  candidates and keeps the best 512. Stage 2 reads the bf16 logits rather than recomputing them, i.e. it assumes a
  re-scoring kernel that computes a key's score bit for bit as the single-stage kernel does; the measure is then
  whether stage 1's candidates hold the bf16 selection. ``m_needed`` of a row is the smallest margin that does:
  (the worst stage-1 rank of a bf16-selected key) + 1 - 512.

Metrics per (generator, length, scorer): recall = |selected & fp64 selected| / 512 per row, as mean, 1st percentile
and worst row; ``equal_to_bf16`` = the fraction of rows whose selection is exactly the bf16 scorer's. The rows of
one length share one context (one draw of keys per generator and seed, its prefixes for the shorter lengths), so
they are not independent samples: contexts differ, and another seed shows by how much. Under 1000 rows a fraction
of at least 99.9% means every row.

Generators (neither is a forward of the model: no trained weights, no real activations; the queries are random
directions, so the keys near rank 512 are separated only by the margins of random projections):

- ``heavy_tailed``: i.i.d. keys, entries Student-t(3) times per-channel log-normal scales (sigma 0.75) with a few
  outlier channels (x8), then RMSNorm (the norm weight folded into the scales) and the Hadamard rotation. Queries:
  Student-t(3) entries times per-(head, channel) log-normal scales, the same outlier channels, rounded to bf16
  (wq_b's output), rotated. Head weights N(0, 1) times a per-head log-normal scale (sigma 0.5), bf16.
- ``drifting``: as above, but half of each key's variance is a mean-reverting random walk over positions (AR(1),
  correlation length 128 keys), so nearby keys correlate; RoPE (theta 40000, upstream's compress_rope_theta default)
  at the key's token position 4t and the query's 4L; a query's heads of positive weight also carry the walk's state
  at its depth, so recent keys score higher (a recency bias: at 64k keys about 8% of the top 512 lie in the last
  512 keys, ten times their share).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import scipy.signal
import torch

from bench.indexer.cases import D, H, TOPK
from dsv4_sm120.kernels._common import hadamard_matrix
from dsv4_sm120.kernels.two_stage_logits import quantize_fp8_ref
from harness import run_record

F64 = torch.float64
WEIGHT_SCALE = D**-0.5 * H**-0.5  # upstream's Indexer.weight_scale: softmax_scale * n_heads^-0.5
MARGINS = (0, 64, 128, 256, 512)
ROPE_DIM = 64
COMPRESS_RATIO = 4
LENGTHS = (16384, 65536, 131072, 262144)
EQUAL_TARGET = 0.999


@dataclasses.dataclass(frozen=True)
class Generator:
    name: str
    t_dof: int = 3
    channel_sigma: float = 0.75
    outlier_channels: int = 4
    outlier_gain: float = 8.0
    head_weight_sigma: float = 0.5
    drift_share: float = 0.0  # share of a key's variance from the random walk
    drift_keys: float = 128.0  # the walk's correlation length, in keys
    recency_gain: float = 0.0  # weight of the walk state at its depth in the queries of positive-weight heads
    rope_theta: float | None = None


GENERATORS = {g.name: g for g in (
    Generator("heavy_tailed"),
    Generator("drifting", drift_share=0.5, recency_gain=1.0, rope_theta=40000.0),
)}


def student_t(shape, dof: int, gen) -> torch.Tensor:
    """Student-t(dof) draws scaled to unit variance."""
    z = torch.randn(shape, generator=gen, dtype=F64)
    chi2 = torch.randn((dof, *shape), generator=gen, dtype=F64).pow(2).sum(0)
    return z / (chi2 / dof).sqrt() / math.sqrt(dof / (dof - 2))


def random_walk(n: int, corr_keys: float, gen) -> torch.Tensor:
    """Stationary AR(1) per channel, unit variance, x_t = rho x_(t-1) + sqrt(1 - rho^2) e_t, rho = exp(-1/corr)."""
    rho = math.exp(-1.0 / corr_keys)
    e = torch.randn((n, D), generator=gen, dtype=F64).numpy()
    zi = rho * torch.randn((1, D), generator=gen, dtype=F64).numpy()
    return torch.from_numpy(scipy.signal.lfilter([math.sqrt(1 - rho * rho)], [1.0, -rho], e, axis=0, zi=zi)[0])


def rope_tail(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Interleaved (re, im) RoPE on the last 64 dims; positions broadcast against x[..., 0]."""
    inv_freq = theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=F64) / ROPE_DIM)
    ang = positions.to(F64)[..., None] * inv_freq
    cos, sin = ang.cos(), ang.sin()
    re, im = x[..., -ROPE_DIM::2], x[..., -ROPE_DIM + 1::2]
    tail = torch.stack((re * cos - im * sin, re * sin + im * cos), -1).flatten(-2)
    return torch.cat((x[..., :-ROPE_DIM], tail), -1)


class Draw:
    """One context of ``n`` keys and the channel scales its queries share, rotated, fp64."""

    def __init__(self, g: Generator, n: int, gen, chunk: int = 65536):
        self.g, self.gen = g, gen
        outliers = torch.randperm(D, generator=gen)[: g.outlier_channels]
        self.key_scale = torch.exp(g.channel_sigma * torch.randn(D, generator=gen, dtype=F64))
        self.query_scale = torch.exp(g.channel_sigma * torch.randn((H, D), generator=gen, dtype=F64))
        self.key_scale[outliers] *= g.outlier_gain
        self.query_scale[:, outliers] *= g.outlier_gain
        self.head_scale = torch.exp(g.head_weight_sigma * torch.randn(H, generator=gen, dtype=F64))
        self.hadamard = hadamard_matrix(D, F64)
        walk = random_walk(n, g.drift_keys, gen) if g.drift_share else None
        self.walk = walk
        self.keys = torch.empty((n, D), dtype=F64)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            x = student_t((c1 - c0, D), g.t_dof, gen)
            if walk is not None:
                x = math.sqrt(1 - g.drift_share) * x + math.sqrt(g.drift_share) * walk[c0:c1]
            x = x * self.key_scale
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # the compressor's RMSNorm
            if g.rope_theta:
                x = rope_tail(x, COMPRESS_RATIO * torch.arange(c0, c1), g.rope_theta)
            self.keys[c0:c1] = x @ self.hadamard

    def queries(self, rows: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated fp64 queries [rows, H, D] at ``depth`` keys, and bf16 head weights [rows, H] (as fp32)."""
        g = self.g
        w = (torch.randn((rows, H), generator=self.gen, dtype=F64) * self.head_scale).to(torch.bfloat16).float()
        x = student_t((rows, H, D), g.t_dof, self.gen)
        if self.walk is not None and g.recency_gain:  # the heads of positive weight look at recent keys
            x = x + g.recency_gain * (w > 0)[..., None] * self.walk[depth - 1]
        x = (x * self.query_scale).to(torch.bfloat16).to(F64)  # wq_b's bf16 output
        if g.rope_theta:
            x = rope_tail(x, torch.full((rows, 1), COMPRESS_RATIO * depth), g.rope_theta)
        return x @ self.hadamard, w


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32 (the rotation's registers) -> bf16, returned as fp32."""
    return x.float().to(torch.bfloat16).float()


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's per-row e4m3 quantization of fp32 rows of 128 (the two-stage kernel's reference of it): (e4m3
    values as fp32, fp32 scale per row)."""
    q, scale = quantize_fp8_ref(x)
    return q.float(), scale


def logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_scale: torch.Tensor | None = None,
           chunk: int = 4096) -> torch.Tensor:
    """sum_h w[r, h] relu(q[r, h] . k[t]) (times k_scale[t] after the head sum), in q's dtype, chunked over keys."""
    rows, n = q.shape[0], k.shape[0]
    flat, out = q.reshape(rows * H, D), torch.empty((rows, n), dtype=q.dtype)
    for c0 in range(0, n, chunk):
        s = (flat @ k[c0:c0 + chunk].T).clamp_min_(0).view(rows, H, -1)
        out[:, c0:c0 + chunk] = torch.bmm(w[:, None, :].to(q.dtype), s)[:, 0]
        if k_scale is not None:
            out[:, c0:c0 + chunk] *= k_scale[c0:c0 + chunk]
    return out


def descending(scores: torch.Tensor) -> torch.Tensor:
    """Each row's key indices by score, highest first, ties by the lower index."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def top_k(scores: torch.Tensor, k: int = TOPK) -> torch.Tensor:
    return descending(scores)[:, :k]


def two_stage(stage1: torch.Tensor, rescored: torch.Tensor, margins=MARGINS, k: int = TOPK,
              rescore: bool = True) -> dict[int, torch.Tensor]:
    """Per margin m: the best k + m keys by ``stage1``, of which the best k by ``rescored`` (the stage-1 scores
    again with ``rescore=False``: stage 2 skipped, the planted fault of the tests)."""
    order, out = descending(stage1), {}
    for m in margins:
        cand = order[:, :k + m].sort(dim=1).values  # index order, so ties break as in top_k
        score = (rescored if rescore else stage1).gather(1, cand)
        out[m] = cand.gather(1, descending(score)[:, :k])
    return out


def margin_needed(stage1: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest m whose 512 + m stage-1 candidates hold every key of ``selected``."""
    order = descending(stage1)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
    return (rank.gather(1, selected).amax(1) + 1 - selected.shape[1]).clamp_min(0)


def recall(selected: torch.Tensor, reference: torch.Tensor, n: int) -> torch.Tensor:
    """|selected & reference| / k per row."""
    mask = torch.zeros((selected.shape[0], n), dtype=torch.bool).scatter_(1, reference, True)
    return mask.gather(1, selected).double().mean(1)


def same_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(1)


def row_stats(per_row: torch.Tensor) -> dict:
    return {"mean": float(per_row.mean()), "p1": float(torch.quantile(per_row, 0.01)), "worst": float(per_row.min())}


def score_all(draw: Draw, rows: int, depth: int) -> dict[str, torch.Tensor]:
    """The logits of every scorer for ``rows`` fresh query rows at ``depth`` keys of ``draw``."""
    q, w = draw.queries(rows, depth)
    k = draw.keys[:depth]
    w32 = w * WEIGHT_SCALE
    k16, q16 = to_bf16(k), to_bf16(q)
    k8, k8_scale = quantize_fp8(k.float())
    q8, q8_scale = quantize_fp8(q.float())
    k8b, k8b_scale = quantize_fp8(k16)
    q8b, q8b_scale = quantize_fp8(q16)
    return {"fp64": logits(q, k, w.double() * WEIGHT_SCALE),
            "bf16": logits(q16, k16, w32),
            "fp8": logits(q8, k8, w32 * q8_scale, k8_scale),
            "stage1_fp8_from_bf16": logits(q8b, k8b, w32 * q8b_scale, k8b_scale)}


def measure(draw: Draw, rows: int, depth: int) -> tuple[list[dict], dict]:
    """Table rows for one (generator, length), and its margin figures."""
    t0 = time.perf_counter()
    s = score_all(draw, rows, depth)
    ref, bf16 = top_k(s["fp64"]), top_k(s["bf16"])
    chosen = {name: top_k(s[name]) for name in ("fp64", "bf16", "fp8")}
    chosen.update({f"two_stage m={m}": sel for m, sel in two_stage(s["stage1_fp8_from_bf16"], s["bf16"]).items()})
    table = []
    for name, sel in chosen.items():
        r = row_stats(recall(sel, ref, depth))
        table.append({"generator": draw.g.name, "keys": depth, "scorer": name, "recall_mean": r["mean"],
                      "recall_p1": r["p1"], "recall_worst": r["worst"],
                      "equal_to_bf16": float(same_rows(sel, bf16).double().mean())})
    need = margin_needed(s["stage1_fp8_from_bf16"], bf16).double()
    extra = {"generator": draw.g.name, "keys": depth, "rows": rows,
             "m_needed": {"max": int(need.max()), "p99": float(torch.quantile(need, 0.99)),
                          "median": float(need.median())},
             "seconds": round(time.perf_counter() - t0, 1)}
    return table, extra


def smallest_margin(table: list[dict]) -> int | None:
    """The smallest margin with at least EQUAL_TARGET of rows equal to bf16 in every (generator, length)."""
    for m in MARGINS:
        if all(r["equal_to_bf16"] >= EQUAL_TARGET for r in table if r["scorer"] == f"two_stage m={m}"):
            return m
    return None


def markdown(table: list[dict]) -> str:
    lines = ["| generator | keys | scorer | recall mean | recall p1 | worst row | rows = bf16 |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['generator']} | {r['keys']} | {r['scorer']} | {r['recall_mean']:.4f} | {r['recall_p1']:.4f} | "
              f"{r['recall_worst']:.4f} | {r['equal_to_bf16']:.3f} |" for r in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.indexer.precision", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the JSON record (printed only without it)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="keys a row scores, comma-separated")
    ap.add_argument("--rows", type=int, default=64, help="query rows per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generators", default=",".join(GENERATORS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    t0 = time.perf_counter()
    table, margins = [], []
    for gi, name in enumerate(args.generators.split(",")):
        gen = torch.Generator().manual_seed(args.seed * 1000 + gi)
        draw = Draw(GENERATORS[name], lengths[-1], gen)
        for depth in lengths:
            rows, extra = measure(draw, args.rows, depth)
            table += rows
            margins.append(extra)
            print(f"{name} {depth} keys: m_needed {extra['m_needed']}, {extra['seconds']} s", flush=True)
    record = {
        "date": run_record.now_utc(), "commit": run_record.commit(), "host": "cpu", "torch": torch.__version__,
        "command": "python -m bench.indexer.precision " + " ".join(sys.argv[1:] if argv is None else argv),
        "seconds": round(time.perf_counter() - t0, 1),
        "params": {"rows": args.rows, "seed": args.seed, "lengths_keys": lengths, "topk": TOPK, "heads": H,
                   "head_dim": D, "weight_scale": WEIGHT_SCALE, "margins": list(MARGINS),
                   "generators": [dataclasses.asdict(GENERATORS[n]) for n in args.generators.split(",")]},
        "method": __doc__,
        "table": table, "margins": margins,
        "smallest_margin_equal_999": smallest_margin(table),
    }
    print(markdown(table))
    print(f"smallest margin with >= {EQUAL_TARGET:.1%} of rows equal to bf16 everywhere: "
          f"{record['smallest_margin_equal_999']}; {record['seconds']} s")
    run_record.write(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

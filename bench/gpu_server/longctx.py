"""``longctx``: what bf16 index keys cost against upstream's fp8 indexers at long context, prefill and decode.

Servers. The package with bf16 keys (``--model-impl dsv4``; ``dsv4_two_stage``: long prefill chunks selected in
two stages, ``DSV4_SM120_INDEX_K_SELECT=two_stage``) against upstream (``--model-impl sglang``) with each of its
production fp8 indexer kernels, TileLang (sm_120's default) and DeepGEMM (sm_90's), as the ``cost`` set has
them; ``DSV4_GPU_LONGCTX_SERVERS`` names which run (:func:`server_names`), on the model named by ``DSV4_GPU_LONGCTX_MODEL`` (default ``flash12``; ``flash_share``
is Flash's per-layer proportions with as many layers as three servers' bf16 weights fit on one 80 GB GPU,
``harness/dsv4_checkpoints.py`` says what it cuts and why). Each is sized for the longest point: context
``CONTEXT_LENGTH`` (256k tokens and the decode tails), a pool of ``MAX_TOTAL_TOKENS`` (one 256k request plus
32 decode tails), chunked prefill of 16384 tokens (``DSV4_GPU_LONGCTX_CHUNK``: a C4 layer's logits of one chunk
at 256k are chunk x 64k fp32 values, 4 GiB at 16384, and each server's allocator keeps its peak; 8192 halves
that where three servers' peaks do not fit beside their weights).

Points. Cache-cold prefill of 16k to 256k tokens: each visit a fresh random prompt (nothing cached), one new
token; timed by the client (time to the answer, the first token) and from sglang's own ``Prefill batch``
lines (:func:`visit_prefill_ms`). Decode at depths 16k to 256k with 1, 8 and 32 requests: the depth's
prefix cached once per server, then each request its own ``TAIL`` tokens; the step read off the client's
stream and from sglang's decode log (``step_log.py``), as ``cost`` does. ``DSV4_GPU_LONGCTX_PREFILL``,
``DSV4_GPU_LONGCTX_DECODE`` (depths, or ``BxD`` points), ``DSV4_GPU_LONGCTX_BATCHES`` and
``DSV4_GPU_LONGCTX_ROUNDS`` cut the lists for a short GPU window (:func:`points`); ``64k`` is 65536.

Order and statistics. Every shape once on every server, untimed (a cold JIT cache compiles on a shape's
first request); then ``ROUNDS`` rounds a point, the three servers visited in ``scenarios._visit_order``'s
ABBA-balanced order. A server's figure is the median of its visits; the package's figure over each
upstream's is the ratio of the two medians with a bootstrap 95% interval (``agents.medians_ratio``: each
server's visits resampled on their own). The issue's bars: prefill at most ``BARS["prefill"]`` (1.03) of
DeepGEMM's at every length, the decode step at most ``BARS["decode"]`` (1.02) at every depth and batch.
Each row says whether its bar is shown (the interval's top at or under it), failed (its bottom over it)
or not shown (the interval crosses it); the same verdict is given against TileLang.

The analytic share (:func:`indexer_share`) beside each point: the FLOPs share of the C4 indexer's scoring
for the full DeepSeek-V4-Flash and for the model served, which tells how much of a measured difference the
indexer can account for at that length.

Not here: the MTP target-verify rows and the HiCache-restore row.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

from bench.gpu_server import step_log, traffic
from bench.gpu_server.agents import medians_ratio
from bench.gpu_server.scenarios import _spread, _visit_order, warm_every_shape
from bench.gpu_server.servers import ServerSpec
from harness import dsv4_checkpoints

K = 1024
PREFILL_LENGTHS = [16 * K, 32 * K, 64 * K, 128 * K, 256 * K]
DECODE_DEPTHS = [16 * K, 64 * K, 128 * K, 256 * K]
DECODE_BATCHES = [1, 8, 32]
ROUNDS = 5
TAIL = 32  # each decode request: the depth's cached prefix plus a tail of its own
DECODE_SHORT, DECODE_STEPS = 8, 64  # the client's step: from each request's 8th token over the next 64
DECODE_LOG_INTERVAL = 8  # sglang's decode line every 8 steps: 8 clean windows a visit (step_log.py)
CONTEXT_LENGTH = 256 * K + 8 * K  # the 256k prefill and the 256k depth with its decode tokens
MAX_TOTAL_TOKENS = 256 * K + 32 * K  # one 256k request, and at 256k depth 32 tails of 104 tokens
CHUNKED_PREFILL = 16384
BARS = {"prefill": 1.03, "decode": 1.02}
BAR_BASE = "sglang_deepgemm"  # the bars are the issue's, against DeepGEMM's fp8 indexer
# the package's servers: bf16 keys with exact selection, and with long prefill chunks selected in two stages
PACKAGE = {"dsv4_bf16": {}, "dsv4_two_stage": {"DSV4_SM120_INDEX_K_SELECT": "two_stage"}}
OURS, BASES = tuple(PACKAGE), ("sglang_tilelang", "sglang_deepgemm")
# which servers run (DSV4_GPU_LONGCTX_SERVERS): the default three fit one 80 GB GPU with flash_share; four need
# more memory, or a shorter list (e.g. dsv4_bf16,dsv4_two_stage,sglang_deepgemm)
DEFAULT_SERVERS = ("dsv4_bf16", "sglang_tilelang", "sglang_deepgemm")
MARKER_TOKENS = 16  # the short request after each prefill visit whose log line closes the visit's last chunk


def model() -> str:
    return os.environ.get("DSV4_GPU_LONGCTX_MODEL", "flash12")


def server_names(env=None) -> list[str]:
    """The servers of this run, from ``DSV4_GPU_LONGCTX_SERVERS`` (default :data:`DEFAULT_SERVERS`)."""
    env = os.environ if env is None else env
    names = [x.strip() for x in env.get("DSV4_GPU_LONGCTX_SERVERS", "").split(",") if x.strip()] or list(DEFAULT_SERVERS)
    unknown = [n for n in names if n not in (*OURS, *BASES)]
    if unknown or not any(n in OURS for n in names) or not any(n in BASES for n in names):
        raise ValueError(f"DSV4_GPU_LONGCTX_SERVERS={','.join(names)}: name at least one of {list(OURS)} and one of "
                         f"{list(BASES)}, nothing else")
    return names


def specs() -> list[ServerSpec]:
    """The servers of :func:`server_names` on ``model()``, each sized for the 256k point. They share the GPU: the KV
    budget of one is what is free when it profiles minus (1 - share) x what was free when it started, so the
    share must leave room for the others' weights (``flash_share``'s three take 48 GB of 80); the pools are
    capped by ``--max-total-tokens`` either way. Half the pool for the sliding-window layers, as ``cost``."""
    chunk = int(os.environ.get("DSV4_GPU_LONGCTX_CHUNK", CHUNKED_PREFILL))
    common = dict(mem_fraction=0.75, max_total_tokens=MAX_TOTAL_TOKENS, context_length=CONTEXT_LENGTH,
                  chunked_prefill=chunk, graph_batches=tuple(DECODE_BATCHES),
                  extra_args=["--swa-full-tokens-ratio", "0.5", "--decode-log-interval", str(DECODE_LOG_INTERVAL)])
    name = model()
    return [ServerSpec(n, name, "dsv4", extra_env=PACKAGE[n], **common) if n in PACKAGE
            else ServerSpec(n, name, "sglang", upstream_indexer=n.removeprefix("sglang_"), **common)
            for n in server_names()]


def _tokens(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * K if text.endswith("k") else int(text)


def points(env=None) -> dict:
    """The prefill lengths, the decode (batch, depth) points (the deepest first) and the rounds, from the
    defaults or the ``DSV4_GPU_LONGCTX_*`` variables of ``env`` (default: the process's)."""
    env = os.environ if env is None else env
    prefill = [_tokens(x) for x in env.get("DSV4_GPU_LONGCTX_PREFILL", "").split(",") if x.strip()] or PREFILL_LENGTHS
    batches = [int(x) for x in env.get("DSV4_GPU_LONGCTX_BATCHES", "").split(",") if x.strip()] or DECODE_BATCHES
    decode = []
    for item in [x.strip() for x in env.get("DSV4_GPU_LONGCTX_DECODE", "").split(",") if x.strip()] or DECODE_DEPTHS:
        if isinstance(item, str) and "x" in item:
            b, d = item.split("x")
            decode.append((int(b), _tokens(d)))
        else:
            decode += [(b, _tokens(str(item))) for b in batches]
    rounds = int(env.get("DSV4_GPU_LONGCTX_ROUNDS", ROUNDS))
    if rounds < 2:
        raise ValueError("DSV4_GPU_LONGCTX_ROUNDS must be 2 or more: a median of one visit has no interval")
    too_long = [n for n in prefill + [d + DECODE_SHORT + DECODE_STEPS for _, d in decode] if n + 1 > CONTEXT_LENGTH]
    if too_long:
        raise ValueError(f"points past the context length {CONTEXT_LENGTH}: {too_long}")
    decode.sort(key=lambda p: (-p[1], p[0]))
    return {"prefill": prefill, "decode": decode, "rounds": rounds}


# --- the analytic share -----------------------------------------------------------------------------------


def _row_flops(cfg: dict, t, last_row_logits: bool = True) -> tuple:
    """(indexer scoring FLOPs, all FLOPs) of query rows at positions ``t`` (a numpy array; a row at position
    t attends over tokens 1..t), summed over the rows and the layers; ``:func:`indexer_share`` states them."""
    t = np.asarray(t, dtype=np.float64)
    h, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ih, idim, topk, window = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"], cfg["window_size"]
    active = (cfg["num_experts_per_tok"] + cfg["n_shared_experts"]) * 3 * h * cfg["moe_intermediate_size"]
    routed_all = (cfg["n_routed_experts"] + cfg["n_shared_experts"]) * 3 * h * cfg["moe_intermediate_size"]
    rows = float(t.size)
    scoring = total = 0.0
    swa = np.minimum(t, window)
    for ratio in cfg["compress_ratios"][: cfg["num_hidden_layers"]]:
        projections = dsv4_checkpoints.layer_params(cfg, ratio) - routed_all  # attention, compressor, indexer, router
        keys = swa + (np.minimum(topk, np.floor(t / 4)) if ratio == 4 else np.floor(t / 128) if ratio == 128 else 0)
        layer = rows * 2 * (projections + active) + heads * 2 * (hd + hd) * keys.sum()
        if ratio == 4:
            score = 2 * ih * idim * np.floor(t / 4).sum()
            scoring += score
            layer += score
        total += layer
    total += 2 * h * cfg["vocab_size"] * (1 if last_row_logits else rows)
    return scoring, total


def indexer_share(cfg: dict, tokens: int, kind: str) -> float:
    """The FLOPs share of the C4 indexer's scoring in a prefill of ``tokens`` (``kind`` "prefill") or in one
    decode step at depth ``tokens`` ("decode"), for the config ``cfg``.

    A query row at position t (it sees tokens 1..t), in each layer (2 FLOPs a multiply-add):

    - projections and MoE: 2 x (the layer's attention, compressor, indexer and router parameters plus the
      active experts' (top-k + shared) x 3 x hidden x moe_intermediate), as ``dsv4_checkpoints.layer_params``
      counts them;
    - attention: heads x 2 x (head_dim + head_dim) x its keys, the window min(t, 128) plus, in a C4 layer,
      min(top-k, t/4) selected compressed keys, in a C128 layer all t/128 of them;
    - the indexer's scoring, C4 layers only: index_heads x 2 x index_head_dim x t/4, every compressed key
      scored for every head of the row (the share this returns, over the sum of all three and the head).

    A prefill of L tokens sums its rows t = 1..L (the indexer's part grows as L^2 / 8, attention's as L x 512
    at most) and computes the head's logits (2 x hidden x vocab) for its last row only; a decode step is the
    one row t = L with its logits. Top-k selection, norms, the hyper-connection mixes and softmax are not
    counted."""
    cfg = {**dsv4_checkpoints._COMMON, **cfg}
    if kind == "prefill":
        scoring, total = _row_flops(cfg, np.arange(1, tokens + 1))
    elif kind == "decode":
        scoring, total = _row_flops(cfg, np.array([tokens]))
    else:
        raise ValueError(kind)
    return float(scoring / total)


def analytic_shares(prefill: list[int], decode: list[tuple[int, int]], served: str) -> dict:
    """{point: {"full": Flash's share, "served": the served model's}} for every point (a decode step's share
    does not depend on the batch: every FLOP counted is per request)."""
    full, ours = dsv4_checkpoints.FLASH, dsv4_checkpoints.config(served)
    out = {}
    for n in prefill:
        out[f"prefill {n}"] = {"full": round(indexer_share(full, n, "prefill"), 4),
                               "served": round(indexer_share(ours, n, "prefill"), 4)}
    for b, d in decode:
        out[f"decode {b}x{d}"] = {"full": round(indexer_share(full, d, "decode"), 4),
                                  "served": round(indexer_share(ours, d, "decode"), 4)}
    return out


# --- the server's prefill ---------------------------------------------------------------------------------


def visit_prefill_ms(log_text: str) -> float | None:
    """A prefill visit's time by sglang's own ``Prefill batch`` lines (``step_log.PREFILL``), the log written
    during the visit and the marker request that follows it. Each line's new tokens over its input
    throughput is the time since the line before; the first line's reaches back before the visit, so the
    visit is the sum over the others: from the scheduler taking the prompt's first chunk to taking the marker,
    every chunk's forward and the answer's way back. None: fewer than two lines."""
    gaps = [int(n) / float(thr) for _, n, _, _, thr in step_log.PREFILL.findall(log_text) if float(thr) > 0]
    return round(1e3 * sum(gaps[1:]), 3) if len(gaps) >= 2 else None


# --- the run ----------------------------------------------------------------------------------------------


def verdict(interval: dict, bar: float) -> str:
    """Whether a ratio's interval shows its bar: "shown" (its top at or under the bar), "failed" (its bottom
    over it), "not shown" (it crosses the bar), "no figure" (no ratio)."""
    if not interval or interval.get("ratio") is None:
        return "no figure"
    if interval["high"] <= bar:
        return "shown"
    return "failed" if interval["low"] > bar else "not shown"


def ratio_rows(prefill: dict, decode: dict, shares: dict | None = None) -> dict:
    """Per point and upstream server, the ratio of the package's median to upstream's with its bootstrap
    interval, by the client and by the server, each with its bar's verdict; with ``shares``
    (:func:`analytic_shares`), the point's analytic indexer share beside it."""
    out: dict = {}
    for kind, table in (("prefill", prefill), ("decode", decode)):
        for point, per_server in table.items():
            for ours, base in [(o, b) for o in OURS for b in BASES if o in per_server and b in per_server]:
                row = {"bar": BARS[kind], "bar_of_the_issue": base == BAR_BASE}
                if shares and f"{kind} {point}" in shares:
                    row["analytic_indexer_share"] = shares[f"{kind} {point}"]
                for measure, key in (("client", "visits_ms"), ("server", "server_visits_ms")):
                    r = medians_ratio(per_server[ours][key], per_server[base][key])
                    row[measure] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                    row[f"{measure}_verdict"] = verdict(r, BARS[kind])
                out.setdefault(f"{kind} {point}", {})[f"{ours}/{base}"] = row
    return out


def bars(ratio_table: dict, ours: str = OURS[0]) -> dict:
    """The issue's bars over every row of the package's server ``ours`` against ``BAR_BASE``: the rows per
    verdict, by the client's figures and the server's."""
    out: dict = {}
    for point, per_base in ratio_table.items():
        row = per_base.get(f"{ours}/{BAR_BASE}")
        if row:
            for measure in ("client", "server"):
                out.setdefault(measure, {}).setdefault(row[f"{measure}_verdict"], []).append(point)
    return out


def _figure(values: list) -> dict:
    vals = [v for v in values if v is not None]
    return {"median": round(statistics.median(vals), 4) if vals else None, "spread": _spread(values)}


def run(servers: dict, logs: dict | None = None, work_dir=None, out: dict | None = None) -> dict:
    """Every point of :func:`points` on the started servers (name -> url; ``logs``: name -> callable giving the
    server's log, None: no server-side figures). ``out`` is filled as figures come in (a run stopped early
    keeps what it measured)."""
    pts = points()
    name = model()
    cfg = dsv4_checkpoints.config(name)
    vocab = cfg["vocab_size"]
    names = list(servers)
    result = out if out is not None else {}
    result.update({"model": name,
                   "points": {"prefill": pts["prefill"], "decode": [f"{b}x{d}" for b, d in pts["decode"]]},
                   "rounds": pts["rounds"], "bars": {**BARS, "against": BAR_BASE}})
    result["analytic_indexer_share"] = analytic_shares(pts["prefill"], pts["decode"], name)
    prefill, decode = result.setdefault("prefill", {}), result.setdefault("decode", {})
    order = result.setdefault("visit_order", {})

    def log_len(n):
        return len(logs[n]()) if logs else None

    def log_since(n, at):
        return logs[n]()[at:] if logs else ""

    depths = sorted({d for _, d in pts["decode"]}, reverse=True)
    prefixes = {d: traffic.prompt(70000 + d, d - TAIL, vocab) for d in depths}
    result["first_ms"] = warm_every_shape(servers, prefixes, vocab, pts["prefill"], [])
    for i, length in enumerate(pts["prefill"]):
        client, server = {n: [] for n in names}, {n: [] for n in names}
        for rnd in range(pts["rounds"]):
            order[f"prefill {length} round {rnd}"] = now = _visit_order(names, f"prefill {length}", rnd)
            for v, n in enumerate(now):  # a fresh prompt each visit: nothing cached
                at = log_len(n)
                seed = 50000 + 1000 * i + 10 * rnd + v
                t, _ = traffic.generate(servers[n], [traffic.prompt(seed, length, vocab)], 1)
                traffic.generate(servers[n], [traffic.prompt(seed + 5, MARKER_TOKENS, vocab)], 1)
                client[n].append(round(t * 1e3, 3))
                server[n].append(visit_prefill_ms(log_since(n, at)) if logs else None)
        prefill[str(length)] = {n: {"ttft_ms": _figure(client[n]), "visits_ms": client[n],
                                    "server_ms": _figure(server[n]), "server_visits_ms": server[n]} for n in names}
        result["ratios"] = ratio_rows(prefill, decode, result["analytic_indexer_share"])
    for depth in depths:  # the depth's prefix cached once per server, then its points
        for n in names:
            traffic.generate(servers[n], [prefixes[depth] + traffic.prompt(1, TAIL, vocab)], 1)
        at_depth = [(b, d) for b, d in pts["decode"] if d == depth]
        for name_, shapes in warm_every_shape(servers, prefixes, vocab, [], at_depth,
                                              DECODE_SHORT + DECODE_STEPS).items():
            result["first_ms"][name_].update(shapes)
        for batch, _ in at_depth:
            point = f"{batch}x{depth}"
            client, server = {n: [] for n in names}, {n: [] for n in names}
            for rnd in range(pts["rounds"]):
                order[f"decode {point} round {rnd}"] = now = _visit_order(names, f"decode {point}", rnd)
                for v, n in enumerate(now):
                    seed = 3_000_000 + 100_000 * batch + 100 * rnd + v  # each visit's tails its own
                    ids = traffic.prompts(seed, batch, depth, vocab, prefix=prefixes[depth])
                    at = log_len(n)
                    _, arrivals = traffic.stream_token_times(servers[n], ids, DECODE_SHORT + DECODE_STEPS)
                    client[n].append(round(traffic.step_seconds(arrivals, DECODE_SHORT) * 1e3, 4))
                    server[n].append(step_log.visit_step_ms(log_since(n, at), batch) if logs else None)
            decode[point] = {n: {"step_ms": _figure(client[n]), "visits_ms": client[n],
                                 "server_step_ms": _figure(server[n]), "server_visits_ms": server[n]} for n in names}
            result["ratios"] = ratio_rows(prefill, decode, result["analytic_indexer_share"])
    result["ratios"] = ratio_rows(prefill, decode, result["analytic_indexer_share"])
    result["bar_verdicts"] = {ours: bars(result["ratios"], ours) for ours in OURS if ours in names}
    return result

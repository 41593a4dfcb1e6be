"""The ``restore`` set: how long a returning long session waits for its first token when its prefix is on host.

An agent's session goes quiet, other sessions take the device pool, and it comes back with one more turn. With
HiCache its prefix is loaded back from host memory instead of recomputed. Servers, each with a device pool of
one session and its turn plus :data:`POOL_MARGIN` tokens, on ``DSV4_GPU_RESTORE_MODEL`` (default ``flash12``):

- ``restore_bf16``: the package, bf16 index keys, HiCache (``kernel`` io, ``layer_first``; a host pool
  :data:`HOST_RATIO` x the device pool);
- ``restore_fp8``: upstream as it ships (``--model-impl sglang``, DeepGEMM's fp8 indexer), the same HiCache;
- ``recompute_bf16``: the package without HiCache: the returning prefix is computed again (what HiCache saves).

A visit, on one server: session A's prompt of :data:`SESSION_TOKENS` tokens (one new token), then a filler of
the same length (all but the margin of A's pages leave the device; with HiCache they were backed up to host),
then A again with a
turn of :data:`TURN_TOKENS` more tokens: its time to the first token by the client, and sglang's
``cached_tokens`` for it (the prefix found in a cache, device or host). Fresh random tokens every visit, so
nothing of an earlier visit is found. :data:`ROUNDS` rounds, the servers visited in ``scenarios._visit_order``'s
ABBA-balanced order; each server's figure the median of its visits, ratios of medians with a bootstrap 95%
interval (``agents.medians_ratio``). ``DSV4_GPU_RESTORE_TOKENS`` and ``DSV4_GPU_RESTORE_ROUNDS`` cut the
visit for a short GPU window.
"""

from __future__ import annotations

import os
import statistics

from bench.gpu_server import traffic
from bench.gpu_server.agents import medians_ratio
from bench.gpu_server.hicache import LAYOUTS
from bench.gpu_server.scenarios import _spread, _visit_order
from bench.gpu_server.servers import ServerSpec
from harness import dsv4_checkpoints

SESSION_TOKENS = 100 * 1024
TURN_TOKENS = 64
ROUNDS = 5
POOL_MARGIN = 8192  # the device pool: one session, its turn and this; a second session pushes the first out
HOST_RATIO = 4
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", str(HOST_RATIO), *LAYOUTS["kernel_layer_first"]]
SERVERS = ("restore_bf16", "restore_fp8", "recompute_bf16")
RATIOS = (("restore_bf16", "restore_fp8"), ("restore_bf16", "recompute_bf16"))


def model() -> str:
    return os.environ.get("DSV4_GPU_RESTORE_MODEL", "flash12")


def session_tokens(env=None) -> int:
    """The session's length, ``DSV4_GPU_RESTORE_TOKENS`` or :data:`SESSION_TOKENS`: at least 8 margins, so that
    most of a returning prefix comes from host."""
    env = os.environ if env is None else env
    tokens = int(env.get("DSV4_GPU_RESTORE_TOKENS", SESSION_TOKENS))
    if tokens < 8 * POOL_MARGIN:
        raise ValueError(f"DSV4_GPU_RESTORE_TOKENS={tokens}: give at least {8 * POOL_MARGIN}, so that the "
                         f"{POOL_MARGIN} tokens left on the device are a small part of the returning prefix")
    return tokens


def pool_tokens(tokens: int) -> int:
    return tokens + TURN_TOKENS + POOL_MARGIN


def specs() -> list[ServerSpec]:
    pool = pool_tokens(session_tokens())
    common = dict(mem_fraction=0.25, max_total_tokens=pool, context_length=pool, chunked_prefill=16384,
                  graph_batches=(1,), max_running=4)
    every = ["--swa-full-tokens-ratio", "0.5"]
    name = model()
    return [ServerSpec("restore_bf16", name, "dsv4", extra_args=every + HICACHE, **common),
            ServerSpec("restore_fp8", name, "sglang", upstream_indexer="deepgemm", extra_args=every + HICACHE,
                       **common),
            ServerSpec("recompute_bf16", name, "dsv4", extra_args=every, **common)]


def visit(url: str, seed: int, tokens: int, vocab: int) -> dict:
    """One returning session on one server (module doc): its time to the first token and what was cached."""
    session = traffic.prompt(seed, tokens, vocab)
    traffic.generate(url, [session], 1)
    traffic.generate(url, [traffic.prompt(seed + 1, tokens, vocab)], 1)  # the filler: the session leaves the device
    seconds, out = traffic.generate(url, [session + traffic.prompt(seed + 2, TURN_TOKENS, vocab)], 1)
    return {"ttft_ms": round(seconds * 1e3, 3), "cached_tokens": out[0].get("meta_info", {}).get("cached_tokens")}


def run(servers: dict, logs: dict | None = None, work_dir=None, out: dict | None = None) -> dict:
    """Every round's visits on the started servers (name -> url); ``out`` fills as visits come in."""
    tokens = session_tokens()
    rounds = int(os.environ.get("DSV4_GPU_RESTORE_ROUNDS", ROUNDS))
    vocab = dsv4_checkpoints.config(model())["vocab_size"]
    names = list(servers)
    result = out if out is not None else {}
    result.update({"model": model(), "session_tokens": tokens, "turn_tokens": TURN_TOKENS,
                   "pool_tokens": pool_tokens(tokens),
                   "rounds": rounds, "visits": {n: [] for n in names}, "visit_order": {}})
    for n in names:  # every shape once, untimed: a cold JIT cache compiles on a shape's first request
        visit(servers[n], 900_000, tokens, vocab)
    for rnd in range(rounds):
        result["visit_order"][f"round {rnd}"] = order = _visit_order(names, "restore", rnd)
        for v, n in enumerate(order):
            result["visits"][n].append(visit(servers[n], 1_000_000 + 1000 * rnd + 10 * v, tokens, vocab))
    result["servers"] = {}
    for n in names:
        ttft = [v["ttft_ms"] for v in result["visits"][n]]
        cached = [v["cached_tokens"] for v in result["visits"][n] if v["cached_tokens"] is not None]
        result["servers"][n] = {"ttft_ms": round(statistics.median(ttft), 3), "spread": _spread(ttft),
                                "cached_tokens_median": statistics.median(cached) if cached else None}
    result["ratios"] = {f"{a}/{b}": medians_ratio([v["ttft_ms"] for v in result["visits"][a]],
                                                  [v["ttft_ms"] for v in result["visits"][b]])
                        for a, b in RATIOS if a in names and b in names}
    return result

"""The ``incident`` set: the production configuration as one system, with the 80-session agent killed mid-run.

Why: every fix was shown on its own (the ``pd`` set: eager pairs, no HiCache, 30 s timeouts; the ``hicache`` set:
single servers), never in the configuration the incidents came from. Here, after ``dsv4-sm120 patch apply``,
each pair is a prefill with ``--enable-hierarchical-cache`` (a device pool of ``PREFILL_POOL`` tokens, far less than
the agents' working set, so prefixes are evicted, backed up and loaded back) and a decode with CUDA graphs for
the batch sizes the traffic reaches, bf16 keys, over NIXL behind the PD router, with sglang's default timeouts
and the package's default switches. Three such pairs run at once on the GPU (so the times below are those of a
shared GPU): the defaults; ``DSV4_SM120_INDEX_K_CHECKSUM=1`` on both sides; the fixes off
(``DSV4_SM120_NIXL_HARDENING=0``, ``DSV4_SM120_COLLECTIVE_GUARD=0``).

Traffic per pair, through its router, by ``dsv4-sm120 agent-bench`` (tool-call-shaped multi-turn sessions on
shared prefixes of ~4k tokens):

- ``KILLS`` rounds: 80 agent sessions at once, the agent process killed (SIGKILL) ``KILL_AFTER_S`` after the servers
  first hold its requests; at the kill,
  what the servers hold (decode running, prefill queues); then a fresh chat (its status and time) and ``/health``
  of the three processes.
- the multi-turn phase: 64 sessions for at most ``MULTI_TURN_S``, a fifth of the turns cut at their first chunk;
  the agent's figures (TTFT, served, failed, the prefill's cache hits).
- then what is left on either side once settled (rooms, transfer infos, requests, KV tokens in use: sglang's
  gauges and the package's), ``/health``, the counters' deltas over the pair's traffic (the package's, and
  sglang's HiCache load-back and cache-hit counters), and the integrity verdicts of the checksum pair.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.gpu_server import pd
from bench.gpu_server.servers import wait_healthy
from harness import checks, cluster, scrape

KILLS, KILL_AFTER_S, FRESH_TIMEOUT_S = 5, 8.0, 180.0
# On an H200 the first round's agent had sent nothing 8 s after its start (the servers held nothing at the kill):
# the kill comes KILL_AFTER_S after the servers first hold its requests (or FIRST_REQUESTS_S after its start).
FIRST_REQUESTS_S = 30.0
MULTI_TURN_SESSIONS, MULTI_TURN_S = 64, 150.0
SETTLE_S = 120.0
PREFILL_POOL = 32768
AGENT = ("--groups", "8", "--prefix-words", "1100", "--turn-words", "200", "--max-history-words", "1400",
         "--max-tokens", "48", "--request-timeout", "300")  # ~4.2k-token prefixes, histories to ~10k tokens
PAIR_SHAPE = {
    "model": "hicache",
    "env": {},  # sglang's default PD timeouts
    "prefill": ({"graphs": False, "max_total_tokens": PREFILL_POOL, "context_length": 16384, "max_running": 80},
                ["--enable-hierarchical-cache", "--hicache-ratio", "8", "--swa-full-tokens-ratio", "0.5"]),
    "decode": ({"graphs": True, "graph_batches": (1, 8, 64, 80), "max_total_tokens": 262144,
                "context_length": 16384, "max_running": 80}, ["--swa-full-tokens-ratio", "0.5"]),
}
PAIRS = {"": {}, "_checksum": {"DSV4_SM120_INDEX_K_CHECKSUM": "1"},
         "_fixes_off": {"DSV4_SM120_NIXL_HARDENING": "0", "DSV4_SM120_COLLECTIVE_GUARD": "0"}}
HELD = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
        "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs")
UPSTREAM_COUNTERS = ("sglang:load_back_tokens_total", "sglang:prompt_tokens_total", "sglang:cached_tokens_total")


def _agent(pair: pd.Pair, sessions: int, extra: tuple = ()) -> list[str]:
    return ["--base-url", pair.cluster.front, "--model", "tiny", "--sessions", str(sessions),
            "--concurrency", str(sessions), "--metrics-url", pair.cluster.prefill.url, *AGENT, *extra,
            "--device", "a GPU host: DeepSeek-V4 hicache (dummy weights), PD over NIXL, HiCache on the prefill"]


def held(pair: pd.Pair) -> dict[str, float]:
    """What each side holds now: sglang's queue and running gauges, by ``name@server``."""
    out = {}
    for proc in (pair.cluster.prefill, pair.cluster.decode):
        samples = scrape.metrics(proc.url)
        out.update({f"{n}@{proc.name}": scrape.total(samples, n) for n in HELD if n in scrape.names(samples)})
    return out


def counters(pair: pd.Pair) -> dict[str, float]:
    """The package's counters on both sides and sglang's HiCache counters, by ``name@server`` for the latter."""
    out = checks.dsv4_counters(pair.cluster)
    for proc in (pair.cluster.prefill, pair.cluster.decode):
        samples = scrape.metrics(proc.url)
        out.update({f"{n}@{proc.name}": scrape.total(samples, n) for n in UPSTREAM_COUNTERS
                    if n in scrape.names(samples)})
    return out


def fresh_chat(pair: pd.Pair) -> dict:
    t0 = time.monotonic()
    status, body = cluster.chat(pair.cluster.front, "Reply with one word.", 8, FRESH_TIMEOUT_S)
    return {"status": status, "seconds": round(time.monotonic() - t0, 2),
            **({} if status == 200 else {"body": body[:300].decode(errors="replace")})}


def kill_round(pair: pd.Pair, work: Path, k: int) -> dict:
    """80 agents started, killed ``KILL_AFTER_S`` in; then a fresh chat and /health."""
    out = work / f"agent_kill{pair.tag}_{k}.json"
    agent = subprocess.Popen([*pd.CLI, "agent-bench", *_agent(pair, 80, ("--turns", "50")), "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started_by = time.monotonic() + FIRST_REQUESTS_S  # the agent's start is not counted in the time to its kill
        while time.monotonic() < started_by and not any(held(pair).values()) and agent.poll() is None:
            time.sleep(0.5)
        time.sleep(KILL_AFTER_S)
        at_kill = held(pair)
    finally:
        agent.kill()
        agent.wait()
    return {"round": k, "held_at_kill": at_kill, "fresh": fresh_chat(pair), "health": checks.health(pair.cluster)}


def multi_turn(pair: pd.Pair, work: Path) -> dict:
    extra = ("--turns", "20", "--cut-fraction", "0.2", "--level-seconds", str(MULTI_TURN_S))
    return pd.agent_level(_agent(pair, MULTI_TURN_SESSIONS, extra), work / f"agent_multi_turn{pair.tag}.json",
                          MULTI_TURN_S + 360)


def run_pair(pair: pd.Pair, log_dir: Path, work: Path, res: dict) -> None:
    """The whole traffic of one pair into ``res`` (an exception is its ``error``; the figures so far stay)."""
    try:
        pd.serve(pair, log_dir)
        res["serving_after_s"] = round(time.monotonic() - pair.started[0].started_at, 1)
        before = counters(pair)
        res["kills"] = []
        for k in range(1, KILLS + 1):
            res["kills"].append(kill_round(pair, work, k))
        res["multi_turn"] = multi_turn(pair, work)
        res["fresh_after"] = fresh_chat(pair)
        res["leftovers"] = checks.settle(pair.cluster, timeout=SETTLE_S)
        res["health"] = checks.health(pair.cluster)
        res["counter_deltas"] = checks.delta(before, counters(pair))
        res["integrity_log_lines"] = {p.name: pd._log_lines(p, "mismatch", "quarantin", "CorruptPage")
                                      for p in (pair.cluster.prefill, pair.cluster.decode)}
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    res["dead_after"] = pair.cluster.servers.dead()


def serve_at_once(pairs: list, startup_timeout: float, ready, traffic) -> None:
    """Wait until every pair's servers are healthy (all at once), call ``ready``, then run ``traffic(pair)`` for
    every pair at once."""
    with ThreadPoolExecutor(2 * len(pairs)) as pool:
        for pair in pairs:
            pair.healthy = pool.submit(wait_healthy, pair.started, startup_timeout)
        for pair in pairs:
            pair.healthy.result()
        if ready is not None:
            ready()
        list(pool.map(traffic, pairs))


def run(models_root: Path, log_dir: Path, startup_timeout: float, servers: dict, out: dict,
        mem_fraction: float | None = None, ready=None) -> None:
    """Start the three pairs, run each one's traffic at once, stop all; ``servers`` gets every launch line."""
    work, tokenizer = pd.prepare(log_dir, out)
    out["shared_gpu"] = f"{len(PAIRS)} pairs at once on one GPU"
    pairs: list[pd.Pair] = []
    try:
        for tag, switches in PAIRS.items():
            pairs.append(pd.start_pair(tag, switches, models_root, tokenizer, log_dir, mem_fraction, PAIR_SHAPE))
            servers.update(pairs[-1].launches())
        # in the record before the traffic, so a run stopped part way keeps each pair's rounds so far
        results = out["pairs"] = {pair.tag or "_default": {"fix": pair.fix} for pair in pairs}
        serve_at_once(pairs, startup_timeout, ready,
                      lambda p: run_pair(p, log_dir, work, results[p.tag or "_default"]))
    finally:
        for pair in pairs:
            pair.cluster.stop()
            servers.update(pair.launches())

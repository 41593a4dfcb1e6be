"""The ``agents`` set: HiCache's gain and each fix's price on a multi-turn agent workload, at low and high concurrency.

Why: HiCache with bf16 keys was fixed to win back prefix-cache speed, and every fix must be benchmarked at low and
high concurrency; neither had been measured on a model whose GPU work dominates a step. Here ``flash12`` (Flash's
attention and indexer dimensions) serves ``dsv4-sm120 agent-bench``'s workload: ``SESSIONS`` sessions in 8 groups
sharing ~4k-token prefixes, each with its own ~4k-token history, three turns per session per level (turn-major: a
session's next turn comes after every other session's), so that each session comes back to a history the other
sessions pushed out of a device pool of ``POOL`` tokens (the working set is several times that): on the host with
HiCache, recomputed without. Three turns, not one: a level of one turn is one burst of 64 requests (3-5 s at C=64),
and two servers of one configuration then differed by 20-40% from round to round.

Servers, all with decode CUDA graphs and the same device pool, started at once, each driven alone in turn:
``hc_off`` (no HiCache), ``hc_bf16`` (HiCache, bf16 keys, the package's default switches), ``hc_bf16_checksum``
(the same with ``DSV4_SM120_INDEX_K_CHECKSUM=1``), ``hc_fp8`` (HiCache, fp8 keys), ``hc_bf16_again`` (``hc_bf16``
once more: the same-configuration ratio is the floor under the others); and two PD pairs over NIXL
behind the router, a prefill with HiCache and a decode with graphs (the incident's configuration): the fixes on
(defaults) and off (``DSV4_SM120_NIXL_HARDENING=0``, ``DSV4_SM120_COLLECTIVE_GUARD=0``). Named, not by default:
a pair with one fix off each (``pd_guard_off``, ``pd_hardening_off``: each fix's own price) and ``pd_again``
(``pd`` once more, the pairs' floor). Targets start in the order named (``start_order``).

Order: each target first gets an untimed visit of every level (its first requests compile kernels for their shapes
and fill the host pool; the servers share one JIT cache, so a level left out of it was compiled by whichever server
met it first, in its timed level); then ``REPETITIONS`` rounds, visiting every target in a shuffled order (seeded by
the start) and, on each, the levels ``CONCURRENCY`` ascending on odd rounds, and on even ones both reversed, so that
each even round is the odd one's exact reverse (ABBA; a shuffle seeded by the round had put the same of two targets
first in every round of every run); with ``STARTS`` above one, all of it again after the targets were stopped and
started the other way round (``ALONE``: one target a start, in ABBA order over the starts); a timed level during
which the JIT caches gained a file (a server compiled a kernel for a batch shape the warm-up had not made) is run
once more and left out of the figures (``COMPILE_REPEATS``). Per
target and level: the median of the rounds and their min-max for TTFT p50/p90, ITL p50, output and total throughput
and the server's cache hit share; then the ratios the bars are about, each as the median of the per-round ratios
with their min-max; per target its prefill's own pace over its timed levels (``server_side``, from sglang's prefill
lines), the cores each server's processes kept busy while driven and while another target was (``cpu_cores_busy``,
:mod:`cpu_use`), each fix's share of its scheduler loops' time from the servers' own ``/metrics``
(``hook_time``: where a 1% price is resolved, which the clients' figures cannot), and a profiled level of the
checksum server and its twin without it (``profiles``).
"""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import hook_time_cpu
from bench.gpu_server import cpu_use, hicache, pd, step_log, traffic
from bench.gpu_server.servers import ServerSpec, launch_line, start, wait_healthy
from tools.airgap import jit_cache

SESSIONS, POOL, CONCURRENCY = 64, 65536, (4, 64)
REPETITIONS = int(os.environ.get("DSV4_GPU_AGENT_ROUNDS", "3"))  # timed rounds; more narrow the spread
# how many times the targets are started, each start with its own warm-up and timed rounds, in the order named and
# then reversed, so that the rounds the ratios take span both orders: two PD pairs configured alike on one H100 ran
# 5% apart on the same batch, the one started first (and visited second) the slower: more than the 1% a fix may cost
STARTS = int(os.environ.get("DSV4_GPU_AGENT_STARTS", "2"))
# 1: each start starts one target alone, the targets taking turns in ABBA order over the starts (A B B A for two),
# and a ratio pairs the targets of one block of starts (starts 1-2, 3-4, ...). Why: a PD server's loops keep about
# two cores busy while it idles, and two pairs of one configuration driven in turn beside each other ran 7-11%
# apart in one run with ABBA visits, as far apart as the fixes on and off; alone, no pair shares the GPU host
# with another. STARTS is then a multiple of twice the targets (four for two).
ALONE = os.environ.get("DSV4_GPU_AGENT_ALONE", "0") == "1"
AGENT = ("--sessions", str(SESSIONS), "--groups", "8", "--prefix-words", "1000", "--start-words", "1000",
         "--turn-words", "250", "--max-history-words", "100000", "--turns", "3", "--max-tokens", "32",
         "--request-timeout", "300")
LEVEL_TIMEOUT_S = float(os.environ.get("DSV4_GPU_AGENT_LEVEL_S", "600"))  # one level's bound (the slowest took 70 s)
FIGURES = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "output_tokens_per_s", "total_tokens_per_s", "server_cache_hit")
_HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "8"]
_EVERY = ["--swa-full-tokens-ratio", "0.5"]
# every server is started at once: each sizes its pool from what the GPU has free when it does, less the share it
# leaves, so the share must cover the others' weights and graphs (eight flash12 servers use ~100 GB of an H200)
_SERVER = dict(mem_fraction=0.85, max_total_tokens=POOL, context_length=16384, max_running=64,
               graph_batches=(1, 4, 16, 64), chunked_prefill=8192)
SINGLES = {
    "hc_off": ("bf16", [], {}),
    "hc_bf16": ("bf16", _HICACHE, {}),
    "hc_bf16_checksum": ("bf16", _HICACHE, {"DSV4_SM120_INDEX_K_CHECKSUM": "1"}),
    "hc_fp8": ("fp8", _HICACHE, {}),
    # hc_bf16 again, started beside it: what two servers of one configuration differ by on this host (the floor
    # under every ratio below; the first panel's servers differed by more than the bars)
    "hc_bf16_again": ("bf16", _HICACHE, {}),
}
PAIRS = {"pd": {}, "pd_fixes_off": {"DSV4_SM120_NIXL_HARDENING": "0", "DSV4_SM120_COLLECTIVE_GUARD": "0"},
         # each fix's own price, and pd once more (the floor under the pairs' ratios: two pairs of one
         # configuration ran 5% apart on the same batch on one H100); not in the default panel
         "pd_guard_off": {"DSV4_SM120_COLLECTIVE_GUARD": "0"}, "pd_hardening_off": {"DSV4_SM120_NIXL_HARDENING": "0"},
         "pd_again": {},
         # integrity mode on both sides: the PD send/receive sums and the decode's late-write re-reads
         "pd_checksum": {"DSV4_SM120_INDEX_K_CHECKSUM": "1"}}
DEFAULT_TARGETS = [*SINGLES, "pd", "pd_fixes_off"]
FIXES_TURNED_OFF = ("nixl", "guard")  # pd_fixes_off's switches, as the pin manifest names their hooks' fixes
# the targets to start, in this order (comma-separated names of SINGLES and PAIRS; default DEFAULT_TARGETS): the
# five singles alone fit a GPU of 80 GB, the pairs beside them need about 100 GB; a second run with the pairs
# named the other way round starts them the other way round
TARGETS = [n for n in os.environ.get("DSV4_GPU_AGENT_TARGETS", "").split(",") if n] or DEFAULT_TARGETS
PAIR_SHAPE = {
    "model": "flash12",
    "env": {},
    "prefill": ({**_SERVER, "graphs": False}, _HICACHE + _EVERY),
    "decode": ({**_SERVER, "max_total_tokens": 4 * POOL}, _EVERY),
}
# a timed level during which a server compiled a kernel (new files in the JIT caches) is run once more and left
# out of the table and the ratios: an H100's C=64 levels of 10-14 s met a DeepGEMM, TileLang or Triton compile for
# a batch shape the warm-up had not made in each of three rounds, and a pair's level with two of them took 43 s
COMPILE_REPEATS = 1
# after the timed rounds, one C=64 level of each with sglang's profiler on (host ops, CUDA runtime calls, kernels):
# where the checksum's share of a prefill batch goes
PROFILED = ("hc_bf16_checksum", "hc_bf16")
PROFILE_STEPS, PROFILE_TIMEOUT_S, PROFILE_MAX_TOKENS = 30, 120.0, 1
STAMP = "%Y-%m-%d %H:%M:%S"  # a level's span, as sglang stamps its log lines (local time, this host's clock)
# (name, numerator, denominator, figure): what the bars hold, per level
RATIOS = (("same_config_throughput", "hc_bf16_again", "hc_bf16", "output_tokens_per_s"),
          ("same_config_ttft_p50", "hc_bf16_again", "hc_bf16", "ttft_p50_s"),
          ("hicache_ttft_p50_gain_bf16", "hc_off", "hc_bf16", "ttft_p50_s"),
          ("checksum_throughput", "hc_bf16_checksum", "hc_bf16", "output_tokens_per_s"),
          ("checksum_ttft_p50", "hc_bf16_checksum", "hc_bf16", "ttft_p50_s"),
          ("bf16_vs_fp8_throughput", "hc_bf16", "hc_fp8", "output_tokens_per_s"),
          ("pd_fixes_on_vs_off_throughput", "pd", "pd_fixes_off", "output_tokens_per_s"),
          ("pd_guard_throughput", "pd", "pd_guard_off", "output_tokens_per_s"),
          ("pd_hardening_throughput", "pd", "pd_hardening_off", "output_tokens_per_s"),
          ("same_config_pd_throughput", "pd_again", "pd", "output_tokens_per_s"),
          ("pd_checksum_throughput", "pd_checksum", "pd", "output_tokens_per_s"),
          ("pd_checksum_ttft_p50", "pd_checksum", "pd", "ttft_p50_s"))
BOOTSTRAP_RESAMPLES = 2000


def specs(tokenizer: Path, names: list[str] | None = None) -> list[ServerSpec]:
    """The single servers among ``names`` (default ``TARGETS``), in that order."""
    unknown = set(TARGETS) - set(SINGLES) - set(PAIRS)
    if unknown:
        raise ValueError(f"DSV4_GPU_AGENT_TARGETS names {sorted(unknown)}; the set has {[*SINGLES, *PAIRS]}")
    return [ServerSpec(name, "flash12", "dsv4", index_k=SINGLES[name][0], tokenizer=tokenizer,
                       extra_args=_EVERY + SINGLES[name][1], extra_env=SINGLES[name][2], **_SERVER)
            for name in (TARGETS if names is None else names) if name in SINGLES]


def agent(front: str, metrics_url: str, concurrency: int, out: Path, max_tokens: int | None = None) -> dict:
    """One level of ``agent-bench`` against ``front`` (``max_tokens``: each turn's instead of ``AGENT``'s); its
    level record (or the error)."""
    args = list(AGENT)
    if max_tokens is not None:
        args[args.index("--max-tokens") + 1] = str(max_tokens)
    return pd.agent_level(["--base-url", front, "--model", "flash12", "--metrics-url", metrics_url,
                           "--concurrency", str(concurrency), *args,
                           "--device", "a GPU host: DeepSeek-V4 flash12 (dummy weights)"], out, LEVEL_TIMEOUT_S)


def profile(front: str, metrics_url: str, work: Path, name: str) -> dict:
    """One C=64 level on ``front`` with sglang's profiler on for its first ``PROFILE_STEPS`` forward steps at
    ``metrics_url``: the trace's host ops, CUDA runtime calls and kernels by time (a host wait shows as a stream
    or event synchronize among the runtime calls) and each kind of step's host time and GPU span (``steps``).
    Its turns answer one token each, so that every profiled step is a prefill batch, the steps integrity mode
    checks: with the set's 32 tokens a turn, the first requests' decode steps ran between the burst's prefills
    and took 28 of 30 profiled steps (two H100 runs). Python calls are not recorded: sglang's stack recording
    slowed the host of a profiled level several times over (an H100 run's profiled prefill steps took 120 ms of
    host for 6-8 ms of GPU work). Untimed: a profiled level is slower."""
    out_dir = work / f"profile_{name}"
    return hicache.profiled(metrics_url, out_dir, lambda: agent(front, metrics_url, 64, out_dir / "level.json",
                                                                max_tokens=PROFILE_MAX_TOKENS), name,
                            wait_s=0.0, steps=PROFILE_STEPS, timeout=PROFILE_TIMEOUT_S, with_stack=False)


_HOOK_TOTALS = re.compile(r'^sglang:dsv4_hook_(seconds|calls)_total\{([^}]*)\} (\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def hook_totals(url: str) -> dict[str, dict[str, float]]:
    """``url``'s ``sglang:dsv4_hook_seconds_total`` and ``_calls_total`` (``seconds``, ``calls``), each by
    ``fix:thread`` and summed over TP ranks (empty when it does not answer)."""
    out: dict[str, dict[str, float]] = {"seconds": {}, "calls": {}}
    try:
        text = traffic.get_text(url, "/metrics")
    except Exception:  # noqa: BLE001 - a level's figures stand without this
        return out
    for kind, labels, value in _HOOK_TOTALS.findall(text):
        lab = dict(_LABEL.findall(labels))
        key = f"{lab.get('fix')}:{lab.get('thread')}"
        out[kind][key] = out[kind].get(key, 0.0) + float(value)
    return out


def hook_shares(runs: list[dict], added_ns: float | None = None) -> dict:
    """Per target, level and process: each fix's seconds on its scheduler loop's thread (``<fix>:main``) over the
    level's duration, the median over the timed clean rounds with its min-max. A level that took ``T`` with a
    fix's ``X`` seconds on the loop's thread would take at least ``T - X`` without it, so the share bounds what
    the fix takes from throughput; the sum over the fixes a comparison turns off is under ``fixes``, and their
    calls a second under ``fixes_calls_per_s``; with ``added_ns``, what timing adds to a call on this host
    (:func:`bench.hook_time_cpu.measure`, not in the counted seconds), ``fixes_bound`` is the share plus those
    calls' timing: the fixes' whole price on the loop's thread, timing included. The seconds are those between
    two scrapes, which also hold the loop's time before the level's clients start and after they end (and up to a
    second the counters lag), and the loop's idle iterations, so the share errs high."""
    out: dict = {}
    for r in runs:
        if not _counts(r) or "hook_s" not in r:
            continue
        duration = r["level"].get("duration_s")
        if not duration:
            continue
        for role, by_key in r["hook_s"].items():
            cell = out.setdefault(r["target"], {}).setdefault(str(r["concurrency"]), {}).setdefault(role, {})
            for key, seconds in by_key.items():
                if key.endswith(":main"):
                    cell.setdefault(key.removesuffix(":main"), []).append(seconds / duration)
            share = sum(by_key.get(f"{f}:main", 0.0) for f in FIXES_TURNED_OFF) / duration
            cell.setdefault("fixes", []).append(share)
            if "hook_calls" in r:
                calls = r["hook_calls"].get(role, {})
                per_s = sum(calls.get(f"{f}:main", 0.0) for f in FIXES_TURNED_OFF) / duration
                cell.setdefault("fixes_calls_per_s", []).append(per_s)
                if added_ns is not None:
                    cell.setdefault("fixes_bound", []).append(share + per_s * added_ns * 1e-9)
    return {t: {c: {role: {fix: _spread(v) for fix, v in cell.items()} for role, cell in by_c.items()}
                for c, by_c in by_t.items()} for t, by_t in out.items()}


def _spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def medians_ratio(num: list[float], den: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict:
    """The ratio of two servers' medians over their rounds, with a 95% bootstrap interval (each server's rounds
    resampled on their own). A median of per-round ratios hides a server that is slower in every round by less
    than the rounds spread; this one does not."""
    num, den = [v for v in num if v], [v for v in den if v]
    if not num or not den:
        return {"ratio": None}
    rng = random.Random(seed)
    draws = sorted(statistics.median(rng.choices(num, k=len(num))) / statistics.median(rng.choices(den, k=len(den)))
                   for _ in range(resamples))
    return {"ratio": statistics.median(num) / statistics.median(den), "low": draws[int(0.025 * resamples)],
            "high": draws[int(0.975 * resamples) - 1], "n": [len(num), len(den)]}


def summarize(runs: list[dict], rounds: tuple[int, ...] | None = None) -> dict:
    """Per target and level, each figure's median over the rounds with its min-max; the bars' ratios per round,
    and the ratio of the two servers' medians with its bootstrap interval (``ratios_of_medians``).
    A level that waited on a compile is left out (``left_out_compiling`` names it; its repeat, if clean, stands
    in for it). ``rounds``: the timed rounds to take (default every one); a record's table over some of its
    rounds is ``summarize(record["results"]["runs"], rounds=(2, 3))``."""
    rounds = tuple(range(1, REPETITIONS + 1)) if rounds is None else tuple(rounds)
    runs = [r for r in runs if r["round"] in rounds]
    compiling = [r for r in runs if r.get("compiled", {}).get("files")]
    runs = [r for r in runs if not r.get("compiled", {}).get("files")]
    table: dict = {}
    for r in runs:
        if "error" not in r["level"]:
            table.setdefault(r["target"], {}).setdefault(str(r["concurrency"]), []).append(r["level"])
    out = {t: {c: {f: _spread([lv.get(f) for lv in levels]) for f in FIGURES} for c, levels in by_c.items()}
           for t, by_c in table.items()}
    ratios: dict = {}
    of_medians: dict = {}
    timed = sorted({(_block(r), r["round"]) for r in runs})  # a round of a start (of a block of starts, alone)
    for name, num, den, figure in RATIOS:
        for c in CONCURRENCY:
            per_round = []
            for key in timed:
                a, b = ([r["level"].get(figure) for r in runs if "error" not in r["level"]
                         and (r["target"], r["concurrency"], _block(r), r["round"]) == (t, c, *key)]
                        for t in (num, den))
                if a and b and a[0] and b[0]:
                    per_round.append(a[0] / b[0])
            ratios.setdefault(name, {})[str(c)] = _spread(per_round)
            levels = {t: [lv.get(figure) for lv in table.get(t, {}).get(str(c), [])] for t in (num, den)}
            of_medians.setdefault(name, {})[str(c)] = medians_ratio(levels[num], levels[den])
    left_out = [f"{_level_name(r)} "
                f"({', '.join(f'{k} {n}' for k, n in r['compiled']['by_cache'].items())} files compiled)"
                for r in compiling]
    return {"table": out, "ratios": ratios, "ratios_of_medians": of_medians, "left_out_compiling": left_out}


def _prefill_logs(started: list, pair_tags: list[str], pairs: list) -> dict:
    """Each target's prefill log: a single server's own, a PD pair's prefill's."""
    return {s.spec.name: s.proc.log for s in started} | {tag: p.cluster.prefill.log for tag, p in zip(pair_tags, pairs)}


def starts_plan(targets: list[str], starts: int, alone: bool) -> list[tuple[int, list[str]]]:
    """Per start, its block (what a ratio pairs within) and the targets it starts, in order: every target, the
    order named on odd starts and reversed on even ones; or, ``alone``, one target a start in ABBA order over
    the starts (blocks of ``len(targets)`` starts)."""
    if not alone:
        return [(k, targets if k % 2 else targets[::-1]) for k in range(1, starts + 1)]
    n = len(targets)
    if starts % (2 * n):
        raise ValueError(f"DSV4_GPU_AGENT_ALONE=1 needs DSV4_GPU_AGENT_STARTS a multiple of {2 * n} (each of the "
                         f"{n} targets once per block, blocks in ABBA order); it is {starts}")
    plan = []
    for k in range(starts):
        block = k // n
        order = targets if block % 2 == 0 else targets[::-1]
        plan.append((block + 1, [order[k % n]]))
    return plan


def started_both_ways(start_order: list[list[str]], first: str, second: str) -> bool:
    """Whether some start (or, alone, some block of starts) brought ``first`` up before ``second`` and another the
    other way round: a record's ``start_order``."""
    if start_order and all(len(names) == 1 for names in start_order):  # alone: a block starts each target once
        n = len({names[0] for names in start_order})
        start_order = [sum(start_order[i:i + n], []) for i in range(0, len(start_order), n)]
    return {o.index(first) < o.index(second) for o in start_order if {first, second} <= set(o)} == {True, False}


def _block(run: dict) -> int:
    """The block of starts a run's level belongs to (its start, unless each start ran one target alone)."""
    return run.get("block", run.get("start", 1))


def _start_tag(start: int) -> str:
    """What leads the name of a later start's level (``s2:``), so that it stands apart from the first's (none)."""
    return "" if start == 1 else f"s{start}:"


def _level_name(run: dict) -> str:
    """``r<round>:<target>:C<concurrency>``, led by the start's tag."""
    return f"{_start_tag(run.get('start', 1))}r{run['round']}:{run['target']}:C{run['concurrency']}"


def _counts(run: dict) -> bool:
    """Whether a level counts in the figures: a round past the warm-up, not compiling, not failed."""
    return run["round"] > 0 and not run.get("compiled", {}).get("files") and "error" not in run["level"]


def _timed_spans(runs: list[dict], target: str) -> dict:
    """``target``'s levels that count (:func:`_counts`), (block, round, concurrency) -> (its start, its wall-clock
    span)."""
    return {(_block(r), r["round"], r["concurrency"]): (r.get("start", 1), tuple(r["span"])) for r in runs
            if r["target"] == target and "span" in r and _counts(r)}


def server_side(prefill_logs: dict, runs: list[dict]) -> dict:
    """Per target, its prefill's own pace over its timed levels (:func:`step_log.prefill_pace`), and the bars'
    ratios of it: the servers' logs time each batch, where the clients' levels of a few seconds each spread by
    more than the bars (the first panel's servers of one configuration differed by 20%). ``prefill_logs``: per
    start, each target's prefill log. Only the batches logged within a timed level's span are taken, as the
    clients' table takes its levels: the warm-up round compiles kernels for new batch shapes on whichever server
    meets them first, and a compiling level is left out (an H100's warm-up batches had put one PD pair 3% behind
    its twin). ``new_tokens_per_s_ratios`` divide the paces; ``matched_ratios`` compare the two prefills on the
    same batch (:func:`step_log.matched_ratio`, with a 95% interval), which the bars are held on: two servers'
    paces differ by what their batches held. A ratio takes the levels both targets ran clean
    (``compared_levels``; a stopped run's last round may have reached one and not the other)."""
    texts = {k: {name: Path(log).read_text(errors="replace") if Path(log).exists() else "" for name, log in by.items()}
             for k, by in prefill_logs.items()}
    names = {name for by in texts.values() for name in by}
    spans = {name: _timed_spans(runs, name) for name in names}

    def batches(name: str, levels) -> list:
        return [b for k, by in texts.items() if by.get(name)
                for b in step_log.busy_batches(by[name], [span for start, span in map(spans[name].get, levels)
                                                          if start == k])]

    pace = {name: step_log.prefill_pace(batches(name, spans[name])) if any(by.get(name) for by in texts.values())
            else {} for name in names}
    ratios, matched, compared = {}, {}, {}
    for name, num, den, figure in RATIOS:
        if figure != "output_tokens_per_s" or not (pace.get(num, {}).get("batches") and pace.get(den, {}).get("batches")):
            continue
        both = sorted(spans[num].keys() & spans[den].keys())
        compared[name] = [f"{_start_tag(k)}r{rnd}:C{c}" for k, rnd, c in both]
        a, b = batches(num, both), batches(den, both)
        if not (a and b):
            continue
        ratios[name] = round(step_log.prefill_pace(a)["new_tokens_per_s"] / step_log.prefill_pace(b)["new_tokens_per_s"], 4)
        matched[name] = step_log.matched_ratio(a, b)
    return {"prefill": pace, "new_tokens_per_s_ratios": ratios, "matched_ratios": matched,
            "compared_levels": compared}


def run(models_root: Path, log_dir: Path, startup_timeout: float, servers: dict, out: dict,
        mem_fraction: float | None = None, ready=None) -> None:
    """``STARTS`` times: start every target (in the order named, then reversed) or, ``ALONE``, one in its turn
    (:func:`starts_plan`), warm each, visit them in the rounds' order, stop all; then the figures over every
    start."""
    work, tokenizer = pd.prepare(log_dir, out)
    out["host_cpus"], out["order"], out["start_order"] = os.cpu_count(), [], []
    runs: list[dict] = out.setdefault("runs", [])  # in the record as they come: a stopped run keeps its levels
    logs: dict[int, dict] = {}  # start -> target -> its prefill's log
    try:
        for k, (block, names) in enumerate(starts_plan(TARGETS, STARTS, ALONE), start=1):
            _one_start(k, block, names, models_root, log_dir if STARTS == 1 else log_dir / f"start{k}", tokenizer,
                       work, startup_timeout, servers, out, logs, mem_fraction, ready if k == 1 else None,
                       profiles=k == STARTS)
    finally:
        out["workload"] = {"agent_bench": list(AGENT), "concurrency": list(CONCURRENCY), "rounds": REPETITIONS,
                           "starts": STARTS, "alone": ALONE, "device_pool_tokens": POOL, "targets": list(TARGETS)}
        out.update(summarize(runs))  # over the levels that ran, also when the run was stopped
        out["cpu_cores_busy"] = cpu_use.cores(runs)
        # what timing adds to a hook call on this host, the dearer kind's (AROUND) for every call
        out["hook_wrapper_ns"] = hook_time_cpu.measure(calls=50_000, repetitions=6)
        out["hook_time"] = hook_shares(runs, out["hook_wrapper_ns"]["around"]["added_ns"]["median"])
        out["server_side"] = server_side(logs, runs)


def _one_start(k: int, block: int, names: list[str], models_root: Path, log_dir: Path, tokenizer: Path, work: Path,
               startup_timeout: float, servers: dict, out: dict, logs: dict, mem_fraction: float | None,
               ready, profiles: bool) -> None:
    """Start ``names`` in that order, warm each, run the timed rounds (``runs`` entries of start ``k`` in ``block``),
    profile when asked, stop all; ``logs[k]`` names each target's prefill log as soon as it is started."""
    log_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if k == 1 else f"@start{k}"  # the launch lines of a later start beside the first's
    started, pairs = [], []
    pair_tags = [tag for tag in names if tag in PAIRS]
    runs = out["runs"]
    try:
        for spec in specs(tokenizer, names):
            if mem_fraction is not None:
                spec.mem_fraction = mem_fraction
            started.append(start(spec, models_root, log_dir))
        for tag in pair_tags:
            pairs.append(pd.start_pair(f"_{tag}", PAIRS[tag], models_root, tokenizer, log_dir, mem_fraction,
                                       PAIR_SHAPE))
        logs[k] = _prefill_logs(started, pair_tags, pairs)
        out["start_order"].append([s.spec.name for s in started] + pair_tags)
        for s in started:
            servers[s.spec.name + suffix] = {"launch": launch_line(s)}
        with ThreadPoolExecutor(len(pairs) + 1) as pool:
            waits = [pool.submit(wait_healthy, started, startup_timeout)]
            for p in pairs:
                p.healthy = pool.submit(wait_healthy, p.started, startup_timeout)
            waits[0].result()
            for p in pairs:
                pd.serve(p, log_dir)
        for s in started:
            servers[s.spec.name + suffix]["healthy_after_s"] = s.healthy_after_s
        if ready is not None:
            ready()
        targets = {s.spec.name: (s.url, s.url) for s in started}
        targets |= {tag: (p.cluster.front, p.cluster.prefill.url) for tag, p in zip(pair_tags, pairs)}
        processes = {s.spec.name: {"server": s.url} for s in started}  # whose /metrics time the fixes' hooks
        processes |= {tag: {"prefill": p.cluster.prefill.url, "decode": p.cluster.decode.url}
                      for tag, p in zip(pair_tags, pairs)}
        trees = {s.spec.name: s.proc.pid for s in started}  # each server's processes, for the CPU they use
        for tag, p in zip(pair_tags, pairs):
            trees |= {f"{tag}:{role}": proc.pid for role, proc in
                      (("prefill", p.cluster.prefill), ("decode", p.cluster.decode), ("router", p.cluster.router))
                      if proc is not None}
        file_tag = _start_tag(k).replace(":", "_")  # agent_<target>_s2_r1_c64.json past the first start
        visits = sorted(targets)
        random.Random(k).shuffle(visits)  # this start's order; a shuffle per round had put the same of two first
        for rnd in range(REPETITIONS + 1):  # round 0: the untimed warm-up of every level on each target
            forward = rnd % 2 or rnd == 0  # each even round the previous one's exact reverse (ABBA)
            levels = CONCURRENCY if forward else tuple(reversed(CONCURRENCY))
            for name in visits if forward else visits[::-1]:
                for c in levels:
                    for attempt in range(1 + (COMPILE_REPEATS if rnd else 0)):
                        hooks_before = {role: hook_totals(url) for role, url in processes[name].items()}
                        t0 = time.monotonic()
                        out_file = work / f"agent_{name}_{file_tag}r{rnd}_c{c}{'_again' * attempt}.json"
                        began, cpu_before = time.strftime(STAMP), cpu_use.snapshot(trees)
                        level, compiled = jit_cache.during(lambda: agent(*targets[name], c, out_file))
                        runs.append({"start": k, "block": block, "round": rnd, "target": name, "concurrency": c,
                                     "level": level,
                                     "wall_s": round(time.monotonic() - t0, 1), "compiled": compiled,
                                     "span": [began, time.strftime(STAMP)],
                                     "cpu_s": cpu_use.spent(cpu_before, cpu_use.snapshot(trees))})
                        hooks_after = {role: hook_totals(url) for role, url in processes[name].items()}
                        for field, kind in (("hook_s", "seconds"), ("hook_calls", "calls")):  # what the level added
                            runs[-1][field] = {role: {key: round(v - hooks_before[role][kind].get(key, 0.0), 6)
                                                      for key, v in after[kind].items()}
                                               for role, after in hooks_after.items()}
                        out["order"].append(_level_name(runs[-1]))
                        if not compiled["files"]:
                            break
        if profiles:
            out["profiles"] = {name: hicache._or_error(profile, *targets[name], work, name)
                               for name in PROFILED if name in targets}
    finally:
        for s in started:
            s.proc.stop()
        for p in pairs:
            p.cluster.stop()
            servers.update({name + suffix: launch for name, launch in p.launches().items()})

"""The ``hicache`` set: bf16 index-K pages through upstream's real HiCache copy kernels, checked at the reader.

Servers (``--model-impl dsv4``, a device pool of 32768 tokens, far less than the sessions' prefixes, so they
are evicted, backed up and loaded back all the time; a host pool 8x that):

- the shipped configuration: integrity mode off (the default), decode CUDA graphs, one server per io backend
  and host layout the pin supports for DeepSeek-V4 (``kernel`` with ``layer_first`` and ``page_first``;
  ``direct``, which upstream moves to ``page_first_direct``); each of them again with integrity mode on;
  fp8 keys the same way; the references without HiCache (a device pool 4x larger, so they never wait);
- eager controls with upstream's ``SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES`` (a sleep on the H2D stream before
  each layer's load, so that a load lands after a read that does not wait for it): the whole load fence out
  (the package's and upstream's ``wait_layer_transfer``; a test-side sglang plugin, ``harness/faults``,
  never in the wheel), with integrity mode on (it must count and fail) and off (its top-k must differ from the
  reference's); only the package's fence out (what upstream's own waits give); the fence in (0 and equal);
  and one page corrupted after its load lands (caught, named, quarantined).

Traffic: the storm (``SESSIONS`` multi-turn sessions in ``GROUPS`` groups sharing long prefixes past the 2048
tokens after which the top-512 selection is active; each wave is ONE batched ``/generate`` in the same order on
every server, so that greedy tokens can be held against the reference's: even rounds in waves of ``WAVE``
sessions (a request's batch is then the same everywhere), odd rounds all ``SESSIONS`` sessions at once, the
agent's concurrency; beside it, streams cut after their first bytes; every server's counters scraped after
each wave, so a server that dies keeps the counts it reached); the top-k
probe on the eager servers that return the indexer's selections (``--enable-return-indexer-topk``): probe
sessions primed before the storm and asked again after it, when their prefixes come back from host, one
request at a time in the same order, comparing the selections of the rows each request computed itself (from
its ``cached_tokens`` on: sglang stores captures by device slot, so rows of a prefix loaded into new slots are
stale on every server); and the cost of integrity mode: the graph servers with it on and off, each alone on the
GPU in turn (ABBA), ``COST_SESSIONS`` concurrent sessions, then one profiled visit of each (host ops, CUDA
runtime calls and kernels side by side).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import statistics
import threading
import time
import urllib.parse
from pathlib import Path

from bench.gpu_server import traffic
from bench.gpu_server.servers import ServerSpec
from harness import dsv4_checkpoints, faults
from tools.airgap import jit_cache

SESSIONS, GROUPS, ROUNDS, WAVE = 64, 16, 24, 16
# A wave's ~10 distinct prefixes of 24 pages each (6 C4 layers) are ~3x the device pool: nearly every turn
# loads its prefix back from the host.
PREFIX_TOKENS, TURN_TOKENS, NEW_TOKENS = 6144, 48, 16
CANCEL_EVERY_S = 0.25
WAVE_TIMEOUT_S = 120.0  # a wave not answered by then: the server has stalled, and its storm ends there
# The top-k probe: short enough that a response's selections (rows x 6 C4 layers x 512 int32) stay ~30 MB.
PROBES, PROBE_PREFIX_TOKENS, SELECTIVE_FROM = 8, 2600, 4 * 512 + 64
# integrity mode's cost: sessions in flight, ABBA rounds (env DSV4_GPU_COST_ROUNDS)
COST_SESSIONS, COST_ROUNDS = 64, int(os.environ.get("DSV4_GPU_COST_ROUNDS", "3"))
# ~10 ms a layer at the H200's ~2 GHz: each layer's load lands well after an eager forward that does not wait
# for it has read that layer.
H2D_DELAY_CYCLES = 20_000_000
METRICS = ("index_k_pages_recorded_total", "index_k_page_checks_total", "index_k_pages_verified_total",
           "index_k_page_rechecks_total", "index_k_pages_unrecorded_total", "index_k_mismatches_total",
           "index_k_key_writes_checked_total", "index_k_key_writes_lost_total", "index_k_requests_failed_total",
           "index_k_pages_quarantined")
UPSTREAM_METRICS = ("load_back_tokens_total", "cache_hit_rate")

_HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "8"]  # the host holds every session's history
# Half the device pool for the sliding-window layers (upstream's default is a tenth). With a tenth, both servers
# without HiCache stalled mid-storm on an H200, sliding-window pool 92% full, no line logged for 4.5 minutes.
# sglang's soft watchdog logs the scheduler's state and a py-spy dump (the bundle carries py-spy) of a forward that
# has not finished in 60 s, and lets it go on: a stall is then told apart from a stuck kernel.
_EVERY_SERVER = ["--swa-full-tokens-ratio", "0.5", "--soft-watchdog-timeout", "60"]
_TOPK = ["--enable-return-indexer-topk"]
LAYOUTS = {
    "kernel_layer_first": ["--hicache-io-backend", "kernel", "--hicache-mem-layout", "layer_first"],
    "kernel_page_first": ["--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"],
    "direct": ["--hicache-io-backend", "direct", "--hicache-mem-layout", "page_first_direct"],
}


def _spec(name: str, index_k: str, hicache: list[str] | None, *, checksum: bool, graphs: bool = False,
          fault: str = "", delay: int = 0, topk: bool = False) -> ServerSpec:
    env = {"DSV4_SM120_INDEX_K_CHECKSUM": "1" if checksum else "0"}
    if delay:
        env["SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES"] = str(delay)
    if fault:
        env.update({"DSV4_TEST_FAULT": fault, "PYTHONPATH": faults.pythonpath()})
    if hicache is not None and not graphs:  # the eager controls: half the host pool (host memory for all servers)
        hicache = hicache + ["--hicache-ratio", "4"]
    # The servers without HiCache are the reference: a device pool 4x larger, so they never wait on memory.
    pool = 32768 if hicache is not None else 4 * 32768
    return ServerSpec(name, "hicache", "dsv4", graphs=graphs, index_k=index_k, mem_fraction=0.2,
                      max_total_tokens=pool, context_length=8192, max_running=SESSIONS,
                      graph_batches=(1, 4, 16, 32, 64),
                      chunked_prefill=4096,
                      extra_args=_EVERY_SERVER + (_TOPK if topk else []) + ((_HICACHE + hicache) if hicache is not None else []),
                      extra_env=env)


def specs() -> list[ServerSpec]:
    layer_first = LAYOUTS["kernel_layer_first"]
    out = [_spec(f"hc_{name}", "bf16", args, checksum=False, graphs=True) for name, args in LAYOUTS.items()]
    out += [_spec(f"hc_{name}_checksum", "bf16", args, checksum=True, graphs=True) for name, args in LAYOUTS.items()]
    out += [_spec("off", "bf16", None, checksum=False, graphs=True),
            _spec("hc_kernel_layer_first_fp8", "fp8", layer_first, checksum=False, graphs=True),
            _spec("off_fp8", "fp8", None, checksum=False, graphs=True),
            # eager, returning the indexer's selections
            _spec("eager_off", "bf16", None, checksum=False, topk=True),
            _spec("control_fence_in_delayed", "bf16", layer_first, checksum=True, delay=H2D_DELAY_CYCLES, topk=True),
            _spec("control_no_fence_delayed", "bf16", layer_first, checksum=True, delay=H2D_DELAY_CYCLES,
                  fault="fence_off_all"),
            _spec("control_no_fence_delayed_unchecked", "bf16", layer_first, checksum=False, delay=H2D_DELAY_CYCLES,
                  fault="fence_off_all", topk=True),
            _spec("control_package_fence_off_delayed", "bf16", layer_first, checksum=True, delay=H2D_DELAY_CYCLES,
                  fault="fence_off"),
            _spec("control_planted_page", "bf16", layer_first, checksum=True, fault="plant_one_page")]
    return out


def scrape(url: str) -> dict:
    """The package's index-K integrity series and upstream's HiCache load-back tokens on a server's /metrics
    (summed over label sets)."""
    text = traffic.get_text(url, "/metrics")
    out = {}
    for prefix, names in (("sglang:dsv4_", METRICS), ("sglang:", UPSTREAM_METRICS)):
        for name in names:
            pattern = re.compile(rf"^{prefix}{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
            out[name] = sum(float(v) for v in pattern.findall(text))
    return out


class Canceller(threading.Thread):
    """Streaming requests on the storm's prefixes, each cut after its first bytes (a client going away)."""

    def __init__(self, url: str, prefixes: list[list[int]], vocab: int):
        super().__init__(daemon=True)
        self.url, self.prefixes, self.vocab = urllib.parse.urlparse(url), prefixes, vocab
        self.stop, self.sent, self.errors = threading.Event(), 0, 0

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stop.is_set():
            ids = self.prefixes[rng.randrange(len(self.prefixes))] + traffic.prompt(rng.randrange(1 << 30), 32, self.vocab)
            body = json.dumps({"input_ids": ids, "stream": True,
                                       "sampling_params": {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}})
            try:
                conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=30)
                conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
                conn.getresponse().read(64)
                conn.close()  # gone mid-stream: the server aborts the request
                self.sent += 1
            except OSError:
                self.errors += 1
            self.stop.wait(CANCEL_EVERY_S)


def _waves():
    """(round, wave, sessions) in the order every server gets them: each round's sessions shuffled (so groups
    interleave and prefixes keep leaving the device), then cut into waves of ``WAVE`` (even rounds) or sent
    all at once (odd rounds)."""
    for rnd in range(ROUNDS):
        order = list(range(SESSIONS))
        random.Random(rnd).shuffle(order)
        width = WAVE if rnd % 2 == 0 else SESSIONS
        for w in range(0, SESSIONS, width):
            yield rnd, w // width, order[w:w + width]


def storm(url: str, deadline: float = float("inf")) -> dict:
    """The storm on one server: per wave its requests' digests (or errors), plus the integrity counters; no
    wave starts after ``deadline`` (time.monotonic())."""
    vocab = dsv4_checkpoints.config("hicache")["vocab_size"]
    prefixes = [traffic.prompt(31000 + g, PREFIX_TOKENS, vocab) for g in range(GROUPS)]
    history = {s: list(prefixes[s % GROUPS]) for s in range(SESSIONS)}
    before = last = scrape(url)
    canceller = Canceller(url, prefixes, vocab)
    canceller.start()
    waves, failed, stalled, t0 = [], [], None, time.monotonic()
    try:
        for rnd, wave, sessions in _waves():
            if time.monotonic() > deadline:
                break
            ids = [history[s] + traffic.prompt(rnd * 1000 + s, TURN_TOKENS, vocab) for s in sessions]
            try:
                _, results = traffic.generate(url, ids, NEW_TOKENS, timeout=WAVE_TIMEOUT_S)
            except traffic.RequestFailed as exc:
                if exc.timed_out:
                    stalled = {"round": rnd, "wave": wave, "after_s": round(time.monotonic() - t0, 1)}
                    break
                failed.append({"round": rnd, "wave": wave, "error": str(exc)[:600]})
                waves.append(None)
                last = _scrape_or(url, last)  # a wave failed by the check counts too, if the server still answers
                continue
            waves.append([traffic.digest(r) for r in results])
            for s, prompt_ids, r in zip(sessions, ids, results):
                history[s] = prompt_ids + traffic.output_ids(r)
            last = _scrape_or(url, last)
    finally:
        canceller.stop.set()
        canceller.join(10)
    out = {"waves": waves, "failed_waves": failed, "stalled": stalled, "seconds": round(time.monotonic() - t0, 1),
           "waves_answered": sum(w is not None for w in waves), "requests": sum(len(w) for w in waves if w),
           "cancelled_streams": canceller.sent}
    after = _scrape_or(url, None)
    if after is None:  # a server gone: the counts it had reached at its last wave
        out["metrics_at_last_wave"] = True
        after = last
    gauges = ("index_k_pages_quarantined", "cache_hit_rate")
    out["metrics"] = {k: after[k] - before[k] for k in after if k not in gauges} | {k: after[k] for k in gauges}
    return out


def _or_error(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # a profile that fails is reported; the record keeps the rest
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}


def _scrape_or(url: str, default):
    try:
        return scrape(url)
    except traffic.RequestFailed:
        return default


_MISMATCH = re.compile(r"index-K checksum mismatch at read: pool=\S+ layer=(\d+) host_page=(\d+)")
_FAILED = re.compile(r"index-K checksum mismatch fails request rid=(\w+)")


def log_counts(log: str) -> dict:
    """What a server's log says integrity mode found: mismatch lines, distinct (layer, host page) and distinct
    requests failed (for a server whose ``/metrics`` is gone by the end of its traffic)."""
    pages = _MISMATCH.findall(log)
    return {"mismatch_lines": len(pages), "distinct_pages": len(set(pages)),
            "requests_failed": len(set(_FAILED.findall(log))), "http_500": log.count('" 500 Internal Server Error')}


def agreement(a: dict, b: dict) -> dict:
    """Requests whose greedy tokens are equal on two servers' storms (waves that failed on either skipped)."""
    same = total = 0
    for wa, wb in zip(a["waves"], b["waves"]):
        if wa is None or wb is None:
            continue
        same += sum(x == y for x, y in zip(wa, wb))
        total += len(wa)
    return {"equal": same, "compared": total}


def _probe_ids(g: int, vocab: int) -> list[int]:
    return traffic.prompt(52000 + g, PROBE_PREFIX_TOKENS, vocab)


def probe_prime(url: str) -> list:
    """The probe sessions' first turns (their prefixes enter the cache; the storm then pushes them to host)."""
    vocab = dsv4_checkpoints.config("hicache")["vocab_size"]
    turns = []
    for g in range(PROBES):
        ids = _probe_ids(g, vocab) + traffic.prompt(53000 + g, TURN_TOKENS, vocab)
        _, results = traffic.generate(url, [ids], NEW_TOKENS, timeout=WAVE_TIMEOUT_S)
        turns.append(ids + traffic.output_ids(results[0]))
    return turns


def probe_ask(url: str, turns: list, topk: bool) -> list:
    """Each probe session's second turn, one request at a time: its result, or the server's error."""
    vocab, k = dsv4_checkpoints.config("hicache")["vocab_size"], dsv4_checkpoints.config("hicache")["index_topk"]
    layers = dsv4_checkpoints.c4_layers("hicache")
    out = []
    for g, history in enumerate(turns):
        ids = history + traffic.prompt(54000 + g, TURN_TOKENS, vocab)
        try:
            _, results = traffic.generate(url, [ids], NEW_TOKENS, timeout=WAVE_TIMEOUT_S, return_indexer_topk=topk)
        except traffic.RequestFailed as exc:
            out.append({"error": str(exc)[:600], "http_500": " 500" in str(exc)[:200]})
            continue
        meta = results[0].get("meta_info") or {}
        first = int(meta.get("cached_tokens") or 0)
        out.append({"digest": traffic.digest(results[0]), "cached_tokens": meta.get("cached_tokens"),
                    "selections": traffic.own_selections(results[0], first, layers, k) if topk else None})
    return out


def cost_visit(url: str, round_seed: int) -> dict:
    """``COST_SESSIONS`` streamed turns at once on prefixes the device pool cannot hold: TTFT, throughput."""
    vocab = dsv4_checkpoints.config("hicache")["vocab_size"]
    prefixes = [traffic.prompt(31000 + g, PREFIX_TOKENS, vocab) for g in range(GROUPS)]
    ids = [prefixes[s % GROUPS] + traffic.prompt(round_seed * 1000 + s, TURN_TOKENS, vocab) for s in range(COST_SESSIONS)]
    ttft, tokens, errors = [], [0], []

    def one(i: int) -> None:
        try:
            _, arrivals = traffic.stream_token_times(url, [ids[i]], NEW_TOKENS, timeout=WAVE_TIMEOUT_S)
            times = arrivals[0]
            if times:
                ttft.append(times[min(times)] - start)
                tokens[0] += max(times)
        except traffic.RequestFailed as exc:
            errors.append(str(exc)[:300])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(COST_SESSIONS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAVE_TIMEOUT_S + 30)
    wall = time.perf_counter() - start
    ttft.sort()
    return {"wall_s": round(wall, 3), "output_tok_s": round(tokens[0] / wall, 1),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 4) if ttft else None, "errors": errors[:3], "n": len(ttft)}


def _watched_visit(url: str, seed: int) -> dict:
    """A cost visit with what the JIT caches gained while it ran (``jit_cache.compiled_since``)."""
    visit, compiled = jit_cache.during(lambda: cost_visit(url, seed))
    return visit | {"compiled": compiled}


def cost(servers: dict, on: str, off: str) -> dict:
    """Integrity mode on vs off, each server alone in turn, ABBA over ``COST_ROUNDS`` rounds.

    Each server's k-th visit sends the same fresh turns (seed ``700 + k``) as the other's k-th: a visit never
    finds its own turns cached by an earlier visit, and visit k of one server is held against visit k of the
    other. The ratios are the median of those per-pair ratios, with their min and max. A visit during which
    the JIT caches gained a file waited on a kernel's compile for a shape not met before (2-15 s a kernel on an
    H100): it is made once more on fresh turns of the same lengths (seed ``1700 + k``, the first kept under
    ``instead_of``), and a visit that still compiled is left out of the figures and its pair out of the ratios."""
    visits = {on: [], off: []}
    for rnd in range(COST_ROUNDS):
        for name in ((off, on, on, off) if rnd % 2 == 0 else (on, off, off, on)):
            k = len(visits[name])
            visit = _watched_visit(servers[name], 700 + k)
            if visit["compiled"]["files"]:  # it waited on a compile: once more, on fresh turns of the same shape
                visit = _watched_visit(servers[name], 1700 + k) | {"instead_of": visit}
            visits[name].append(visit)

    def spread(vals):
        vals = sorted(v for v in vals if v is not None)
        return {"median": round(statistics.median(vals), 4), "min": vals[0], "max": vals[-1]} if vals else None

    def clean(visit):
        return not visit["compiled"]["files"]

    def paired(key):
        return spread([a[key] / b[key] for a, b in zip(visits[on], visits[off])
                       if a[key] and b[key] and clean(a) and clean(b)])

    summary = {n: {k: spread([v[k] for v in visits[n] if clean(v)]) for k in ("output_tok_s", "ttft_p50_s")}
               for n in visits}
    for name, key in (("throughput_on_over_off", "output_tok_s"), ("ttft_p50_on_over_off", "ttft_p50_s")):
        pairs = summary[f"{name}_pairs"] = paired(key)
        summary[name] = pairs["median"] if pairs else None
    return {"visits": visits, "summary": summary}


PROFILE_STEPS = 30  # forward steps of one cost visit in each server's profile


def cost_profile(url: str, work_dir, name: str, timeout: float = 90) -> dict:
    """One cost visit on ``url`` with sglang's profiler on for ``PROFILE_STEPS`` steps, host and GPU: where the
    time of a step goes (:func:`host_and_gpu_top`). After the timed rounds (a profiled visit is slower)."""
    # the visit's first prefill batches are queued 0.3 s after it starts
    return profiled(url, Path(work_dir) / f"cost_profile_{name}", lambda: cost_visit(url, 900), name, wait_s=0.3,
                    steps=PROFILE_STEPS, timeout=timeout)


def profiled(url: str, out_dir, work, name: str, *, wait_s: float, steps: int, timeout: float,
             with_stack: bool = True) -> dict:
    """``work()`` with sglang's profiler on for ``steps`` forward steps of the server at ``url``, host and GPU
    (:func:`traffic.profile_window`): the trace by category (:func:`host_and_gpu_top`), or why there is none."""
    trace = traffic.profile_window(url, out_dir, work, wait_s=wait_s, steps=steps, activities=["CPU", "GPU"],
                                   name=name, timeout=timeout, with_stack=with_stack)
    if trace is None:
        return {"error": f"no trace in {out_dir} after {timeout:.0f}s"}
    return {"steps": steps, **host_and_gpu_top(trace)}


def host_and_gpu_top(trace_path, top: int = 15) -> dict:
    """Per event category of a torch-profiler trace (host ops, CUDA runtime calls, kernels, Python calls): the
    total time, and the ``top`` names by time with their counts; a host wait shows as cudaStreamSynchronize,
    cudaEventSynchronize or a synchronous cudaMemcpy among the runtime calls. ``package`` is every Python call of
    the package's own code (sglang's profiler records the stack by default) with its inclusive time and count."""
    import gzip
    from collections import Counter

    with gzip.open(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    cats = ("cpu_op", "cuda_runtime", "kernel", "python_function")
    time_of, count = {c: Counter() for c in cats}, {c: Counter() for c in cats}
    for ev in events:
        if ev.get("cat") in time_of and "dur" in ev:
            time_of[ev["cat"]][ev["name"]] += float(ev["dur"])
            count[ev["cat"]][ev["name"]] += 1
    summary = {c: {"total_us": round(sum(time_of[c].values()), 1),
                   "top": [(k[:100], round(v, 1), count[c][k]) for k, v in time_of[c].most_common(top)]}
               for c in cats}
    calls = time_of["python_function"]
    summary["package"] = [(k[-120:], round(v, 1), count["python_function"][k]) for k, v in calls.most_common()
                          if "dsv4_sm120" in k]
    summary["steps"] = step_spans(events)
    return summary


STEP = re.compile(r"^step\[(\w+)")  # sglang's annotation of a forward step: step[EXTEND bs=5 toks=253], step[DECODE bs=6]


def step_spans(events: list) -> dict:
    """Per kind of forward step (EXTEND, DECODE, ...) from sglang's ``step[...]`` annotations: how many, the host
    time of each (its CPU annotation) and the span of its GPU work (its GPU annotation), summed, in ms. A step
    whose GPU span is near its host time kept the GPU waiting on the host; one whose GPU span is longer was the
    GPU's."""
    out: dict = {}
    for ev in events:
        match = STEP.match(str(ev.get("name", "")))
        if match is None or "dur" not in ev or ev.get("cat") not in ("user_annotation", "gpu_user_annotation"):
            continue
        kind = out.setdefault(match.group(1), {"steps": 0, "host_ms": 0.0, "gpu_ms": 0.0})
        if ev["cat"] == "user_annotation":
            kind["steps"] += 1
            kind["host_ms"] += ev["dur"] / 1e3
        else:
            kind["gpu_ms"] += ev["dur"] / 1e3
    return {k: {"steps": v["steps"], "host_ms": round(v["host_ms"], 2), "gpu_ms": round(v["gpu_ms"], 2)}
            for k, v in out.items()}


TOPK_SERVERS = ("eager_off", "control_fence_in_delayed", "control_no_fence_delayed_unchecked")
COST_PAIR = ("hc_kernel_layer_first_checksum", "hc_kernel_layer_first")  # integrity mode on, off


def _each(servers: dict, fn, out: dict, join_s: float | None = None) -> dict:
    """``fn(name, url)`` on every server at once, each on its own thread; ``out[name]`` its result or error."""
    def one(name: str, url: str) -> None:
        try:
            out[name] = fn(name, url)
        except Exception as exc:  # one server's failure is reported; the others go on
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    threads = [threading.Thread(target=one, args=item, daemon=True) for item in servers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return out


def run(servers: dict, logs: dict, work_dir=None, out: dict | None = None) -> dict:
    """The probes' first turns, every server's storm at once (``out`` filled as each ends), the probes' second
    turns with the selections, the comparisons with the references, then integrity mode's cost."""
    out = out if out is not None else {}
    eager = {n: u for n, u in servers.items() if n.startswith(("eager_", "control_"))}
    turns = _each(eager, lambda n, u: probe_prime(u), {})
    budget = float(os.environ.get("DSV4_GPU_STORM_SECONDS", "inf"))
    deadline = time.monotonic() + budget
    out["storm_budget_s"] = budget
    summaries = out.setdefault("storms", {})
    _each(servers, lambda n, u: storm(u, deadline), summaries,
          None if budget == float("inf") else budget + WAVE_TIMEOUT_S + 60)
    storms = {n: v for n, v in dict(summaries).items() if "waves" in v}
    refs = {n: ("off_fp8" if n.endswith("_fp8") else "eager_off" if n.startswith("control_") else "off")
            for n in storms if n.startswith(("hc_", "control_"))}
    out["outputs_vs_off"] = {n: agreement(storms[n], storms[o]) for n, o in refs.items() if o in storms}
    primed = {n: u for n, u in eager.items() if isinstance(turns.get(n), list)}
    probes = out["probes"] = _each(primed, lambda n, u: probe_ask(u, turns[n], n in TOPK_SERVERS), {})
    out["probe_summary"] = {n: {"requests": len(p), "failed_500": sum(bool(r.get("http_500")) for r in p),
                                "errors": sum("error" in r for r in p)}
                            for n, p in probes.items() if isinstance(p, list)}
    if isinstance(probes.get("eager_off"), list):
        out["topk_vs_off"] = {n: traffic.topk_agreement(probes[n], probes["eager_off"], SELECTIVE_FROM)
                              for n in TOPK_SERVERS
                              if n != "eager_off" and isinstance(probes.get(n), list)}
    out["metrics_after_probes"] = _each(servers, lambda n, u: scrape(u), {})
    if all(n in servers for n in COST_PAIR):
        out["cost"] = cost(servers, *COST_PAIR)
        if work_dir is not None:
            out["cost_profiles"] = {n: _or_error(cost_profile, servers[n], work_dir, n) for n in COST_PAIR}
    out["from_logs"] = {n: log_counts(logs[n]()) for n, m in out["metrics_after_probes"].items() if "error" in m}
    out["mismatch_lines"] = {n: [ln for ln in logs[n]().splitlines()
                                 if "index-K checksum mismatch" in ln or "key write lost" in ln][:5]
                             for n in servers}
    return out

"""The ``hicache`` set: bf16 index-K pages through upstream's real HiCache copy kernels under a storm.

Servers (``--model-impl dsv4``, ``DSV4_SM120_INDEX_K_CHECKSUM=1``, a device pool of 32768 tokens, far less
than the sessions' prefixes, so they are evicted, backed up and loaded back all the time; a host pool 4x
that): one per io backend and host layout the pin supports for DeepSeek-V4 (``kernel`` with ``layer_first``
and ``page_first``; ``direct``, which upstream itself moves to ``page_first_direct``), one with HiCache off
(a device pool 4x larger, so that it never waits on memory) for the token comparison, the same pair with fp8
keys, and two controls that load a test-side sglang plugin (``tests/gpu_server/faults``, never in the wheel):
one corrupts a single index-K page after a load lands, one takes the package's load fence out of its bf16
accessors.

The storm: ``SESSIONS`` multi-turn sessions in ``GROUPS`` groups, each group sharing a long prefix (past
the 2048 tokens after which the top-512 selection is active), ``ROUNDS`` rounds in which every session
takes a turn (until ``ROUNDS`` or the storm's time budget, ``DSV4_GPU_STORM_SECONDS``, whichever comes
first; all servers storm at once, each on its own thread). Each round goes out in waves of ``WAVE`` sessions, each wave ONE batched ``/generate``
call, in the same order on every server: so a request's batch is the same on the HiCache server and on
the server without HiCache, and their greedy tokens can be held against each other request by request.
Beside the waves, streaming requests on the same prefixes are cut after their first bytes, so aborts
land while pages move; those are not compared.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import threading
import time
import urllib.parse
from pathlib import Path

from bench.gpu_server import models, traffic
from bench.gpu_server.servers import ServerSpec

SESSIONS, GROUPS, ROUNDS, WAVE = 64, 16, 24, 16
# A wave's ~10 distinct prefixes of 24 pages each (6 C4 layers) are ~3x the device pool: nearly every turn
# loads its prefix back from the host, ~1,400 index-K page checks a wave.
PREFIX_TOKENS, TURN_TOKENS, NEW_TOKENS = 6144, 48, 16
CANCEL_EVERY_S = 0.25
WAVE_TIMEOUT_S = 120.0  # a wave not answered by then: the server has stalled, and its storm ends there
FAULTS_DIR = Path(__file__).resolve().parents[2] / "tests" / "gpu_server" / "faults"
METRICS = ("index_k_pages_checked_total", "index_k_pages_recorded_total", "index_k_mismatches_total",
           "index_k_requests_failed_total", "index_k_pages_quarantined")

_HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "8"]  # the host holds every session's history
# Half the device pool for the sliding-window layers (upstream's default is a tenth). With a tenth, both servers
# without HiCache stalled mid-storm on an H200, sliding-window pool 92% full, no line logged for 4.5 minutes.
# sglang's soft watchdog logs the scheduler's state and a py-spy dump (the bundle carries py-spy) of a forward that
# has not finished in 60 s, and lets it go on: a stall is then told apart from a stuck kernel.
_EVERY_SERVER = ["--swa-full-tokens-ratio", "0.5", "--soft-watchdog-timeout", "60"]
LAYOUTS = {
    "kernel_layer_first": ["--hicache-io-backend", "kernel", "--hicache-mem-layout", "layer_first"],
    "kernel_page_first": ["--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"],
    "direct": ["--hicache-io-backend", "direct", "--hicache-mem-layout", "page_first_direct"],
}


def _spec(name: str, index_k: str, hicache: list[str] | None, fault: str = "") -> ServerSpec:
    env = {"DSV4_SM120_INDEX_K_CHECKSUM": "1"}
    if fault:
        env.update({"DSV4_TEST_FAULT": fault, "PYTHONPATH": f"{FAULTS_DIR}:{os.environ.get('PYTHONPATH', '')}"})
    # Eager: the copies under test do not run in the decode graph, and eager servers start in a fraction of the
    # time on a cold JIT cache.
    # The servers without HiCache are the reference: a device pool 4x larger, so they never wait on memory.
    pool = 32768 if hicache is not None else 4 * 32768
    return ServerSpec(name, "hicache", "dsv4", graphs=False, index_k=index_k, mem_fraction=0.3, max_total_tokens=pool,
                      context_length=8192, max_running=WAVE, chunked_prefill=4096,
                      extra_args=_EVERY_SERVER + ((_HICACHE + hicache) if hicache is not None else []), extra_env=env)


def specs() -> list[ServerSpec]:
    out = [_spec(f"hc_{name}", "bf16", args) for name, args in LAYOUTS.items()]
    out += [_spec("off", "bf16", None), _spec("hc_kernel_layer_first_fp8", "fp8", LAYOUTS["kernel_layer_first"]),
            _spec("off_fp8", "fp8", None),
            _spec("control_planted_page", "bf16", LAYOUTS["kernel_layer_first"], fault="plant_one_page"),
            _spec("control_fence_off", "bf16", LAYOUTS["kernel_layer_first"], fault="fence_off")]
    return out


def scrape(url: str) -> dict:
    """The package's index-K integrity series on a server's /metrics (summed over label sets)."""
    text = traffic.get_text(url, "/metrics")
    out = {}
    for name in METRICS:
        pattern = re.compile(rf"^sglang:dsv4_{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
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
    interleave and prefixes keep leaving the device), then cut into waves of ``WAVE``."""
    for rnd in range(ROUNDS):
        order = list(range(SESSIONS))
        random.Random(rnd).shuffle(order)
        for w in range(0, SESSIONS, WAVE):
            yield rnd, w // WAVE, order[w:w + WAVE]


def storm(url: str, deadline: float = float("inf")) -> dict:
    """The storm on one server: per wave its requests' digests (or errors), plus the integrity counters; no
    wave starts after ``deadline`` (time.monotonic())."""
    vocab = models.config("hicache")["vocab_size"]
    prefixes = [traffic.prompt(31000 + g, PREFIX_TOKENS, vocab) for g in range(GROUPS)]
    history = {s: list(prefixes[s % GROUPS]) for s in range(SESSIONS)}
    before = scrape(url)
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
                continue
            waves.append([traffic.digest(r) for r in results])
            for s, prompt_ids, r in zip(sessions, ids, results):
                history[s] = prompt_ids + traffic.output_ids(r)
    finally:
        canceller.stop.set()
        canceller.join(10)
    out = {"waves": waves, "failed_waves": failed, "stalled": stalled, "seconds": round(time.monotonic() - t0, 1),
           "waves_answered": sum(w is not None for w in waves), "requests": sum(len(w) for w in waves if w),
           "cancelled_streams": canceller.sent}
    try:
        after = scrape(url)
        out["metrics"] = ({k: after[k] - before[k] for k in METRICS if not k.endswith("quarantined")}
                          | {"index_k_pages_quarantined": after["index_k_pages_quarantined"]})
    except traffic.RequestFailed as exc:  # a server gone after its storm: its waves still count
        out["metrics"] = {"error": str(exc)[:600]}
    return out


def agreement(a: dict, b: dict) -> dict:
    """Requests whose greedy tokens are equal on two servers' storms (waves that failed on either skipped)."""
    same = total = 0
    for wa, wb in zip(a["waves"], b["waves"]):
        if wa is None or wb is None:
            continue
        same += sum(x == y for x, y in zip(wa, wb))
        total += len(wa)
    return {"equal": same, "compared": total}


def run(servers: dict, logs: dict, work_dir=None, out: dict | None = None) -> dict:
    """Every server's storm at once, each on its own thread (``out`` filled as each ends), then the comparisons
    with HiCache off over the waves both servers answered."""
    out = out if out is not None else {}
    summaries, storms = out.setdefault("storms", {}), {}
    budget = float(os.environ.get("DSV4_GPU_STORM_SECONDS", "inf"))
    deadline = time.monotonic() + budget
    out["storm_budget_s"] = budget

    def one(name: str, url: str) -> None:
        try:
            storms[name] = storm(url, deadline)
            summaries[name] = storms[name]  # the waves' digests too: any two servers can be compared later
        except Exception as exc:  # one server's broken storm is reported; the others go on
            summaries[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    threads = [threading.Thread(target=one, args=item, daemon=True) for item in servers.items()]
    for t in threads:
        t.start()
    for t in threads:  # a wave in flight at the deadline has its timeout to answer (every wave has one)
        t.join(None if budget == float("inf") else max(0.0, deadline - time.monotonic()) + WAVE_TIMEOUT_S + 60)
    storms = dict(storms)  # a storm still running past its bound is left out of the comparisons
    off = {n: "off_fp8" if n.endswith("_fp8") else "off" for n in storms if n.startswith(("hc_", "control_"))}
    out["outputs_vs_off"] = {n: agreement(storms[n], storms[o]) for n, o in off.items() if o in storms}
    out["mismatch_lines"] = {n: [ln for ln in logs[n]().splitlines() if "index-K checksum mismatch" in ln][:5]
                             for n in servers}
    return out

"""The ``abort_safety`` set: do the requests that survive an 80-session kill on a PD cluster decode on their own KV?

Why: killing an 80-session agent aborts rooms whose NIXL writes may still be on their way. A decode that
hands such a room's pages to a new request before the write lands serves that request on another
request's KV and index keys, with nothing logged. Integrity mode's late-write check (``DSV4_SM120_INDEX_K_
CHECKSUM=1``, :mod:`dsv4_sm120.index_k.pd_late_writes`) re-reads every request's received pages while it
decodes; this set runs it where the incident happened.

Each target is two prefills (HiCache on) and one decode (CUDA graphs), bf16 keys, integrity mode on every
server, behind the PD router. The first prefill carries the test-only fault ``slow_send``
(``tests/gpu_server/faults``): one KV send in :data:`FAULT_EVERY` is posted :data:`FAULT_DELAY_S` late, so a
room aborted meanwhile still has its write on the way. Two prefills, because from one prefill rank to one
decode rank upstream's transfer worker finishes a room's writes before it starts the next room's: a page
reused by a later room of the same prefill is rewritten by that room after the late write, never before.

Targets, at once on one GPU:

- ``control``: ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0``: the decode frees an aborted room's pages
  at once. The check must count late writes and fail their requests.
- ``fixes_off``: ``DSV4_SM120_NIXL_HARDENING=0`` and ``DSV4_SM120_COLLECTIVE_GUARD=0``, upstream's deferred release
  with a :data:`RELEASE_TIMEOUT_S` timeout (shorter than the fault's delay): what upstream's release at the
  timeout does.
- ``defaults``: the package's defaults with the same timeout: the pages of a room past it stay quarantined until
  the prefill acknowledges the drained write.

Traffic per target: :data:`STREAM_SESSIONS` agent sessions stream through the router for the whole kill phase
(new requests during every kill); :data:`KILLS` rounds of 80 agent sessions killed as in the ``incident`` set;
then :data:`MULTI_TURN_SESSIONS` multi-turn sessions. Recorded: each kill (what the servers held, a fresh
request, /health), the streams' and multi-turn figures, the counters of all three servers, the late-write lines
of the decode's log, what is left once settled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_server import incident, pd
from bench.gpu_server.servers import ServerSpec, free_port, start
from tests.e2e import checks, cluster, scrape

FAULT_EVERY, FAULT_DELAY_S = 3, 1.5
RELEASE_TIMEOUT_S = 1
KILLS = 3
STREAM_SESSIONS, STREAM_S = 16, 120.0  # new sessions through the router while the kills happen
MULTI_TURN_SESSIONS, MULTI_TURN_S = 64, 60.0
SETTLE_S = 90.0
FAULTS_DIR = Path(__file__).resolve().parents[2] / "tests" / "gpu_server" / "faults"
DEFERRED = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
TARGETS = {
    "control": {DEFERRED: "0"},
    "fixes_off": {f"{DEFERRED}_TIMEOUT": str(RELEASE_TIMEOUT_S), "DSV4_SM120_NIXL_HARDENING": "0",
                  "DSV4_SM120_COLLECTIVE_GUARD": "0"},
    "defaults": {f"{DEFERRED}_TIMEOUT": str(RELEASE_TIMEOUT_S)},
}
EVERY_SERVER = {"DSV4_SM120_INDEX_K_CHECKSUM": "1"}
WATCHED = ("sglang:dsv4_pd_", "sglang:dsv4_nixl_abort_acks", "sglang:dsv4_nixl_rooms_parked",
           "sglang:dsv4_index_k_pd_")


def _fault_env() -> dict:
    return {"DSV4_TEST_FAULT": "slow_send", "DSV4_TEST_FAULT_SEND_EVERY": str(FAULT_EVERY),
            "DSV4_TEST_FAULT_SEND_DELAY_S": str(FAULT_DELAY_S),
            "PYTHONPATH": f"{FAULTS_DIR}:{os.environ.get('PYTHONPATH', '')}"}


def start_trio(tag: str, switches: dict, models_root: Path, tokenizer: Path, log_dir: Path,
               mem_fraction: float | None) -> tuple[pd.Pair, object]:
    """Two prefills (the first with the slow-send fault) and a decode, started (not waited for)."""
    started, boots = [], []
    (p_fields, p_args), (d_fields, d_args) = incident.PAIR_SHAPE["prefill"], incident.PAIR_SHAPE["decode"]
    roles = [("prefill", "_slow", p_fields, p_args, _fault_env()), ("prefill", "_b", p_fields, p_args, {}),
             ("decode", "", d_fields, d_args, {})]
    try:
        for mode, suffix, fields, args, extra in roles:
            boot = free_port()
            boots.append(boot)
            spec = ServerSpec(f"{mode}{suffix}_{tag}", incident.PAIR_SHAPE["model"], "dsv4", tokenizer=tokenizer,
                              extra_args=["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl",
                                          "--disaggregation-bootstrap-port", str(boot), *args],
                              extra_env={**EVERY_SERVER, **switches, **extra},
                              **{**fields, **({} if mem_fraction is None else {"mem_fraction": mem_fraction})})
            started.append(start(spec, models_root, log_dir))
    except BaseException:
        for s in started:
            s.proc.stop()
        raise
    slow, other, decode = (s.proc for s in started)
    fix = " ".join(f"{k}={v}" for k, v in switches.items()) or "default"
    c = cluster.Cluster(pd.processes.ServerSet([slow, other, decode]), front="", prefill=slow, decode=decode,
                        bootstrap_port=boots[0], tp=1, switches=dict(switches))
    return pd.Pair(f"_{tag}", fix, started, c), (other, boots[1])


def serve(pair: pd.Pair, other, log_dir: Path) -> None:
    """The router in front of both prefills and the decode, then a chat through it."""
    pair.healthy.result()
    c = pair.cluster
    router = c.servers.add(cluster.pd_router(sys.executable, c.prefill, c.decode, c.bootstrap_port, log_dir,
                                             pair.tag, more_prefills=[other]))
    router.start(dict(os.environ))
    c.router, c.front = router, router.url
    router.wait_ready("/health", pd.ROUTER_S)
    cluster.wait_serving(c, pd.SERVING_S)


def counters(pair: pd.Pair, other) -> dict[str, float]:
    """The abort-safety counters of the three servers, by ``name@server``."""
    out = {}
    for proc in (pair.cluster.prefill, other[0], pair.cluster.decode):
        samples = scrape.metrics(proc.url)
        for name in scrape.names(samples):
            if name.startswith(WATCHED):
                out[f"{name}@{proc.name}"] = scrape.total(samples, name)
    return out


def _stream(pair: pd.Pair, work: Path, seconds: float) -> subprocess.Popen:
    extra = ("--turns", "50", "--level-seconds", str(seconds))
    return subprocess.Popen([*pd.CLI, "agent-bench", *incident._agent(pair, STREAM_SESSIONS, extra),
                             "--out", str(work / f"agent_stream{pair.tag}.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _agent_figures(path: Path) -> dict:
    import json

    if not path.exists():
        return {"error": "the agent wrote nothing"}
    level = json.loads(path.read_text())["levels"][0]
    level.pop("server_counter_deltas", None)
    return level


def run_target(pair: pd.Pair, other, log_dir: Path, work: Path, res: dict) -> None:
    """One target's traffic into ``res`` (an exception is its ``error``; the figures so far stay)."""
    try:
        serve(pair, other, log_dir)
        before = counters(pair, other)
        stream = _stream(pair, work, STREAM_S)
        t0 = time.monotonic()
        res["kills"] = [incident.kill_round(pair, work, k) for k in range(1, KILLS + 1)]
        res["kill_phase_s"] = round(time.monotonic() - t0, 1)
        try:
            stream.wait(STREAM_S + 240)
        except subprocess.TimeoutExpired:
            stream.kill()
        res["stream"] = _agent_figures(work / f"agent_stream{pair.tag}.json")
        extra = ("--turns", "20", "--level-seconds", str(MULTI_TURN_S))
        res["multi_turn"] = pd.agent_level(incident._agent(pair, MULTI_TURN_SESSIONS, extra),
                                           work / f"agent_multi_turn{pair.tag}.json", MULTI_TURN_S + 240)
        res["leftovers"] = checks.settle(pair.cluster, timeout=SETTLE_S)
        res["health"] = checks.health(pair.cluster)
        after = counters(pair, other)
        res["counter_deltas"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))
                                 if after.get(k, 0.0) != before.get(k, 0.0) or "late_write" in k}
        res["gauges_after"] = {k: v for k, v in after.items() if "quarantined@" in k or "tokens_quarantined" in k}
        res["decode_log"] = pd._log_lines(pair.cluster.decode, "PD late write", "quarantined", "PD late-write check",
                                          keep=12)
        res["slow_prefill_log"] = pd._log_lines(pair.cluster.prefill, "dsv4_test_faults", keep=2)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    res["dead_after"] = pair.cluster.servers.dead()


def run(models_root: Path, log_dir: Path, startup_timeout: float, servers: dict, out: dict,
        mem_fraction: float | None = None, ready=None) -> None:
    """Start every target's three servers, run each target's traffic at once, stop all."""
    work, tokenizer = pd.prepare(log_dir, out)
    out["shared_gpu"] = f"{len(TARGETS)} targets of three servers each, at once on one GPU"
    out["fault"] = {"name": "slow_send", "every": FAULT_EVERY, "delay_s": FAULT_DELAY_S, "on": "the first prefill"}
    pairs: list[pd.Pair] = []
    others: dict[str, tuple] = {}  # a target's tag -> its second prefill and that prefill's bootstrap port
    try:
        for tag, switches in TARGETS.items():
            pair, others[f"_{tag}"] = start_trio(tag, switches, models_root, tokenizer, log_dir, mem_fraction)
            pairs.append(pair)
            servers.update(pair.launches())
        results = out["targets"] = {pair.tag[1:]: {"fix": pair.fix} for pair in pairs}
        incident.serve_at_once(pairs, startup_timeout, ready,
                               lambda p: run_target(p, others[p.tag], log_dir, work, results[p.tag[1:]]))
    finally:
        for pair in pairs:
            pair.cluster.stop()
            servers.update(pair.launches())

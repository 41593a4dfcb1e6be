"""The ``abort_safety`` set: do the requests that survive an 80-session kill on a PD cluster decode on their own KV?

Why: killing an 80-session agent aborts rooms whose NIXL writes may still be on their way. A decode that
hands such a room's pages to a new request before the write lands serves that request on another
request's KV and index keys, with nothing logged. Integrity mode's late-write check (``DSV4_SM120_INDEX_K_
CHECKSUM=1``, :mod:`dsv4_sm120.index_k.pd_late_writes`) re-reads every request's received pages while it
decodes; this set runs it where the incident happened.

Each target is two prefills (HiCache on) and one decode (CUDA graphs), bf16 keys, integrity mode on every
server, behind the PD router. The first prefill carries the test-only fault ``slow_send``
(``harness/faults``): one KV send in :data:`FAULT_EVERY` is posted :data:`FAULT_DELAY_S` late, so a
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
then :data:`MULTI_TURN_SESSIONS` multi-turn sessions; then the top-k lane. Recorded: each kill (what the servers
held, a fresh request, /health), the streams' and multi-turn figures, the counters of all three servers, the
late-write lines of the decode's log, what is left once settled.

The top-k lane: do the requests served right after a kill decode on their own KV? Each target has a second,
eager decode that returns the indexer's selections (``--enable-return-indexer-topk``), outside the router, with
a pool of :data:`LANE_POOL` tokens (one request of the lane's length at a time, so the next request gets the
pages the last one held). Each of :data:`LANE_ROUNDS` rounds sends :data:`VICTIMS` requests from the slow prefill
to it (every send now :data:`LANE_DELAY_S` late, through the fault's control file), aborts them all
:data:`CUT_AFTER_S` after the first holds pages there, and sends :data:`PROBES_PER_ROUND` probes from the other
prefill, one at a time: alone on both servers, so that their numerics are those of a request served alone.
A reference pair (a prefill and the same eager decode, no fault, no kill) serves every probe alone too. Compared:
each probe's selections in the rows its decode computed (from its prompt's length on), equal or not. The control
and fixes-off lanes' decodes run without the late-write check, so a late write shows in the selections;
the defaults' runs with it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_server import incident, pd, traffic
from bench.gpu_server.servers import ServerSpec, Started, free_port, start
from harness import checks, cluster, dsv4_checkpoints, faults, scrape

FAULT_EVERY, FAULT_DELAY_S = 3, 1.5
RELEASE_TIMEOUT_S = 1
KILLS = 5
STREAM_SESSIONS, STREAM_S = 16, 120.0  # new sessions through the router while the kills happen
MULTI_TURN_SESSIONS, MULTI_TURN_S = 64, 60.0
SETTLE_S = 90.0
DEFERRED = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
TARGETS = {
    "control": {DEFERRED: "0"},
    "fixes_off": {f"{DEFERRED}_TIMEOUT": str(RELEASE_TIMEOUT_S), "DSV4_SM120_NIXL_HARDENING": "0",
                  "DSV4_SM120_COLLECTIVE_GUARD": "0"},
    "defaults": {f"{DEFERRED}_TIMEOUT": str(RELEASE_TIMEOUT_S)},
}
# a run of some targets only (a GPU host with less time): DSV4_GPU_ABORT_TARGETS=control,defaults
ONLY = [t for t in os.environ.get("DSV4_GPU_ABORT_TARGETS", "").split(",") if t]
# the top-k lane alone (no graph decode, router, kills or sessions): DSV4_GPU_ABORT_LANE_ONLY=1
LANE_ONLY = os.environ.get("DSV4_GPU_ABORT_LANE_ONLY", "0") == "1"
EVERY_SERVER = {"DSV4_SM120_INDEX_K_CHECKSUM": "1"}
# the top-k lane (see the module doc)
LANE_POOL = 4096  # tokens: one lane request (PROBE_TOKENS + PROBE_NEW) fits, two do not
PROBE_TOKENS, PROBE_NEW = 2300, 16  # past SELECTIVE_FROM, so every row the decode computes selects
SELECTIVE_FROM = 4 * 512 + 64
VICTIMS, PROBES_PER_ROUND = 8, 40
LANE_ROUNDS = int(os.environ.get("DSV4_GPU_ABORT_LANE_ROUNDS", "5"))
LANE_DELAY_S, CUT_AFTER_S, VICTIM_WAIT_S = 3.0, 0.8, 30.0
LANE_CHECKED = {"control": False, "fixes_off": False, "defaults": True}
LANE_SHAPE = ({"graphs": False, "max_total_tokens": LANE_POOL, "context_length": LANE_POOL, "max_running": 80},
              ["--swa-full-tokens-ratio", "0.5", "--enable-return-indexer-topk"])
WATCHED = ("sglang:dsv4_pd_", "sglang:dsv4_nixl_abort_acks", "sglang:dsv4_nixl_rooms_parked",
           "sglang:dsv4_index_k_pd_")


@dataclass
class Side:
    """What a target has besides its pair: the second prefill, the lane's decode, the fault's control file."""

    other: object  # the second prefill (no fault)
    other_boot: int
    lane: object  # the eager decode returning selections, outside the router
    control: Path  # while it exists, the slow prefill's fault reads its knobs from it


def _fault_env(control: Path) -> dict:
    return {"DSV4_TEST_FAULT": "slow_send", "DSV4_TEST_FAULT_SEND_EVERY": str(FAULT_EVERY),
            "DSV4_TEST_FAULT_SEND_DELAY_S": str(FAULT_DELAY_S), "DSV4_TEST_FAULT_SEND_CONTROL": str(control),
            "PYTHONPATH": faults.pythonpath()}


def _spec(name: str, fields: dict, args: list, env: dict, tokenizer: Path, mem_fraction: float | None,
          mode: str, boot: int) -> ServerSpec:
    return ServerSpec(name, incident.PAIR_SHAPE["model"], "dsv4", tokenizer=tokenizer,
                      extra_args=["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl",
                                  "--disaggregation-bootstrap-port", str(boot), *args], extra_env=env,
                      **{**fields, **({} if mem_fraction is None else {"mem_fraction": mem_fraction})})


def start_trio(tag: str, switches: dict, models_root: Path, tokenizer: Path, log_dir: Path,
               mem_fraction: float | None) -> tuple[pd.Pair, Side]:
    """Two prefills (the first with the slow-send fault), a decode and the lane's decode, started (not waited
    for)."""
    started: list[Started] = []
    boots = []
    control = Path(log_dir) / f"slow_send_{tag}.knobs"
    (p_fields, p_args), (d_fields, d_args) = incident.PAIR_SHAPE["prefill"], incident.PAIR_SHAPE["decode"]
    lane_env = {} if LANE_CHECKED[tag] else {"DSV4_SM120_INDEX_K_CHECKSUM": "0"}
    roles = [("prefill", "prefill_slow", p_fields, p_args, _fault_env(control)),
             ("prefill", "prefill_b", p_fields, p_args, {}), ("decode", "decode", d_fields, d_args, {}),
             ("decode", "decode_topk", *LANE_SHAPE, lane_env)]
    if LANE_ONLY:
        del roles[2]
    try:
        for mode, role, fields, args, extra in roles:
            boots.append(free_port())
            env = {**EVERY_SERVER, **switches, **extra}
            started.append(start(_spec(f"{role}_{tag}", fields, args, env, tokenizer, mem_fraction, mode, boots[-1]),
                                 models_root, log_dir))
    except BaseException:
        for s in started:
            s.proc.stop()
        raise
    procs = [s.proc for s in started]
    slow, other, lane = procs[0], procs[1], procs[-1]
    decode = lane if LANE_ONLY else procs[2]
    fix = " ".join(f"{k}={v}" for k, v in switches.items()) or "default"
    c = cluster.Cluster(pd.processes.ServerSet(procs), front="", prefill=slow, decode=decode,
                        bootstrap_port=boots[0], tp=1, switches=dict(switches))
    return pd.Pair(f"_{tag}", fix, started, c), Side(other, boots[1], lane, control)


def start_reference(models_root: Path, tokenizer: Path, log_dir: Path, mem_fraction: float | None) -> pd.Pair:
    """A prefill and the lane's eager decode, no fault, never killed: the probes' reference."""
    shape = {"model": incident.PAIR_SHAPE["model"], "env": dict(EVERY_SERVER),
             "prefill": incident.PAIR_SHAPE["prefill"], "decode": LANE_SHAPE}
    return pd.start_pair("_reference", {}, models_root, tokenizer, log_dir, mem_fraction, shape)


def serve(pair: pd.Pair, side: Side, log_dir: Path) -> None:
    """The router in front of both prefills and the decode (not the lane's), then a chat through it."""
    pair.healthy.result()
    c = pair.cluster
    router = c.servers.add(cluster.pd_router(sys.executable, c.prefill, c.decode, c.bootstrap_port, log_dir,
                                             pair.tag, more_prefills=[(side.other, side.other_boot)]))
    router.start(dict(os.environ))
    c.router, c.front = router, router.url
    router.wait_ready("/health", pd.ROUTER_S)
    cluster.wait_serving(c, pd.SERVING_S)


def counters(pair: pd.Pair, side: Side) -> dict[str, float]:
    """The abort-safety counters of the four servers, by ``name@server``."""
    out = {}
    for proc in (pair.cluster.prefill, side.other, pair.cluster.decode, side.lane):
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


def probe_ids(r: int, i: int) -> list[int]:
    """The ``i``-th probe of round ``r``: the same prompt on every lane and on the reference."""
    return traffic.prompt(61000 + 100 * r + i, PROBE_TOKENS, dsv4_checkpoints.config(incident.PAIR_SHAPE["model"])["vocab_size"])


def ask_probe(prefill, decode, boot: int, r: int, i: int) -> dict:
    """One probe alone: its own-forward selections (the rows from its prompt's length on), or its error."""
    cfg = dsv4_checkpoints.config(incident.PAIR_SHAPE["model"])
    ids = probe_ids(r, i)
    try:
        result = traffic.pd_generate(prefill.url, decode.url, boot, ids, PROBE_NEW, room=random.getrandbits(62),
                                     return_indexer_topk=True)
    except traffic.RequestFailed as exc:
        return {"round": r, "i": i, "error": str(exc)[:600], "http_500": " 500" in str(exc)[:300]}
    return {"round": r, "i": i,
            "selections": traffic.own_selections(result, len(ids), dsv4_checkpoints.c4_layers(incident.PAIR_SHAPE["model"]),
                                                 cfg["index_topk"])}


def _held_in_transfer(lane) -> float:
    samples = scrape.metrics(lane.url)
    return scrape.total(samples, "sglang:num_decode_transfer_queue_reqs")


def lane_round(pair: pd.Pair, side: Side, r: int) -> tuple[dict, list]:
    """Victims from the slow prefill into the lane's decode, all aborted once the first holds pages there; then
    the round's probes from the other prefill, one at a time. (The round's figures, its probes.)"""
    slow, boot = pair.cluster.prefill, pair.cluster.bootstrap_port
    side.control.write_text(f"1 {LANE_DELAY_S}")
    rids = [f"victim-{pair.tag[1:]}-{r}-{v}" for v in range(VICTIMS)]

    def victim(v: int) -> None:
        try:
            traffic.pd_generate(slow.url, side.lane.url, boot, probe_ids(1000 + r, v), PROBE_NEW,
                                room=random.getrandbits(62), rid=rids[v], timeout=VICTIM_WAIT_S + 60)
        except traffic.RequestFailed:  # aborted: what a victim is for
            pass

    threads = [threading.Thread(target=victim, args=(v,), daemon=True) for v in range(VICTIMS)]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        held = 0.0
        while time.monotonic() - t0 < VICTIM_WAIT_S and not (held := _held_in_transfer(side.lane)):
            time.sleep(0.05)
        time.sleep(CUT_AFTER_S)
        for rid in rids:
            for proc in (slow, side.lane):
                try:
                    traffic.request(proc.url, "/abort_request", {"rid": rid}, timeout=10)
                except traffic.RequestFailed:
                    pass
        cut = time.monotonic()
        probes = []
        for i in range(PROBES_PER_ROUND):
            probes.append({**ask_probe(side.other, side.lane, side.other_boot, r, i),
                           "after_cut_s": round(time.monotonic() - cut, 2)})
    finally:
        side.control.unlink(missing_ok=True)
    for t in threads:
        t.join(VICTIM_WAIT_S)
    return {"round": r, "victims_in_transfer_at_cut": held, "cut_after_s": round(cut - t0, 2)}, probes


def reference_probes(pair: pd.Pair, res: dict) -> None:
    """Every lane probe, alone, on the reference pair (which sees no kill), into ``res``."""
    try:
        pair.healthy.result()
        c = pair.cluster
        res["probes"] = [ask_probe(c.prefill, c.decode, c.bootstrap_port, r, i)
                         for r in range(1, LANE_ROUNDS + 1) for i in range(PROBES_PER_ROUND)]
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    res["dead_after"] = pair.cluster.servers.dead()


def _storm(pair: pd.Pair, work: Path, res: dict) -> None:
    """Sessions streaming through :data:`KILLS` kills of an 80-session agent, then the multi-turn sessions."""
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


def run_target(pair: pd.Pair, side: Side, log_dir: Path, work: Path, res: dict) -> None:
    """One target's traffic into ``res``: the storm through the router (unless :data:`LANE_ONLY`), then the top-k
    lane (an exception is its ``error``; the figures so far stay)."""
    try:
        if LANE_ONLY:
            pair.healthy.result()
        else:
            serve(pair, side, log_dir)
        before = counters(pair, side)
        if not LANE_ONLY:
            _storm(pair, work, res)
        res["lane_rounds"], res["probes"] = [], []
        for r in range(1, LANE_ROUNDS + 1):
            figures, probes = lane_round(pair, side, r)
            res["lane_rounds"].append(figures)
            res["probes"] += probes
        if not LANE_ONLY:
            res["leftovers"] = checks.settle(pair.cluster, timeout=SETTLE_S)
            res["health"] = checks.health(pair.cluster)
        after = counters(pair, side)
        moved = checks.delta(before, after)  # and the late-write counters at 0: that zero is a finding
        res["counter_deltas"] = {k: moved.get(k, 0.0) for k in sorted(set(before) | set(after))
                                 if k in moved or "late_write" in k}
        res["gauges_after"] = {k: v for k, v in after.items() if "quarantined@" in k or "tokens_quarantined" in k}
        decodes = [side.lane] if pair.cluster.decode is side.lane else [pair.cluster.decode, side.lane]
        res["decode_log"] = {proc.name: pd._log_lines(proc, "PD late write", "quarantined", "PD late-write check",
                                                      keep=12) for proc in decodes}
        res["slow_prefill_log"] = pd._log_lines(pair.cluster.prefill, "dsv4_test_faults", keep=2)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    res["dead_after"] = pair.cluster.servers.dead()


def _rows_differing(p: dict, q: dict) -> int:
    if not p.get("selections") or not q.get("selections"):
        return 0
    return sum(p["selections"][row] != q["selections"][row] for row in p["selections"] if row in q["selections"])


def compare_probes(results: dict, reference: dict) -> None:
    """Each lane's probes against the reference's (``topk_vs_reference``, and the probes whose rows differ),
    then the selections themselves leave the record."""
    ref = reference.get("probes") or []
    for res in results.values():
        probes = res.get("probes")
        if not probes:
            continue
        res["topk_vs_reference"] = traffic.topk_agreement(probes, ref, SELECTIVE_FROM)
        res["probes_differing"] = [
            {"round": p["round"], "i": p["i"], "after_cut_s": p.get("after_cut_s"), "rows_differing": n}
            for p, q in zip(probes, ref) if (n := _rows_differing(p, q))]
        res["probe_errors"] = [{k: p[k] for k in ("round", "i", "error", "http_500", "after_cut_s") if k in p}
                               for p in probes if "error" in p][:20]
        res["probes"] = len(probes)
    reference["probes"] = len(ref)


def run(models_root: Path, log_dir: Path, startup_timeout: float, servers: dict, out: dict,
        mem_fraction: float | None = None, ready=None) -> None:
    """Start every target's four servers and the reference pair, run each target's traffic at once (the
    reference serves the probes meanwhile), compare the probes, stop all."""
    work, tokenizer = pd.prepare(log_dir, out)
    out["shared_gpu"] = f"{len(ONLY or TARGETS)} targets of four servers each and a reference pair, at once on one GPU"
    out["fault"] = {"name": "slow_send", "every": FAULT_EVERY, "delay_s": FAULT_DELAY_S, "on": "the first prefill",
                    "lane": {"every": 1, "delay_s": LANE_DELAY_S}}
    out["lane"] = {"pool_tokens": LANE_POOL, "probe_tokens": PROBE_TOKENS, "probe_new_tokens": PROBE_NEW,
                   "victims": VICTIMS, "rounds": LANE_ROUNDS, "probes_per_round": PROBES_PER_ROUND,
                   "cut_after_s": CUT_AFTER_S, "rows_compared_from": SELECTIVE_FROM,
                   "late_write_check_on_lane": LANE_CHECKED}
    unknown = set(ONLY) - set(TARGETS)
    if unknown:
        raise ValueError(f"DSV4_GPU_ABORT_TARGETS names {sorted(unknown)}; the set has {list(TARGETS)}")
    pairs: list[pd.Pair] = []
    sides: dict[str, Side] = {}
    try:
        for tag, switches in TARGETS.items():
            if ONLY and tag not in ONLY:
                continue
            pair, sides[f"_{tag}"] = start_trio(tag, switches, models_root, tokenizer, log_dir, mem_fraction)
            pairs.append(pair)
            servers.update(pair.launches())
        reference = start_reference(models_root, tokenizer, log_dir, mem_fraction)
        pairs.append(reference)
        servers.update(reference.launches())
        results = out["targets"] = {pair.tag[1:]: {"fix": pair.fix} for pair in pairs if pair is not reference}
        ref = out["reference"] = {}

        def traffic_of(p: pd.Pair) -> None:
            if p is reference:
                reference_probes(p, ref)
            else:
                run_target(p, sides[p.tag], log_dir, work, results[p.tag[1:]])

        incident.serve_at_once(pairs, startup_timeout, ready, traffic_of)
        compare_probes(results, ref)
    finally:
        for pair in pairs:
            pair.cluster.stop()
            servers.update(pair.launches())

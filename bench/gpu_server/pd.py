"""The ``pd`` set: DeepSeek-V4 prefill/decode pairs over NIXL behind the PD router, under the CPU suite's PD scenarios.

Why: the CPU end-to-end suite (``tests/e2e``) puts real sglang PD servers through an abort storm, hostile frames at
the prefill's bootstrap socket and a decode killed mid-storm, but with a tiny Llama in host memory: no DeepSeek-V4
forward, no bf16 index-K pages, no GPU memory registered with NIXL. This set runs the same scenarios, through the
same code (``storm.py``, ``hostile.py``, ``decode_kill.py``, ``checks.py`` of ``harness/``), against
``--model-impl dsv4`` servers of the ``tiny`` checkpoint on one GPU, whose KV and index-K pages NIXL moves between
GPU buffers over UCX.

First ``dsv4-sm120 patch apply`` and ``patch check --require-applied`` on the sglang the servers import.
Servers: two pairs, started at once, each a prefill and a decode on the same GPU (``--disaggregation-transfer-backend
nixl``, bf16 keys, eager: they start in a fraction of the time on a cold JIT cache) and, once both are healthy, its
own PD router (``python -m sglang_router.launch_router --pd-disaggregation``). Every server has
``DSV4_SM120_INDEX_K_CHECKSUM=1`` and 30 s PD bootstrap and waiting timeouts (so the rooms of a dead decode are let
go within the scenario's bounds); the second pair also has ``DSV4_SM120_NIXL_HARDENING=0`` and waits, idle, for the
last scenario. The servers read the e2e suite's tiny byte-level tokenizer with DeepSeek-V4's special tokens: the
scenarios' clients speak chat, and sglang renders a DeepSeek-V4 chat with deepseek-recipe, which refuses a
tokenizer without them.

Scenarios, in this order (the destructive ones last), each recorded in the results as it ends; an exception is
its ``error``, and it is ``skipped`` when a process of its pair is dead or when less than it needs is left of
``DSV4_GPU_PD_SECONDS`` (default 720; on an H200 the five took ~650 s) counted from the first pair serving (``DSV4_GPU_PD_SCENARIOS``, comma-separated
names, runs only those: a later run can take what an earlier run's budget left out):

- ``a_abort_storm``: ``dsv4-sm120 storm-client``'s 80 sessions cut 3 times through the router, prompts of ~2,700
  tokens (past the 2,048 after which the top-512 selection is active), then a fresh request, /health on every
  process, nothing left on the servers' own gauges, recovery per round, the dsv4 counters' deltas.
- ``b_hostile_frames``: every kind of ``hostile.frames`` at the prefill's bootstrap rank socket while chats flow;
  what is served during and after, the refusals by reason (``sglang:dsv4_nixl_frames_rejected_total``).
- ``c_pd_checksum``: ``LONG_REQUESTS`` long chats at once; the PD checksum counters' deltas over them and over all
  the pair's traffic so far, and the servers' log lines saying the check is on (or found a mismatch).
- ``d_decode_killed``: ``kill -9`` of the decode mid-storm: the prefill's health, what it still holds (bounded by
  the 30 s timeouts), its room releases by reason, the same decode started again, a request served through the
  router.
- ``b_hostile_frames_hardening_off``: the same frames at the second pair: what upstream's bootstrap thread does
  (on the CPU it dies and every later request stalls); each request there gives up after
  ``HARDENING_OFF_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_server.servers import ServerSpec, Started, free_port, launch_line, processes, start, wait_healthy
from harness import checks, cluster, decode_kill, hostile, storm, tiny_model

CLI = [sys.executable, "-m", "dsv4_sm120.cli"]  # dsv4-sm120: the bundle carries the package, not its console script
PROMPT_WORDS = 700  # ~2,700 tokens in DeepSeek-V4's chat encoding with the tokenizer below
STORM_CLIENT = ("--cancel-after", "4", "--prompt-words", str(PROMPT_WORDS), "--storm-max-tokens", "4096",
                "--deadline", "60", "--probe-interval", "2",
                "--device", "a GPU host: DeepSeek-V4 tiny (dummy weights), PD over NIXL between GPU buffers")
STORM_S = 300.0  # the whole storm client: a baseline probe and three rounds, each within its --deadline
LONG_REQUESTS, LONG_MAX_TOKENS, LONG_TIMEOUT_S = 16, 32, 120.0
KILL_CLIENT = ("--cancel-after", "10", "--prompt-words", str(PROMPT_WORDS), "--storm-max-tokens", "4096",
               "--deadline", "15")
# A chat through the router after the decode is back takes up to 3 minutes: the router checks a worker's health
# every 60 s by default, and on an H200 a new decode that answered /health 48 s after its start was still
# refused by the router ("all circuits open or unhealthy") 60 s later. The prefill's last room went 112 s after
# the kill there (a request in flight to the dead decode held it until upstream failed it), past a 90 s wait.
KILL_AFTER_S, RELEASE_S, KILL_STORM_S, DECODE_RESTART_S, SERVE_AGAIN_S = 6.0, 150.0, 60.0, 240.0, 180.0
HARDENING_OFF_TIMEOUT_S = 20.0
CHAT_TIMEOUT_S, ROUTER_S, SERVING_S = 60.0, 60.0, 120.0  # a chat and a settle; the router up; its first chat
BUDGET_S = float(os.environ.get("DSV4_GPU_PD_SECONDS", "720"))
# Scenario names to run (comma-separated; default all): a later run can take one that an earlier run's budget left out
ONLY = {n for n in os.environ.get("DSV4_GPU_PD_SCENARIOS", "").split(",") if n}
NEEDS_S = {"a_abort_storm": 90, "b_hostile_frames": 30, "c_pd_checksum": 20, "d_decode_killed": 300,
           "b_hostile_frames_hardening_off": 60}

PAIR_ENV = {"DSV4_SM120_INDEX_K_CHECKSUM": "1", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}
# Both sides eager (they start in a fraction of the time on a cold JIT cache), ``tiny``, the env above.
PAIR_SHAPE = {"model": "tiny", "env": PAIR_ENV, "prefill": ({"graphs": False}, []), "decode": ({"graphs": False}, [])}
HARDENING_OFF = {"DSV4_SM120_NIXL_HARDENING": "0"}
OFF_SCENARIO = "b_hostile_frames_hardening_off"
ROOM_RELEASES = ("sglang:dsv4_nixl_aborted_rooms_released_total", "sglang:dsv4_nixl_orphan_rooms_released_total")
PD_CHECKSUM = ("sglang:dsv4_index_k_pd_pages_checked_total", "sglang:dsv4_index_k_pd_mismatches_total",
               "sglang:dsv4_index_k_pd_rooms_failed_total")
DSV4_IMAGE_TOKEN = "<｜deepseek_image｜>"  # sglang's spelling (parser/deepseek_recipe_renderer.py IMAGE_TOKEN)


def write_tokenizer(path: Path) -> Path:
    """The e2e suite's tiny tokenizer with DeepSeek-V4's special tokens as deepseek-recipe spells them (sglang renders
    a DeepSeek-V4 chat with it, and it refuses a tokenizer without them); bos and eos first: ids 0 and 1, as in
    ``tiny``'s config."""
    from deepseek_recipe import SpecialToken, SpecialTokens

    spelled = SpecialTokens(image=DSV4_IMAGE_TOKEN)
    bos, eos = spelled.token(SpecialToken.Bos), spelled.token(SpecialToken.Eos)
    every = {spelled.token(k) for k in vars(SpecialToken).values() if isinstance(k, SpecialToken)}
    tiny_model.write_tokenizer(path, {"bos_token": bos, "eos_token": eos}, tuple(sorted(every - {bos, eos})))
    return path


@dataclass
class Pair:
    """A prefill and a decode started together; ``cluster`` (the e2e suite's) is what the scenarios take."""

    tag: str
    fix: str
    started: list[Started]
    cluster: object
    healthy: Future | None = None  # wait_healthy of both, run in the background from their start

    def launches(self) -> dict:
        out = {s.spec.name: {"launch": launch_line(s), "healthy_after_s": s.healthy_after_s} for s in self.started}
        router = self.cluster.router
        if router is not None:
            out[router.name] = {"launch": " ".join(["python", *router.argv[1:]])}
        return out


def start_pair(tag: str, switches: dict, models_root: Path, tokenizer: Path, log_dir: Path,
               mem_fraction: float | None = None, shape: dict | None = None) -> Pair:
    """Start a prefill and a decode over NIXL (not waited for); ``mem_fraction`` overrides the share. ``shape``
    (default: this set's, :data:`PAIR_SHAPE`) gives the model, the base environment and, per mode, the
    :class:`ServerSpec` fields and extra arguments."""
    shape = shape or PAIR_SHAPE
    boot = free_port()
    pd_args = ["--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-port", str(boot)]
    started: list[Started] = []
    try:
        for mode in ("prefill", "decode"):
            fields, args = shape[mode]
            spec = ServerSpec(f"{mode}{tag}", shape["model"], "dsv4", tokenizer=tokenizer,
                              extra_args=["--disaggregation-mode", mode, *pd_args, *args],
                              extra_env={**shape["env"], **switches},
                              **{**fields, **({} if mem_fraction is None else {"mem_fraction": mem_fraction})})
            started.append(start(spec, models_root, log_dir))
    except BaseException:
        for s in started:
            s.proc.stop()
        raise
    prefill, decode = (s.proc for s in started)
    fix = " ".join(f"{k}={v}" for k, v in switches.items()) or "default"
    c = cluster.Cluster(processes.ServerSet([prefill, decode]), front="", prefill=prefill, decode=decode,
                        bootstrap_port=boot, tp=1, switches=dict(switches))
    return Pair(tag, fix, started, c)


def serve(pair: Pair, log_dir: Path) -> None:
    """Once both servers are healthy, the router in front, then a chat through it."""
    pair.healthy.result()
    c = pair.cluster
    router = c.servers.add(cluster.pd_router(sys.executable, c.prefill, c.decode, c.bootstrap_port, log_dir, pair.tag))
    router.start(dict(os.environ))
    c.router, c.front = router, router.url
    router.wait_ready("/health", ROUTER_S)
    cluster.wait_serving(c, SERVING_S)


def _log_lines(proc, *needles: str, since: int = 0, keep: int = 8) -> list[str]:
    """The first ``keep`` lines of ``proc``'s log past byte ``since`` that hold one of ``needles``."""
    with open(proc.log, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    return [ln[-300:] for ln in lines if any(n in ln for n in needles)][:keep]


def _scenario(out: dict, name: str, pair: Pair, deadline: float, body) -> None:
    """``body(res)`` fills ``out[name]``; its exception becomes the scenario's error (the next one still runs)."""
    dead, left = pair.cluster.servers.dead(), deadline - time.monotonic()
    if ONLY and name not in ONLY:
        out[name] = {"skipped": "not in DSV4_GPU_PD_SCENARIOS"}
        return
    if dead:
        out[name] = {"skipped": f"dead before it: {dead}"}
        return
    if left < NEEDS_S[name]:
        out[name] = {"skipped": f"{left:.0f} s of the {BUDGET_S:.0f} s budget left, it needs {NEEDS_S[name]}"}
        return
    res = out[name] = {"fix": pair.fix}
    t0 = time.monotonic()
    try:
        body(res)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    res["seconds"] = round(time.monotonic() - t0, 1)
    res["dead_after"] = pair.cluster.servers.dead()


def abort_storm(pair: Pair, work: Path, res: dict) -> None:
    storm.run_and_check(CLI, pair.cluster, work, lambda scenario, fix, **figures: res.update(figures), pair.fix,
                        client=STORM_CLIENT, timeout=STORM_S)


def hostile_frames(pair: Pair, res: dict, timeout: float) -> None:
    c = pair.cluster
    since = c.prefill.log.stat().st_size
    res.update(hostile.during_traffic(c, list(hostile.frames(random.Random(7)).values()), timeout=timeout))
    res["leaks"] = checks.settle(c, timeout=timeout)
    res["prefill_log_errors"] = _log_lines(c.prefill, "Traceback", "Exception", "Error", since=since)


def long_text(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(PROMPT_WORDS))


def pd_checksum(pair: Pair, since: dict, res: dict) -> None:
    c = pair.cluster
    before = checks.dsv4_counters(c)
    with ThreadPoolExecutor(LONG_REQUESTS) as pool:
        answers = pool.map(lambda seed: cluster.chat(c.front, long_text(seed), LONG_MAX_TOKENS, LONG_TIMEOUT_S),
                           range(LONG_REQUESTS))
        statuses = [status for status, _ in answers]
    after = checks.dsv4_counters(c)
    res.update(requests=LONG_REQUESTS, completed=statuses.count(200), other=sorted(s for s in statuses if s != 200),
               deltas={k: after.get(k, 0.0) - before.get(k, 0.0) for k in PD_CHECKSUM},
               deltas_since_serving={k: after.get(k, 0.0) - since.get(k, 0.0) for k in PD_CHECKSUM},
               log_lines={p.name: _log_lines(p, "PD index-K integrity on", "PD index-K checksum mismatch")
                          for p in (c.prefill, c.decode)})


def decode_killed(pair: Pair, work: Path, res: dict) -> None:
    before = checks.dsv4_counters(pair.cluster)
    res.update(decode_kill.kill_decode_mid_storm(CLI, pair.cluster, work / "storm_decode_killed.json", KILL_CLIENT,
                                                 KILL_AFTER_S, DECODE_RESTART_S, release_s=RELEASE_S,
                                                 storm_s=KILL_STORM_S, serve_s=SERVE_AGAIN_S))
    after = checks.dsv4_counters(pair.cluster)
    # the prefill's bootstrap thread keeps these: the rooms the decode's ABORTs and the sweep let go, by reason
    res["prefill_room_releases"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))
                                    if k.startswith(ROOM_RELEASES)}


def patch_sglang() -> dict:
    """``dsv4-sm120 patch apply`` on the sglang these servers import (the collective guard lives in its overlap
    loops), then ``patch check --require-applied``, as the README has an operator do before a PD launch."""
    done = {}
    for step in (["patch", "apply"], ["patch", "check", "--require-applied"]):
        proc = subprocess.run(CLI + step, capture_output=True, text=True, timeout=120)
        done[" ".join(step)] = {"returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-800:]}
    return done


def agent_level(args: list[str], out: Path, timeout: float) -> dict:
    """One level of ``dsv4-sm120 agent-bench args`` (its JSON to ``out``): the level's figures, its exit status and
    the tokens HiCache loaded back meanwhile (its other counter deltas left out), or the error."""
    try:
        proc = subprocess.run([*CLI, "agent-bench", *args, "--out", str(out)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # a hung level is a finding of its own, not the end of the set
        tail = (exc.stderr or b"")[-1500:]
        return {"error": f"agent-bench did not end within {timeout:.0f}s: "
                         f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}"}
    if not out.exists():
        return {"error": f"agent-bench wrote nothing (exit {proc.returncode}): {proc.stderr[-1500:]}"}
    level = json.loads(out.read_text())["levels"][0]
    deltas = level.pop("server_counter_deltas")
    return {"returncode": proc.returncode, **level,
            "load_back_tokens": deltas.get("sglang:load_back_tokens_total", 0.0)}


def prepare(log_dir: Path, out: dict) -> tuple[Path, Path]:
    """What every set of PD pairs does first: its work folder, ``patch apply`` (recorded in ``out["patch"]``)
    and the servers' tokenizer; returns (work folder, tokenizer)."""
    work = log_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    out["patch"] = patch_sglang()
    return work, write_tokenizer(work / "tokenizer")


def run(models_root: Path, log_dir: Path, startup_timeout: float, servers: dict, out: dict,
        mem_fraction: float | None = None, ready=None) -> None:
    """Start both pairs, serve the first, run the scenarios in order (``out`` filled as each ends), stop all;
    ``servers`` gets every launch line. A first pair that does not serve ends the run with its error."""
    work, tokenizer = prepare(log_dir, out)
    pairs: list[Pair] = []
    waiting = ThreadPoolExecutor(2)
    try:
        wanted = [("", {})] + ([] if ONLY and OFF_SCENARIO not in ONLY else [("_hardening_off", HARDENING_OFF)])
        for tag, switches in wanted:  # the second pair only when its scenario runs
            pairs.append(start_pair(tag, switches, models_root, tokenizer, log_dir, mem_fraction))
            pairs[-1].healthy = waiting.submit(wait_healthy, pairs[-1].started, startup_timeout)
            servers.update(pairs[-1].launches())  # now: a run stopped while it stops its servers keeps them
        fixed, off = pairs[0], pairs[-1]
        serve(fixed, log_dir)
        if ready is not None:
            ready()
        since = checks.dsv4_counters(fixed.cluster)
        deadline = time.monotonic() + BUDGET_S
        out["budget_s"] = BUDGET_S
        if ONLY:
            out["scenarios_run"] = sorted(ONLY)
        _scenario(out, "a_abort_storm", fixed, deadline, lambda res: abort_storm(fixed, work, res))
        _scenario(out, "b_hostile_frames", fixed, deadline, lambda res: hostile_frames(fixed, res, CHAT_TIMEOUT_S))
        _scenario(out, "c_pd_checksum", fixed, deadline, lambda res: pd_checksum(fixed, since, res))
        _scenario(out, "d_decode_killed", fixed, deadline, lambda res: decode_killed(fixed, work, res))

        def hardening_off(res: dict) -> None:
            serve(off, log_dir)
            hostile_frames(off, res, HARDENING_OFF_TIMEOUT_S)

        _scenario(out, OFF_SCENARIO, off, deadline, hardening_off)
    finally:
        for pair in pairs:
            pair.cluster.stop()
            servers.update(pair.launches())
        waiting.shutdown()  # the waits end once their servers are stopped

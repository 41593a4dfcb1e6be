"""The collective guard with the forward's collectives on real NCCL, two GPU ranks.

On 2 ranks, one process and one GPU each (``torch.cuda.set_device(rank)``), the pin's real patched
overlap loops run through the patched-loop harness (``harness/pd_loop.py``; what is real
and what is replaced is listed there): the scheduler's collectives on the real gloo CPU group, the
``run_batch`` stand-in's on an NCCL group of their own, shaped as a DeepSeek-V4-Flash TP forward
(``ForwardShape``: per layer an all-reduce of [tokens, 4096] bf16 after attention and one after the
MoE, one after the vocab-parallel embedding, one all-gather of the sampled rows' logits shards; 43
layers, hidden size and vocabulary read from the pin's ``DeepSeekV4Config``; tokens from the real
batch). Ranks are spawned, not forked (CUDA does not survive a fork of a process that imported
sglang). NVLink multicast is off in every rank (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1) and in this process.

(a) guard off (``DSV4_SM120_COLLECTIVE_GUARD=0``: the patched loops run upstream's code) and (b) guard
on, over every injection point of ``bench/guard_injection_points.py`` at commit 6022e83 (removed since;
``harness.pd_loop.POINTS``: one divergence on rank 1 in an ``at_point`` scenario): per scenario whether it reconciled, hung
(located: per rank the collective and group it sat in, its main-thread stack, NCCL's flight
recorder entries not completed, NCCL's own timeout lines), was ended by the watchdog, or
desynchronised silently (the ranks' forward collectives paired across different batches). Guard-off
scenarios each get a fresh group (a hang leaves a group unusable), ``--parallel`` at a time.
(c) the guard's cost per iteration next to the forward stand-in's time per iteration, in one run:
one group alternates guard-off and guard-on rounds of a steady decode scenario (a forward every
iteration); NCCL forward time is the GPU time of its collectives (CUDA events).

Every wait is bounded: the scheduler's gloo group (``--sched-timeout-s``), the forward group's
collectives (``--forward-timeout-s``: gloo's timeout; NCCL's ``new_group(timeout=)`` with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which takes a rank down on a timed-out collective after
dumping the flight recorder, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), and each rank's watchdog
(``--stall-s``: records where the rank is, every thread's stack by faulthandler and the flight
recorder; ``--kill-s``: ends the rank). ``--backend gloo`` runs all of it with the forward group on
gloo, on a CPU: a stand-in for the NCCL run, labelled so in its JSON, never the NCCL result.

Here (CPU; the JSON committed as the gloo stand-in):
    .venv/bin/python -m bench.guard_nccl_2gpu --backend gloo \\
        --out bench/results/guard/guard_nccl_cpu-gloo-standin_$(date -u +%F).json

On a host with two GPUs (two H200s of one host were the target) whose image has torch 2.11 / python 3.12,
no sglang, pyzmq or flashinfer, and no network. On a networked machine, at the commit to run:
  1. ``bash bench/topk_poison_h200.sh pack`` (the top-k poison run's packer, at commit b8292e6 and removed
     since: first ``git checkout b8292e6 -- bench/topk_poison_h200.sh``) -> ``.devcarry/topk/pin_site.tar.xz``
     (sglang 0.5.23 trimmed to its python and data files, flashinfer 0.7.2, tvm_ffi built for the
     H200 image) and ``.devcarry/topk/wheels/`` (cp312 wheels of the import chain's pure and small
     packages the image lacks, pyzmq among them);
  2. the scheduler's import chain needs four more the top-k chain does not:
     ``python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
     -d .devcarry/guard_nccl/wheels setproctitle==1.3.8 uvicorn==0.54.0 fastapi==0.165.0
     opentelemetry-api==1.45.2`` (found by importing the chain on this CPU machine with only the
     image's packages, the top-k bundle and these visible; a CUDA host may import more: ``--standins`` below);
  3. copy the checkout with ``.devcarry/topk`` and ``.devcarry/guard_nccl`` to the GPU host and run, in the
     checkout, with ``OUT`` an output folder and COMMIT = ``git rev-parse HEAD`` of the networked machine::

       set -o pipefail; ulimit -c 0; export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \\
         TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; S=/tmp/site; mkdir -p $S \\
         && tar xJf .devcarry/topk/pin_site.tar.xz -C $S && python3 -m pip install -q --no-index \\
         --no-deps --no-compile --no-cache-dir --target $S .devcarry/topk/wheels/*.whl \\
         .devcarry/guard_nccl/wheels/*.whl && export PYTHONPATH=$S:$PWD/src:$PYTHONPATH \\
         && nvidia-smi -L && python3 -m bench.guard_nccl_2gpu --backend nccl --standins \\
         --commit COMMIT --out $OUT/guard_nccl_$(date -u +%F).json 2>&1 | tee $OUT/guard_nccl.log

     then commit the JSON (and the log) under ``bench/results/guard/``. ``--standins`` serves
     ``sgl_kernel`` and ``deep_gemm`` (not loadable on torch 2.11, never called by the harness) with
     the top-k run's raising stand-ins (``harness/topk_standins.py``), and any other module the chain
     misses there likewise, each named in the JSON's ``standins``; pyzmq is never stood in. Duration,
     estimated (never run on two GPUs): 4-6 minutes (each group's ranks import sglang; 20 guard-off groups,
     4 at a time). To run it in pieces, or when a run stops early (the JSON holds the parts that finished),
     run the rest with ``--parts on,cost`` (or ``--cases``) and commit both files.

Rehearsed here as far as a CPU allows: the whole run on gloo (the JSON above), and the GPU host's
software layout (``python -S`` with only the image's packages, the top-k bundle and these wheels on the
path, ``--start spawn --standins``): the spawned ranks import the trimmed pin and run the loops.
Not rehearsable here: NCCL itself, torch 2.11 (the venv has the pin's torch 2.14.1), a CUDA host's
import chain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import run_record
from harness import topk_standins

STANDINS_ENV = "DSV4_GUARD_BENCH_STANDINS"  # the stand-ins a --standins run installed, for its spawned ranks
GUARD_SWITCH = "DSV4_SM120_COLLECTIVE_GUARD"
NEVER_STOOD_IN = ("sglang", "dsv4_sm120", "torch", "zmq")  # the harness runs these for real

if os.environ.get(STANDINS_ENV):  # a spawned rank of a --standins run: the same stand-ins as its parent
    topk_standins.install_missing(tuple(os.environ[STANDINS_ENV].split(",")))


def _import_chain() -> None:
    import sglang.srt.configs.deepseek_v4  # noqa: F401
    import sglang.srt.disaggregation.decode  # noqa: F401
    import sglang.srt.disaggregation.prefill  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.plugins.hook_registry  # noqa: F401
    import sglang.srt.server_args  # noqa: F401
    import zmq  # noqa: F401

    import dsv4_sm120.guard.hooks  # noqa: F401


def standins_for_missing() -> list[str]:
    """Stand in ``sgl_kernel``/``deep_gemm`` when missing, then whatever else the chain's import misses."""
    named = list(topk_standins.install_missing())
    for _ in range(30):
        try:
            _import_chain()
            break
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if not top or top in named or top.startswith(NEVER_STOOD_IN):
                raise
            topk_standins.install_missing((top,))
            named.append(top)
            for mod in [m for m in sys.modules if m.split(".")[0] in ("sglang", "dsv4_sm120")]:
                del sys.modules[mod]  # partly imported: import again with the stand-in in place
    os.environ[STANDINS_ENV] = ",".join(named)
    return named


# ---- one scenario's record ------------------------------------------------------------------------
def _unfinished(recorder) -> list:
    return [e for e in recorder if e.get("state") != "completed"][:4] if isinstance(recorder, list) else recorder


def _ended_by(res, code, log: list[str]) -> str:
    if res is None:
        return f"no answer (exit code {code})"
    if res.status == "ok":
        return "finished"
    if res.status == "killed_by_watchdog":
        return "the stall watchdog"
    if res.status == "hang":
        return f"a collective timeout: {res.detail[:160]}"
    if res.status == "desync":
        return "finished, but its forward collectives paired with other batches' (silent)"
    if res.status == "failfast":
        return "the guard's fail-fast"
    if code == -6 and any("watchdog" in line.lower() for line in log):
        return "NCCL's watchdog: a collective timed out, TORCH_NCCL_ASYNC_ERROR_HANDLING took the rank down (SIGABRT)"
    if code is not None and code < 0:
        why = [line.strip() for line in log if "what()" in line or "terminate" in line]
        return f"{res.detail}: {why[-1][:220] if why else 'no message'}"
    return res.detail[:200]


def _fatal_frame(faulthandler_text: str) -> str | None:
    """Where the loop's thread was when the rank died of a fatal signal (faulthandler's dump)."""
    if "Fatal Python error" not in faulthandler_text:
        return None
    import re

    from harness import pd_loop as h

    for block in faulthandler_text.split("\n\n"):
        if "_run_loop" in block:  # innermost first; torch's frames and the trace's wrapper skipped
            for frame in re.finditer(r'File "(.*)", line (\d+) in (\S+)', block):
                if "/torch/" not in frame.group(1) and frame.group(3) != "traced":
                    return f"{h._short(frame.group(1))}:{frame.group(2)} {frame.group(3)}"
    return None


def _verdict(ranks: list[dict], guard_on: bool) -> str:
    statuses = [r["status"] for r in ranks]
    if all(s == "ok" for s in statuses):
        return "reconciled" if guard_on else "completed"
    for status, verdict in (("desync", "silent desync"), ("failfast", "failfast")):
        if status in statuses:
            return verdict
    if any(s in ("hang", "killed_by_watchdog") or r["ended_by"].startswith(("NCCL", "no answer"))
           for s, r in zip(statuses, ranks)):
        return "hung"
    if any(r["ended_by"].startswith("process died with signal") for r in ranks):
        return "aborted"
    return "error"


def scenario_row(case, res: dict, seed: int, world: int, guard_on: bool, seconds: float | None) -> dict:
    per_rank = res.get(seed) or [None] * world
    stalls = res.get("stalls", {})
    ranks = []
    for rank in range(world):
        r, info = per_rank[rank], stalls.get(rank, {})
        code = res["exits"].get(rank, (None, 0))[0]
        hung = info.get("hung")
        fatal = _fatal_frame(info.get("faulthandler", ""))
        ranks.append({
            "status": r.status if r else "no answer",
            "ended_by": _ended_by(r, code, info.get("log", [])),
            "exit_code": code,
            "located": hung["where"] if hung else (f"fatal signal: the loop was in {fatal}" if fatal else None),
            "stack": hung["main_stack"][-6:] if hung else [],
            "stall_after_s": info["stalls"][0]["idle_s"] if hung else None,  # when the watchdog first saw it
            "nccl_not_completed": _unfinished(hung["nccl_flight_recorder"]) if hung else None,
            "nccl_dump_on_timeout": _unfinished(info.get("nccl_dump_on_timeout")),
            "log": [line for line in info.get("log", []) if "dsv4-sm120 guard" not in line][:6],
            "guard_log": [line for line in info.get("log", []) if "dsv4-sm120 guard" in line][:3],
            "stall_records": len(info.get("stalls", [])),
            "iters": r.iters if r else None,
            "forward_ops": r.forward_ops if r else None,
            "injected": r.injected if r else None,
            "counters": r.counters if r else {},
        })
    loop, point, kind = case
    return {"loop": loop, "point": point, "kind": kind, "verdict": _verdict(ranks, guard_on),
            "seconds": None if seconds is None else round(seconds, 1), "ranks": ranks}


# ---- (a), (b), (c) ---------------------------------------------------------------------------------
def cases(only: str | None = None) -> list[tuple[str, str, str]]:
    """Every (loop, point, kind) of ``harness.pd_loop.POINTS``, or those ``--cases`` names."""
    from harness import pd_loop as h

    every = [(loop, point, kind) for loop, points in h.POINTS.items() for point, kinds in points.items()
             for kind in kinds]
    return every if not only else [c for c in every if ":".join(c) in only.split(",")]


def guard_off(args, forward, watch) -> list[dict]:
    """One fresh group per scenario (a hang ends the group), ``--parallel`` groups at a time."""
    from harness import pd_loop as h

    def one(case):
        started = time.monotonic()
        sc = h.at_point(*case)
        res = h.run_group(args.world, [(sc, "patched", {GUARD_SWITCH: "0"})], timeout_s=args.sched_timeout_s,
                          wall_s=args.wall_s, forward=forward, watch=watch, start=args.start)
        row = scenario_row(case, res, sc.seed, args.world, False, time.monotonic() - started)
        print(json.dumps({"guard": "off", **{k: row[k] for k in ("loop", "point", "kind", "verdict")},
                          "located": [x["located"] for x in row["ranks"]]}), flush=True)
        return row

    if args.parallel == 1:  # forked ranks: fork from the main thread only
        return [one(case) for case in cases(args.cases)]
    with ThreadPoolExecutor(args.parallel) as pool:
        return list(pool.map(one, cases(args.cases)))


def guard_on(args, forward, watch) -> list[dict]:
    """Every scenario in one group; a group stops at its first scenario that does not reconcile, and
    the scenarios after it go on in a fresh group."""
    from harness import pd_loop as h

    todo, rows = list(enumerate(cases(args.cases))), []
    while todo:
        jobs = []
        for i, case in todo:
            sc = h.at_point(*case)
            sc.seed = i
            jobs.append((sc, "patched", {GUARD_SWITCH: "1"}))
        res = h.run_group(args.world, jobs, timeout_s=args.sched_timeout_s, wall_s=args.wall_s + 60 * len(jobs),
                          forward=forward, watch=watch, start=args.start)
        answered = [(i, case) for i, case in todo if i in res]
        if not answered:
            rows += [{"loop": c[0], "point": c[1], "kind": c[2], "verdict": "not run (its group answered nothing)"}
                     for _, c in todo]
            break
        for i, case in answered:
            rows.append(scenario_row(case, res, i, args.world, True, None))
            print(json.dumps({"guard": "on", **{k: rows[-1][k] for k in ("loop", "point", "kind", "verdict")}}),
                  flush=True)
        todo = [x for x in todo if x[0] not in res]
    return rows


def cost(args, forward, watch) -> dict:
    """Alternating guard-off / guard-on rounds of a steady decode scenario, one group, in one run."""
    from harness import pd_loop as h

    jobs = []
    for _ in range(args.rounds):
        for switch in ("0", "1"):
            sc = h.steady_decode(args.world, args.iters, args.batch)
            sc.seed = len(jobs)
            jobs.append((sc, "patched", {GUARD_SWITCH: switch}))
    res = h.run_group(args.world, jobs, timeout_s=args.sched_timeout_s, wall_s=args.wall_s + 600,
                      forward=forward, watch=watch, start=args.start)
    rounds = {"0": [], "1": []}
    for i, (_, _, env) in enumerate(jobs):
        per_rank = res.get(i)
        if not per_rank or any(r is None or r.status != "ok" for r in per_rank):
            return {"error": f"round {i} did not finish: {[(r.status, r.detail[:200]) if r else None for r in per_rank or []]}"}
        iters = max(per_rank[0].iters, 1)
        rounds[env[GUARD_SWITCH]].append({
            # the slowest rank bounds the iteration: collectives make the ranks wait for each other
            "us_per_iter": max(r.seconds for r in per_rank) / iters * 1e6,
            "guard_us_per_iter": statistics.median(r.guard_seconds for r in per_rank) / iters * 1e6,
            "forward_us_per_iter": statistics.median(r.forward_seconds for r in per_rank) / iters * 1e6,
            "forward_ops_per_iter": per_rank[0].forward_ops / iters,
        })

    def med(switch, key):
        return round(statistics.median(x[key] for x in rounds[switch]), 1)

    out = {"scenario": f"steady_decode: {args.batch} requests decoding, {args.iters} iterations per round, "
                       f"{args.rounds} off/on round pairs",
           "method": "medians over rounds; us_per_iter: the slowest rank's loop time per iteration; guard_us_per_iter: "
                     "time inside the guard's agreements per iteration (median over ranks), waiting there for the "
                     "slower rank included (an agreement is a barrier); forward_us_per_iter: the stand-in's "
                     "collectives per iteration (NCCL: their GPU time by CUDA events; gloo: wall time); "
                     "package_cost_us: guard-on minus guard-off us_per_iter, machine noise included",
           "us_per_iter_guard_off": med("0", "us_per_iter"), "us_per_iter_guard_on": med("1", "us_per_iter"),
           "guard_us_per_iter": med("1", "guard_us_per_iter"),
           "forward_us_per_iter": med("1", "forward_us_per_iter"),
           "forward_us_per_iter_guard_off": med("0", "forward_us_per_iter"),
           "forward_collectives_per_iter": round(statistics.median(x["forward_ops_per_iter"] for x in rounds["1"]), 2),
           "rounds": {("guard_off" if k == "0" else "guard_on"): [{kk: round(vv, 1) for kk, vv in x.items()} for x in v]
                      for k, v in rounds.items()}}
    out["guard_to_forward_ratio"] = round(out["guard_us_per_iter"] / out["forward_us_per_iter"], 4)
    out["package_cost_us"] = round(out["us_per_iter_guard_on"] - out["us_per_iter_guard_off"], 1)
    out["package_cost_to_forward_ratio"] = round(out["package_cost_us"] / out["forward_us_per_iter"], 4)
    print(json.dumps({"cost": {k: v for k, v in out.items() if k != "rounds"}}), flush=True)
    return out


# ---- main ----------------------------------------------------------------------------------------
def device_of(backend: str, world: int) -> dict:
    import torch

    if backend == "gloo":
        return {"kind": "cpu", "what": f"CPU only, {os.cpu_count()} cores (shared with other jobs), gloo over loopback TCP"}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {"kind": "cuda", "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
            "nvidia_smi": smi.stdout.strip().splitlines(), "nccl": str(torch.cuda.nccl.version()),
            "cuda": torch.version.cuda}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="forward layers (default: the pin's 43)")
    ap.add_argument("--start", choices=("spawn", "fork"), default=None, help="default: spawn for nccl, fork for gloo")
    ap.add_argument("--parallel", type=int, default=None, help="guard-off groups at a time (default 4 nccl, 1 gloo)")
    ap.add_argument("--sched-timeout-s", type=float, default=8.0, help="the scheduler gloo group's timeout")
    ap.add_argument("--forward-timeout-s", type=float, default=12.0, help="the forward group's timeout")
    ap.add_argument("--stall-s", type=float, default=3.0)
    ap.add_argument("--kill-s", type=float, default=30.0)
    ap.add_argument("--wall-s", type=float, default=240.0, help="per group, the ranks' start included")
    ap.add_argument("--iters", type=int, default=200, help="cost: iterations per round")
    ap.add_argument("--rounds", type=int, default=3, help="cost: off/on round pairs")
    ap.add_argument("--batch", type=int, default=16, help="cost: requests decoding (tokens per forward)")
    ap.add_argument("--parts", default="off,on,cost")
    ap.add_argument("--cases", default=None, help="only these scenarios: loop:point:kind,...")
    ap.add_argument("--standins", action="store_true", help="stand in packages of the import chain that are missing")
    ap.add_argument("--commit", default=None, help="the commit run (a copy on the GPU host may have no .git)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.start = args.start or ("spawn" if args.backend == "nccl" else "fork")
    if args.backend == "nccl" and args.start == "fork":
        raise SystemExit("--backend nccl needs --start spawn: this process touches CUDA, and forked ranks cannot")
    args.parallel = args.parallel or (4 if args.backend == "nccl" else 1)
    parts = set(args.parts.split(","))

    from harness import pd_loop as h

    os.environ.update(h.MULTICAST_OFF)  # this process too, and every rank it starts (rank_env)
    standins = standins_for_missing() if args.standins else []
    import torch

    torch.set_num_threads(1)  # forked ranks (see tests/conftest.py)
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--backend nccl needs {args.world} GPUs, one per rank; this host has {torch.cuda.device_count()}")
    load_start = os.getloadavg()
    h.setup_parent(tempfile.mkdtemp(prefix="dsv4nccl"))
    shape = h.dsv4_flash_shape(args.layers)
    forward = h.ForwardSpec(args.backend, shape, timeout_s=args.forward_timeout_s)
    watch = h.Watch(tempfile.mkdtemp(prefix="dsv4watch"), stall_s=args.stall_s, kill_s=args.kill_s)
    started = time.monotonic()
    out = {
        "date": run_record.now_utc(),
        "label": ("the forward's collectives on NCCL, one GPU per rank" if args.backend == "nccl" else
                  "NOT the NCCL run: the forward group on gloo, on a CPU (a stand-in that exercises everything "
                  "but NCCL itself)"),
        "backend": args.backend, "device": device_of(args.backend, args.world), "commit": run_record.commit(args.commit),
        "torch": torch.__version__, "python": sys.version.split()[0], "world": args.world, "start": args.start,
        "standins": standins,
        "forward_shape": {"layers": shape.layers, "hidden": shape.hidden, "vocab": shape.vocab, "dtype": shape.dtype,
                          "collectives_per_step": shape.collectives(), "assumed": " ".join(h.ForwardShape.__doc__.split())},
        "bounds_s": {"scheduler_gloo_timeout": args.sched_timeout_s, "forward_group_timeout": args.forward_timeout_s,
                     "watchdog_stall_record": args.stall_s, "watchdog_kill": args.kill_s, "group_wall": args.wall_s},
        "rank_env": h.rank_env(forward, "<group dump folder>"),
    }
    for part, key, run in (("off", "guard_off", guard_off), ("on", "guard_on", guard_on), ("cost", "cost", cost)):
        if part in parts:
            out[key] = run(args, forward, watch)
            write(args.out, out, started, load_start)  # a run cut short keeps the parts it finished
    shutil.rmtree(watch.dump_dir, ignore_errors=True)  # what it held is in the JSON now
    print(json.dumps({"summary": out["summary"]}, indent=1), flush=True)
    if args.out:
        print(f"wrote {args.out}")
    return 0


def write(path: Path | None, out: dict, started: float, load_start) -> None:
    out["summary"] = summary(out)
    out["seconds"] = round(time.monotonic() - started, 1)
    out["load_average_at_start"], out["load_average_at_end"] = load_start, os.getloadavg()
    run_record.write(path, out)


def summary(out: dict) -> dict:
    """Verdict counts per mode, and for guard-off hangs where each rank sat (the group named first in its record)."""
    got = {}
    for mode in ("guard_off", "guard_on"):
        rows = out.get(mode) or []
        verdicts: dict[str, int] = {}
        for row in rows:
            verdicts[row["verdict"]] = verdicts.get(row["verdict"], 0) + 1
        got[mode] = {"scenarios": len(rows), "verdicts": verdicts}
        if mode == "guard_off":
            sat: dict[str, int] = {}
            for row in rows:
                for rank in row.get("ranks", []):
                    where = (rank["located"] or "no stall record").split(":")[0]
                    sat[where] = sat.get(where, 0) + 1
            got[mode]["rank_records_by_group"] = sat
    if isinstance(out.get("cost"), dict) and "guard_to_forward_ratio" in out["cost"]:
        c = out["cost"]
        got["cost"] = {k: c[k] for k in ("guard_us_per_iter", "forward_us_per_iter", "guard_to_forward_ratio",
                                         "package_cost_us", "package_cost_to_forward_ratio")}
    return got


if __name__ == "__main__":
    sys.exit(main())

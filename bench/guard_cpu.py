"""Cost of the collective guard per PD-loop iteration, on gloo, at TP = 2, 4, 8: the real patched loop.

Runs upstream's REAL patched ``event_loop_overlap_disagg_prefill`` through the test harness
(``harness/pd_loop.py``: no model, forward replaced by its TP all-reduces) with
``queued`` requests waiting in the bootstrap queue, so every iteration does upstream's real request
broadcast and bootstrap poll all-reduce, and calls ``get_next_disagg_prefill_batch_to_run`` (no
batch forms). The same group alternates rounds with the guard switched off
(``DSV4_SM120_COLLECTIVE_GUARD=0``: the loop is upstream's) and on (the package as shipped: the
top-of-iteration agreement, the agreements before the waiting and in-flight polls, the second
agreement on the formed batch, and the polls MIN-reduced through shared memory), in one run.
``package_cost_us`` = difference of the medians; ``us_inside_guard_calls`` = time inside all the
guard's agreements per iteration, ``second_agreement_us`` (also ``us_inside_batch_check``) = inside
the second agreement alone (medians over ranks; both include waiting for the slowest rank). Not a test: CPU-only figures,
machine noise included.

    .venv/bin/python -m bench.guard_cpu --out bench/results/guard/guard_cpu_$(date -u +%F).json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from harness import run_record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=400, help="loop iterations per round")
    ap.add_argument("--rounds", type=int, default=5, help="off/on round pairs per TP size")
    ap.add_argument("--queued", type=int, default=16, help="requests held in the bootstrap queue")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from harness import pd_loop as h

    load_start = os.getloadavg()

    h.setup_parent(tempfile.mkdtemp(prefix="dsv4bench"))
    rows = []
    for tp in args.tp:
        base, guard, inside, inside_batch = [], [], [], []
        jobs = []
        for _ in range(args.rounds):
            for switch in ("0", "1"):
                sc = h.steady("prefill", tp, args.iters, args.queued)
                sc.seed = len(jobs)  # a distinct key per job so every round's result is kept
                jobs.append((sc, "patched", {"DSV4_SM120_COLLECTIVE_GUARD": switch}))
        res = h.run_group(tp, jobs, timeout_s=120, wall_s=3000)
        for i, (_, _, env) in enumerate(jobs):
            per_rank = res.get(i)
            if not per_rank or any(r is None or r.status != "ok" for r in per_rank):
                raise SystemExit(f"TP={tp} job {i} did not finish: {per_rank}")
            # the slowest rank bounds the iteration: collectives make the ranks wait for each other
            us = max(r.seconds / max(r.iters, 1) for r in per_rank) * 1e6
            (guard if env["DSV4_SM120_COLLECTIVE_GUARD"] == "1" else base).append(us)
            if env["DSV4_SM120_COLLECTIVE_GUARD"] == "1":
                inside.append(statistics.median(r.guard_seconds / max(r.iters, 1) for r in per_rank) * 1e6)
                inside_batch.append(statistics.median(r.batch_check_seconds / max(r.iters, 1) for r in per_rank) * 1e6)
        row = {
            "tp": tp,
            "us_per_iter_base": round(statistics.median(base), 1),
            "us_per_iter_package": round(statistics.median(guard), 1),
        }
        row["package_cost_us"] = round(row["us_per_iter_package"] - row["us_per_iter_base"], 1)
        row["package_ratio"] = round(row["us_per_iter_package"] / row["us_per_iter_base"], 3)
        row["us_inside_guard_calls"] = round(statistics.median(inside), 1)
        # the second agreement's own cost: time inside the batch check's call per iteration (median
        # over rounds of the median over ranks; waiting for the slowest rank included)
        row["second_agreement_us"] = round(statistics.median(inside_batch), 1)
        row["us_inside_batch_check"] = row["second_agreement_us"]
        row["rounds_package_us"] = [round(x, 1) for x in guard]
        row["rounds_base_us"] = [round(x, 1) for x in base]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "date": run_record.now_utc(),
        "device": f"CPU only, {os.cpu_count()} cores (shared with other jobs), gloo over loopback TCP",
        "commit": run_record.commit(),
        "loop": "event_loop_overlap_disagg_prefill (patched) with the guard's hooks, harness of tests/guard",
        "iters_per_round": args.iters,
        "rounds": args.rounds,
        "queued_requests": args.queued,
        "method": "per TP size one gloo group alternates guard-off and guard-on rounds of iters_per_round "
                  "iterations; per round the slowest rank's time per iteration; figures are medians over rounds",
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(),
        "note": "the 2-core machine is shared with other engineers' jobs: the load average above is theirs and "
                "this bench's together; every barrier waits for a rank that may have no core to run on",
        "tp": [r["tp"] for r in rows],
        "us_per_iter_base": [r["us_per_iter_base"] for r in rows],
        "us_per_iter_package": [r["us_per_iter_package"] for r in rows],
        "package_cost_us": [r["package_cost_us"] for r in rows],
        "package_ratio": [r["package_ratio"] for r in rows],
        "second_agreement_us": [r["second_agreement_us"] for r in rows],
        "results": rows,
    }
    run_record.write(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What counting a hook's time costs per call (``dsv4_sm120.hook_time``): the same trivial hook called bare and
timed, AROUND and AFTER, in alternating repetitions on this CPU.

The totals on ``sglang:dsv4_hook_seconds_total`` leave this cost out; a step with ``n`` hook calls pays about
``n`` times the difference given here on top of what the metric shows. Not a test: CPU figures, machine noise
included (the spread is beside every median).

    .venv/bin/python -m bench.hook_time_cpu --out bench/results/hook_time/hook_time_cpu_$(date -u +%F).json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import timeit
from pathlib import Path

from harness import run_record


def _variants() -> dict:
    from dsv4_sm120 import hook_time

    def upstream(x):
        return x

    def around(original, x):
        return original(x)

    def after(result, x):
        return result

    timed_around, timed_after = hook_time.wrap("around", "guard", around), hook_time.wrap("after", "guard", after)
    return {"around": (lambda: around(upstream, 1), lambda: timed_around(upstream, 1)),
            "after": (lambda: after(1, 1), lambda: timed_after(1, 1))}


def measure(calls: int = 200_000, repetitions: int = 10) -> dict:
    """Per kind (``around``, ``after``): the bare and timed call's median ns and what timing adds per call, the
    median of the pairs with its min-max."""
    rows = {}
    for kind, (bare, timed) in _variants().items():
        per = {"bare": [], "timed": []}
        for rep in range(repetitions):
            for name, fn in (("bare", bare), ("timed", timed)) if rep % 2 == 0 else (("timed", timed), ("bare", bare)):
                per[name].append(timeit.timeit(fn, number=calls) / calls * 1e9)
        added = [t - b for t, b in zip(per["timed"], per["bare"])]
        rows[kind] = {"bare_ns": round(statistics.median(per["bare"]), 1),
                      "timed_ns": round(statistics.median(per["timed"]), 1),
                      "added_ns": {"median": round(statistics.median(added), 1), "min": round(min(added), 1),
                                   "max": round(max(added), 1), "n": len(added)}}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per repetition")
    ap.add_argument("--repetitions", type=int, default=10, help="bare/timed pairs, each pair's order alternating")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = measure(args.calls, args.repetitions)
    for kind, row in rows.items():
        print(kind, json.dumps(row), flush=True)
    out = {"date": run_record.now_utc(), "commit": run_record.commit(),
           "device": f"CPU only, {os.cpu_count()} cores, Python {sys.version.split()[0]}",
           "method": f"timeit of {args.calls} calls per repetition; {args.repetitions} bare/timed pairs per kind, "
                     "the order within a pair alternating; added_ns = timed - bare per pair",
           "load_average_at_end": os.getloadavg(), "results": rows}
    run_record.write(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

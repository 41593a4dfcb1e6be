"""Each injection point of the guard harness, guard on vs the pin's pristine loops: the table of
docs/DSV4_PD_DEADLOCK_ISSUE.md ("Each injection point, guard on and off").

For every (loop, point, kind) of ``pd_loop_harness.POINTS``: one scenario (``at_point``: 4
requests, the divergence on rank 1) on 2 forked gloo ranks, once through the patched loops with the
guard's hooks (gloo timeout 20 s) and once through the pristine loops (timeout 4 s, so a hang ends
as a gloo timeout error). Records each rank's outcome, what each client got, the guard's counters,
and the ranks' exit codes. CPU only; no timing is reported beyond wall seconds per run.

    .venv/bin/python bench/guard_injection_points.py --out bench/results/guard/guard_injection_points_$(date -u +%F).json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "guard"))
GUARD_MSG = "dsv4-sm120 collective guard"


def outcome(res: dict, seed: int) -> dict:
    per_rank = res.get(seed) or [None, None]
    first = per_rank[0]
    told = first.outcomes if first else {}
    return {
        "status": [r.status if r else "no answer" for r in per_rank],
        "detail": [r.detail[:200] if r else "" for r in per_rank],
        "completed": sum(kind == "done" for kind, _ in told.values()),
        "guard_aborts": sum(kind == "abort" and GUARD_MSG in msg for kind, msg in told.values()),
        "other_aborts": sum(kind == "abort" and GUARD_MSG not in msg for kind, msg in told.values()),
        "injected_on_rank1": per_rank[1].injected if per_rank[1] else None,
        "counters": [r.counters if r else {} for r in per_rank],
        "exit_codes": [code for code, _ in res["exits"].values()],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # forked ranks (see tests/conftest.py)
    import pd_loop_harness as h

    h.setup_parent(tempfile.mkdtemp(prefix="dsv4points"))
    rows = []
    for loop, points in h.POINTS.items():
        for point, kinds in points.items():
            for kind in kinds:
                row = {"loop": loop, "point": point, "kind": kind}
                for mode, loops, timeout_s in (("guard_on", "patched", 20), ("guard_off", "upstream", 4)):
                    started = time.monotonic()
                    sc = h.at_point(loop, point, kind)
                    res = h.run_group(2, [(sc, loops)], timeout_s=timeout_s, wall_s=120)
                    row[mode] = outcome(res, sc.seed) | {"seconds": round(time.monotonic() - started, 1)}
                rows.append(row)
                print(json.dumps({k: row[k] if k in ("loop", "point", "kind") else row[k]["status"] for k in row}),
                      flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": f"CPU only, {os.cpu_count()} cores (shared with other jobs), gloo over loopback TCP",
        "commit": commit,
        "what": "pd_loop_harness.at_point scenarios on 2 gloo ranks: the pin's loops patched + guard hooks "
                "(guard_on) vs the pristine loops (guard_off); divergence injected on rank 1",
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m tests.mutations``: apply every mutation to a copy of the tree, run its tests, print the table.

Options: ``--only NAME`` (repeatable), ``--e2e`` (also the mutations only tests/e2e catches),
``--check`` (only check that every mutation still applies), ``--no-baseline``, ``--keep``
(leave the copies and logs in the work directory). Exit 0 only when every mutation run was caught.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.mutations import mutation_engine as engine
from tests.mutations.mutation_catalog import MUTATIONS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations")
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if (not args.only or m.name in args.only) and (args.e2e or not m.e2e_only)]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutation(s): {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.check:
        bad = 0
        for m in chosen:
            try:
                engine.check_applies(m)
            except engine.MutationError as exc:
                bad += 1
                print(exc)
        print(f"{len(chosen) - bad}/{len(chosen)} mutations apply")
        return 1 if bad else 0
    start = time.monotonic()
    runner = engine.Runner(keep=args.keep)
    try:
        if not args.no_baseline:
            row = runner.baseline(chosen)
            print(engine.table([row]), flush=True)
            if row.result != "passed":
                print(row.detail)
                return 1
        for m in chosen:
            row = runner.mutate(m)
            print(f"{row.name}: {row.result} in {row.seconds:.1f} s  {row.detail.splitlines()[0] if row.detail else ''}",
                  flush=True)
            if row.result == "error":
                print(row.detail)
    finally:
        runner.close()
    print(engine.table(runner.rows))
    print(f"wall {time.monotonic() - start:.0f} s; work directory {runner.workdir}" + ("" if args.keep else " (removed)"))
    return 0 if all(r.result in ("caught", "passed") for r in runner.rows) else 1


if __name__ == "__main__":
    sys.exit(main())

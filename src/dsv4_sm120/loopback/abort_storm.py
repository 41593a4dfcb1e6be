"""``dsv4-sm120 abort-storm``: the production wedge, reproduced on any machine, and its cure measured.

Each round opens ``--sessions`` requests over the loopback PD pair
(:mod:`dsv4_sm120.loopback.pair`, real NIXL on 127.0.0.1) and has the decode
abort every one of them at a random point: before it publishes its pages, once
the prefill saw the room bootstrapped, right after the prefill queued the
transfer, or before the prefill ever heard of the room (whose transfer-info
frame then lands late, as a second decode rank's would). ``--foreign`` frames
with a tag the pin does not know arrive mid-storm, as the incident's did. Then
``--fresh`` new requests must complete byte-exact, and after quiescence no room
may be left in the prefill's ``transfer_infos``/``request_status`` or the
decode's ``request_status``.

A round is *wedged* when a fresh request does not complete within ``--wait-s``.
``--baseline`` runs the pin's bootstrap thread (no hooks) for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

ABORT_POINTS = ("before_metadata", "bootstrapped", "transfer", "unknown_room")
PAGES_PER_SESSION = 4


@dataclass
class RoundResult:
    round: int
    sessions: int
    aborted: int
    fresh: int
    completed_after_storm: int
    recover_s: float | None
    leaked_rooms: int
    thread_alive: bool
    frames_rejected: int
    late_frames_dropped: int
    wedged: bool


def _counters(h) -> tuple[int, int]:
    boot = h.hardening
    if boot is None:
        return 0, 0
    snap = boot.rejects.snapshot()
    return snap["frames_rejected"], snap["late_frames_dropped"]


def storm_round(h, index: int, *, sessions: int, fresh: int, foreign: int, wait_s: float, rng) -> RoundResult:
    """One storm on harness ``h``, then the fresh requests that must get through."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from dsv4_sm120.loopback.pair import FOREIGN_FRAME

    storm, late = [], []
    for i in range(sessions):
        point = ABORT_POINTS[int(rng.integers(len(ABORT_POINTS)))]
        if i == sessions // 2:
            for _ in range(foreign):
                h.push_raw(FOREIGN_FRAME)
        if point == "unknown_room":  # the prefill never opens this request
            s = h.open(PAGES_PER_SESSION, prefill=False)
            h.abort(s)
            late.append(s)
        else:
            s = h.open(PAGES_PER_SESSION)
            s.abort_at = point
            if point == "before_metadata":
                h.abort(s)
            else:
                h.send_metadata(s)
        storm.append(s)
        h.pump()
    # The agent is killed: whatever has not hit its abort point yet (e.g. never bootstrapped) is aborted now.
    deadline = time.monotonic() + 1.0
    while any(not s.aborted for s in storm) and time.monotonic() < deadline:
        h.pump()
        time.sleep(0.002)
    for s in storm:
        if not s.aborted:
            h.abort(s)
    h.settle_aborts()  # "late" means after the prefill handled the ABORT
    for s in late:
        h.push_raw(h.metadata_frame(s))
    h.run(storm, wait_s)
    storm_end = time.monotonic()

    batch = [h.open(PAGES_PER_SESSION) for _ in range(fresh)]
    for s in batch:
        h.send_metadata(s)
    h.run(batch, wait_s)
    good = [s for s in batch if s.prefill_state == KVPoll.Success and s.decode_state == KVPoll.Success and h.verify(s)]
    recover = min(s.done_at for s in good) - storm_end if good else None

    h.quiesce(2.0)
    leaked = sum(len(v) for v in h.leaked_rooms().values())
    # Requests that never concluded are abandoned (their pages are not reused), as a wedged server's would be.
    h.sessions = [s for s in h.sessions if s.finished]
    h.recycle()
    rejected, late_dropped = _counters(h)
    return RoundResult(index, sessions, sum(s.aborted for s in storm), fresh, len(good),
                       None if recover is None else round(recover, 4), leaked, h.thread_alive(),
                       rejected, late_dropped, len(good) < fresh)


def run_storm(*, sessions: int = 80, rounds: int = 3, fresh: int = 8, foreign: int = 1, wait_s: float = 10.0,
              baseline: bool = False, seed: int = 0, on_round=None, harness=None) -> dict:
    """Run ``rounds`` storms and summarise them; ``harness`` reuses a built :class:`LoopbackPD`."""
    import numpy as np

    from dsv4_sm120.loopback.pair import LoopbackPD

    # A wedged round abandons its requests' decode pages (never reused): size the pool for every round.
    pages = max(8192, (sessions + fresh) * PAGES_PER_SESSION * (rounds + 1))
    h = harness or LoopbackPD(hardened=not baseline, seed=seed, pages=pages, aux_slots=pages // PAGES_PER_SESSION)
    rng = np.random.default_rng(seed)
    results = []
    try:
        for i in range(1, rounds + 1):
            r = storm_round(h, i, sessions=sessions, fresh=fresh, foreign=foreign, wait_s=wait_s, rng=rng)
            results.append(r)
            if on_round is not None:
                on_round(r)
    finally:
        if harness is None:
            h.close()
    recovers = [r.recover_s for r in results]
    return {
        "hardened": h.hardening is not None,
        "sessions": sessions,
        "rounds": rounds,
        "aborted": sum(r.aborted for r in results),
        "fresh": fresh * rounds,
        "completed_after_storm": sum(r.completed_after_storm for r in results),
        "recover_s_max": None if None in recovers or not recovers else max(recovers),
        "leaked_rooms": max((r.leaked_rooms for r in results), default=0),
        "thread_alive": results[-1].thread_alive if results else h.thread_alive(),
        "wedged_rounds": sum(r.wedged for r in results),
        "frames_rejected": results[-1].frames_rejected if results else 0,
        "late_frames_dropped": results[-1].late_frames_dropped if results else 0,
        "per_round": [asdict(r) for r in results],
    }


# -- CLI ------------------------------------------------------------------------------------------
_COLUMNS = ("round", "sessions", "aborted", "completed after storm", "recover s", "leaked rooms",
            "thread alive", "frames rejected")


def _row(cells) -> str:
    return "  ".join(f"{c:>{len(h)}}" for c, h in zip(cells, _COLUMNS))


def _round_cells(r: RoundResult):
    rec = "-" if r.recover_s is None else f"{r.recover_s:.3f}"
    return (r.round, r.sessions, r.aborted, f"{r.completed_after_storm}/{r.fresh}", rec, r.leaked_rooms,
            "yes" if r.thread_alive else "NO", r.frames_rejected)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=80, help="requests aborted per round (default 80)")
    parser.add_argument("--rounds", type=int, default=3, help="storms to run (default 3)")
    parser.add_argument("--fresh", type=int, default=8, help="new requests after each storm that must complete (default 8)")
    parser.add_argument("--foreign", type=int, default=1, help="frames with an unknown tag sent mid-storm (default 1)")
    parser.add_argument("--wait-s", type=float, default=10.0, help="bounded wait for a round's requests (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", action="store_true", help="the pin's bootstrap thread, without the hardening")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


@contextlib.contextmanager
def _stdout_to_stderr():
    """NIXL writes its log lines on stdout; keep stdout for the result only."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield os.fdopen(os.dup(saved), "w")
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when no round wedged, nothing leaked and the bootstrap thread lives."""
    for name in ("sessions", "rounds", "fresh"):
        if getattr(args, name) < 1:
            print(f"abort-storm: --{name} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        import nixl  # noqa: F401 - the harness runs real NIXL agents
    except ImportError:
        print("abort-storm: NIXL is not installed; `pip install nixl==1.5.1` (runs on CPU too)", file=sys.stderr)
        return 2
    if args.baseline:
        os.environ["DSV4_SM120_NIXL_HARDENING"] = "0"
    with _stdout_to_stderr() as out:
        if not args.json:
            mode = "BASELINE (pin's bootstrap thread)" if args.baseline else "hardened (dsv4-sm120)"
            print(f"abort-storm: {mode}, real NIXL over UCX on 127.0.0.1, {args.sessions} sessions x {args.rounds} rounds",
                  file=out, flush=True)
            print(_row(_COLUMNS), file=out, flush=True)

        def show(r):
            if not args.json:
                print(_row(_round_cells(r)), file=out, flush=True)

        summary = run_storm(sessions=args.sessions, rounds=args.rounds, fresh=args.fresh, foreign=args.foreign,
                            wait_s=args.wait_s, baseline=args.baseline, seed=args.seed, on_round=show)
        if args.json:
            print(json.dumps(summary), file=out, flush=True)
        else:
            rec = "-" if summary["recover_s_max"] is None else f"{summary['recover_s_max']:.3f} (max)"
            print(_row(("total", args.sessions * args.rounds, summary["aborted"],
                        f"{summary['completed_after_storm']}/{summary['fresh']}", rec, summary["leaked_rooms"],
                        "yes" if summary["thread_alive"] else "NO", summary["frames_rejected"])), file=out)
            print(f"wedged rounds: {summary['wedged_rounds']}/{args.rounds}; late transfer-info frames dropped: "
                  f"{summary['late_frames_dropped']}", file=out, flush=True)
        out.close()
    ok = summary["wedged_rounds"] == 0 and summary["leaked_rooms"] == 0 and summary["thread_alive"]
    return 0 if ok else 1

"""The call the patched PD loops make once per iteration, and the agreement every later check reuses.

``check_iteration(scheduler, loop)`` runs on every TP rank at the same point of
every iteration (after the request broadcast, before the first queue poll). It
compares the ranks' snapshots (a few int64, through ``consensus.Agreement``). Agreement: return, the
iteration proceeds unchanged. Disagreement on queues: reconcile (requests not
held by every rank are aborted where held, their clients told why) and check
again. Disagreement that reconciliation cannot remove (batch state, or queues
still differing after ``MAX_ROUNDS``): fail fast, i.e. log one per-rank
diagnosis, raise out of the loop (upstream's scheduler process then logs it and
signals its parent to shut the server down; with the loop gone no health check
is answered) and make sure the process exits non-zero within ``EXIT_WITHIN_S``
even if teardown hangs.

The first call also leaves the scheduler's guard state behind (``active``): the
later checks of an iteration (``queue_check`` before each conditional poll,
``batch_check`` on the formed batch) act only on a scheduler that has it, so
they never touch a loop the patch did not reach (PP loops, guard off, TP=1).

``DSV4_SM120_COLLECTIVE_GUARD=0`` makes the call return at once: the loop is upstream's.
"""

from __future__ import annotations

import logging
import os
import threading

from dsv4_sm120 import hook_time
from dsv4_sm120.guard import consensus, reconcile, snapshot
from dsv4_sm120.guard.counters import Counters

logger = logging.getLogger("dsv4_sm120.guard")

MAX_ROUNDS = 3  # reconcile attempts within one iteration before failing fast
# Every agreement leads with the code of the point it is made at: ranks that reached different
# points (one skipped a poll site the others entered) learn it instead of pairing unlike vectors.
POINTS = {"top": 1, "waiting": 2, "inflight": 3, "prealloc": 4, "transfer": 5, "batch": 6}
EXIT_WITHIN_S = 8.0  # hard exit deadline after a fail-fast (the promise is < 10 s)
EXIT_CODE = 3

counters = Counters()


def tp_rank_of(scheduler) -> int:
    """The scheduler's TP rank, for the log lines: the pin's Scheduler keeps it in sglang's runtime context."""
    rank = getattr(scheduler, "tp_rank", None)  # the patched-loop harness's stand-in carries it
    if rank is None:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().tp_rank
    return rank


class CollectiveGuardFailFast(RuntimeError):
    """TP ranks of a PD scheduler diverged and could not be reconciled."""


class _State:
    """Per-scheduler guard state, created at the first iteration (settings read then, once)."""

    def __init__(self, scheduler, loop: str):
        from dsv4_sm120 import settings

        # Read here, not handed from plugin.register: the patched loop also runs where register stopped early.
        self.enabled = settings.load().collective_guard
        self.groups = [consensus.Agreement(g) for g in consensus.groups_of(scheduler)] if self.enabled else []
        self.rank = tp_rank_of(scheduler)
        self.loop = loop
        self.digests = snapshot.Digests()  # queue digests, recomputed only when a queue changed
        counters.loop = loop


def active(scheduler) -> _State | None:
    """The guard state of a scheduler whose patched loop has called ``check_iteration``, when it guards."""
    state = scheduler.__dict__.get("_dsv4_guard")
    return state if state is not None and state.groups else None


def _check_iteration(scheduler, loop: str) -> None:
    """Make this iteration's collectives the same on every rank, or fail fast."""
    state = scheduler.__dict__.get("_dsv4_guard")
    if state is None:
        state = scheduler.__dict__["_dsv4_guard"] = _State(scheduler, loop)
    if state.groups:
        agree(scheduler, state, lambda: snapshot.take(scheduler, loop), "top", "at the top of the iteration",
              lambda: snapshot.top_vector(scheduler, loop, state.digests))


check_iteration = hook_time.timed("guard", _check_iteration)  # the patched loops' call: a fix's time, on /metrics


def agree(scheduler, state: _State, take, point: str, where: str, vector=None) -> None:
    """Bring what ``take()`` snapshots at guard point ``point`` into agreement on every group, or fail fast.

    ``take`` returns a ``snapshot.Snapshot``; its queues are reconciled, its scalars must be equal.
    ``vector``, when given, returns ``take().vector()`` more cheaply (cached digests); the full
    snapshot is then taken only when the ranks disagree.
    """
    vector = vector or (lambda: take().vector())
    for agreement in state.groups:
        try:
            _agree(scheduler, state.loop, agreement, state.rank, take, vector, point, where)
        except consensus.PeerLost as e:
            _fail_fast(state.loop, state.rank, [], [], str(e))


def exchange_at(agreement: consensus.Agreement, point: str, vector: list[int], loop: str, rank: int) -> list[int]:
    """``agreement.disagreeing_fields`` on ``vector`` led by the point's code; fails fast when the ranks
    are at different guard points. Returns the disagreeing indices of ``vector``."""
    bad = agreement.disagreeing_fields([POINTS[point], *vector])
    if 0 in bad:
        points = agreement.gather(point)
        _fail_fast(loop, rank, [], [], f"the ranks reached different guard points ({', '.join(points)}, in group "
                   f"rank order): an upstream branch between two agreements went differently on some ranks")
    return [i - 1 for i in bad]


def _agree(scheduler, loop: str, agreement: consensus.Agreement, rank: int, take, vector, point: str,
           where: str) -> None:
    seen = False
    for _ in range(MAX_ROUNDS):
        bad = exchange_at(agreement, point, vector(), loop, rank)
        if not bad:
            if seen:
                counters.add("divergences_reconciled")
                logger.warning("dsv4-sm120 guard: %s rank %d reconciled %s; counters %s",
                               loop, rank, where, counters.line())
            return
        if not seen:
            seen = True
            counters.add("divergences_seen")
        snap = take()  # the same state the vector came from: nothing ran in between
        gathered = agreement.gather(_exchange(scheduler, loop, snap))
        labels = snap.labels()
        if any(g["scalars"] != gathered[0]["scalars"] for g in gathered):
            _fail_fast(loop, rank, [labels[i] for i in bad], gathered, f"batch state differs {where} (not reconcilable)")
        p = reconcile.plan(gathered)
        retired = reconcile.apply(scheduler, loop, p, agreement.world)
        counters.add("requests_aborted", retired)
        logger.warning(
            "dsv4-sm120 guard: %s rank %d: ranks disagreed %s on %s; aborted %d request(s) this rank held "
            "alone (%s); counters %s",
            loop, rank, where, ", ".join(labels[i] for i in bad), retired,
            ", ".join(f"{q}: {sorted(o)}" for q, o in p.orphans.items()) or "queue order only", counters.line(),
        )
    _fail_fast(loop, rank, [], gathered, f"still diverged {where} after {MAX_ROUNDS} reconciliations")


def _exchange(scheduler, loop: str, snap: snapshot.Snapshot) -> dict:
    """What each rank contributes when the fast check fails."""
    ipc = {}
    for name in snap.queues:
        for item in snapshot.queue_items(scheduler, loop, name):
            req = getattr(item, "req", item)
            ipc[req.rid] = getattr(req, "http_worker_ipc", None)
    return {"queues": snap.queues, "scalars": snap.scalars, "ipc": ipc}


def _fail_fast(loop: str, rank: int, fields: list[str], gathered: list[dict], why: str) -> None:
    counters.add("fail_fasts")
    lines = [f"dsv4-sm120 guard: FAIL FAST on {loop} rank {rank}: {why}; disagreeing: {', '.join(fields) or 'see below'}"]
    for r, g in enumerate(gathered):
        queues = " ".join(f"{q}={rids}" for q, rids in g["queues"].items())
        scalars = " ".join(f"{k}={v}" for k, v in g["scalars"].items())
        lines.append(f"  group rank {r}: {queues} {scalars}")
    lines.append(f"  counters {counters.line()}; exiting with code {EXIT_CODE} within {EXIT_WITHIN_S:.0f} s "
                 f"so a supervisor restarts the engine")
    logger.error("\n".join(lines))
    timer = threading.Timer(EXIT_WITHIN_S, os._exit, args=(EXIT_CODE,))
    timer.daemon = True
    timer.start()
    raise CollectiveGuardFailFast(lines[0])

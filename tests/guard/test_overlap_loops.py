"""The REAL patched PD loops of sglang 0.5.23 (overlap and normal) on 2 and 4 gloo ranks, without a model.

See ``harness.pd_loop`` for exactly what is real and what is replaced (and why). The pytest process
imports sglang once and loads the pristine and patched loops from COPIES of the pinned files (so
the venv's own patch state does not matter); every group of ranks is forked from it and runs many
scenarios on one gloo group. Divergence is injected at every point of an iteration where rank-local
state changes (``H.POINTS``): with the guard it is reconciled, without it the ranks hang.
"""

from __future__ import annotations

import pytest

from harness import pd_loop as H

GUARD_MSG = "dsv4-sm120 collective guard"


@pytest.fixture(scope="module", autouse=True)
def parent(tmp_path_factory):
    H.setup_parent(str(tmp_path_factory.mktemp("patched_sglang")))


def _check_completed(results: dict, world: int) -> dict:
    """Every rank finished cleanly, no rank holds a request, every client got an answer."""
    totals = {"scenarios": 0, "guard_aborts": 0, "injected": 0}
    for seed, per_rank in results.items():
        if seed == "exits":
            continue
        totals["scenarios"] += 1
        totals["injected"] += sum(r.injected for r in per_rank if r is not None)
        assert all(r is not None for r in per_rank), f"seed {seed}: a rank never answered (hang): {per_rank}"
        bad = [(r.rank, r.status, r.detail) for r in per_rank if r.status != "ok"]
        assert not bad, f"seed {seed}: {bad}"
        for r in per_rank:
            assert not r.leftovers, f"seed {seed}: rank {r.rank} still holds {r.leftovers}"
        outcomes = per_rank[0].outcomes
        for kind, message in outcomes.values():
            assert kind in ("done", "abort")
            if kind == "abort":
                assert message, f"seed {seed}: an abort reached its client without a reason"
                totals["guard_aborts"] += GUARD_MSG in message
    return totals


def _expected_seeds(results: dict, n: int) -> None:
    got = sorted(k for k in results if k != "exits")
    assert got == list(range(n)), f"only {len(got)}/{n} scenarios answered: the group stopped after {got[-1:]}"


# --- without the fix: the incident hangs ---------------------------------------------------------
@pytest.mark.parametrize("loop", ["prefill", "decode"])
def test_unpatched_upstream_loop_hangs_when_one_rank_queue_empties(loop):
    """Upstream's loop: rank 1 skips a poll that rank 0 enters. gloo's 4 s timeout turns the hang
    into an error we can see; with NCCL/without a timeout it waits forever."""
    res = H.run_group(2, [(H.one_sided_empty(loop, 2), "upstream")], timeout_s=4, wall_s=60)
    statuses = [r.status if r else "no answer" for r in res[-1]]
    assert "ok" not in statuses and "hang" in statuses, statuses


# A late divergence of each kind the top-of-iteration check alone does not see in time.
LATE = [("prefill", "batch_formation", "skip"), ("prefill", "batch_result", "abort"),
        ("decode", "transfer", "complete"), ("decode", "batch_formation", "abort")]
EVERY_POINT = [(loop, point, kind) for loop, points in H.POINTS.items() for point, kinds in points.items()
               for kind in kinds]


def _hangs(res) -> list:
    per_rank = res.get(-4, [None, None])
    statuses = [r.status if r else "no answer" for r in per_rank]
    assert "ok" not in statuses and ("hang" in statuses or "error" in statuses), statuses
    return statuses


@pytest.mark.parametrize("loop,point,kind", LATE)
def test_unpatched_upstream_loop_hangs_on_a_late_divergence(loop, point, kind):
    """Upstream's loop with one rank's queue or batch changed after the iteration's top: the ranks
    enter different collectives (gloo's 4 s timeout ends the wait, or gloo aborts on mismatched sizes)."""
    _hangs(H.run_group(2, [(H.at_point(loop, point, kind), "upstream")], timeout_s=4, wall_s=60))


@pytest.mark.slow
@pytest.mark.parametrize("loop,point,kind", EVERY_POINT)
def test_unpatched_upstream_loop_hangs_at_every_injection_point(loop, point, kind):
    _hangs(H.run_group(2, [(H.at_point(loop, point, kind), "upstream")], timeout_s=4, wall_s=60))


@pytest.mark.parametrize("loop", ["prefill", "decode"])
def test_unpatched_normal_loop_hangs_too(loop):
    """``--disable-overlap-schedule``'s loops skip the same polls on an empty queue."""
    sc = H.one_sided_empty(loop, 2)
    sc.kind = "normal"
    res = H.run_group(2, [(sc, "upstream")], timeout_s=4, wall_s=60)
    statuses = [r.status if r else "no answer" for r in res[-1]]
    assert "ok" not in statuses and "hang" in statuses, statuses


def test_guard_switched_off_behaves_as_upstream_and_hangs(monkeypatch):
    """DSV4_SM120_COLLECTIVE_GUARD=0 with the patch applied: the same hang as upstream."""
    res = H.run_group(2, [(H.one_sided_empty("prefill", 2), "patched")], timeout_s=4, wall_s=60,
                      env={"DSV4_SM120_COLLECTIVE_GUARD": "0"})
    statuses = [r.status if r else "no answer" for r in res[-1]]
    assert "ok" not in statuses and "hang" in statuses, statuses


# --- with the fix ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_guard_reconciles_the_incident(world):
    """Same incident, patched loops: both loops finish, the requests the emptied rank lost are
    aborted on the other ranks, and each client is told why."""
    jobs = [(H.one_sided_empty("prefill", world), "patched")]
    res = H.run_group(world, jobs, timeout_s=20, wall_s=180)
    _check_completed(res, world)
    outcomes = res[-1][0].outcomes
    assert set(outcomes) == {"inc-r0", "inc-r1", "inc-r2"}
    assert all(kind == "abort" and GUARD_MSG in msg for kind, msg in outcomes.values()), outcomes
    assert all(r.counters["reconciled"] >= 1 for r in res[-1])


@pytest.mark.parametrize("loop", ["prefill", "decode"])
def test_every_injection_point_is_reconciled(loop):
    """One divergence at each point of an iteration where rank-local state changes, each kind that
    can happen there: every scenario finishes on every rank, no fail-fast, each request completes or
    its client gets the guard's "safe to retry" abort, and the injection really happened."""
    cases = [c for c in EVERY_POINT if c[0] == loop]
    jobs = []
    for i, (_, point, kind) in enumerate(cases):
        sc = H.at_point(loop, point, kind)
        sc.seed = i
        jobs.append((sc, "patched"))
    res = H.run_group(2, jobs, timeout_s=20, wall_s=240)
    _check_completed(res, 2)
    _expected_seeds(res, len(cases))
    for i, case in enumerate(cases):
        assert res[i][1].injected == 1, f"{case}: the injection never fired on rank 1"
        assert all(r.counters["reconciled"] >= 1 and r.counters["fail_fasts"] == 0 for r in res[i]), (case, res[i])


def test_a_chunked_request_of_a_disagreeing_batch_is_aborted():
    """One rank alone chunks a request of its batch: no rank runs the batch, the chunked request is
    aborted on every rank (its earlier chunks would exist only through it), the others go back to
    the waiting queue, are formed again and complete."""
    res = H.run_group(2, [(H.at_point("prefill", "batch_formation", "chunk"), "patched")], timeout_s=20, wall_s=120)
    _check_completed(res, 2)
    per_rank = res[-4]
    assert per_rank[1].injected == 1
    outcomes = per_rank[0].outcomes
    aborted = [rid for rid, (kind, _) in outcomes.items() if kind == "abort"]
    assert len(aborted) == 1 and GUARD_MSG in outcomes[aborted[0]][1], outcomes
    assert sum(kind == "done" for kind, _ in outcomes.values()) == 3


@pytest.mark.parametrize("world,n", [(2, 16), (4, 6)])
@pytest.mark.parametrize("loop", ["prefill", "decode"])
def test_randomized_scenarios_never_hang(loop, world, n):
    """Seeded random arrivals, per-rank bootstrap/transfer timings, real failures, and 1-3 injected
    rank-local divergences per scenario at random points: 0 hangs, every request completes or is
    aborted with a reason."""
    res = H.run_group(world, [((seed, loop, world), "patched") for seed in range(n)], timeout_s=20, wall_s=240)
    totals = _check_completed(res, world)
    _expected_seeds(res, n)
    assert totals["scenarios"] == n and totals["injected"] >= n // 2, totals


@pytest.mark.parametrize("loop", ["prefill", "decode"])
def test_randomized_scenarios_on_the_normal_loop_never_hang(loop):
    """The same on ``event_loop_normal_disagg_*`` (``--disable-overlap-schedule``), patched too."""
    res = H.run_group(2, [((seed, loop, 2, "normal"), "patched") for seed in range(10)], timeout_s=20, wall_s=240)
    assert _check_completed(res, 2)["scenarios"] == 10
    _expected_seeds(res, 10)


def test_decode_queues_are_upstreams():
    """The decode side runs upstream's queue classes: their polls and flag reductions are upstream's."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

    prealloc, transfer = H._decode_queue_classes()
    assert issubclass(prealloc, DecodePreallocQueue) and issubclass(transfer, DecodeTransferQueue)
    assert "_update_handshake_waiters" not in vars(prealloc)
    assert not {"pop_transferred", "resolve_deferred_releases", "_release_request"} & set(vars(transfer))


def test_unreconcilable_divergence_fails_fast_and_exits_nonzero():
    """Batch state no queue edit can repair: every rank fails fast together, logs a diagnosis and
    exits non-zero within 10 s (the guard's timer; the worker itself would sleep 60 s)."""
    from dsv4_sm120.guard import loop_guard

    res = H.run_group(2, [(H.batch_desync("prefill", 2), "patched")], timeout_s=20, wall_s=120)
    per_rank = res[-2]
    assert [r.status for r in per_rank] == ["failfast", "failfast"], per_rank
    assert "batch state differs" in per_rank[0].detail
    for rank, (code, seconds) in res["exits"].items():
        assert code == loop_guard.EXIT_CODE, (rank, code)
        assert seconds < 10, (rank, seconds)


@pytest.mark.slow
@pytest.mark.parametrize("loop,world,n,kind", [("prefill", 2, 250, "overlap"), ("decode", 2, 250, "overlap"),
                                               ("prefill", 4, 150, "overlap"), ("decode", 4, 150, "overlap"),
                                               ("prefill", 2, 100, "normal"), ("decode", 2, 100, "normal")])
def test_thousand_randomized_scenarios_never_hang(loop, world, n, kind):
    """1000 seeded scenarios in all (these six cases together), injection points random, each
    reproducible from its seed: 0 hangs, 0 fail-fasts (no scenario creates unreconcilable state)."""
    res = H.run_group(world, [((seed, loop, world, kind), "patched") for seed in range(n)], timeout_s=30, wall_s=1800)
    totals = _check_completed(res, world)
    assert totals["scenarios"] == n and totals["injected"] >= n // 2, totals
    _expected_seeds(res, n)

"""The guard's two agreement channels on real gloo groups: same answers, and no hang on a dead rank.

Ranks are forked processes on one real gloo group over 127.0.0.1, so the shared-memory channel is
the one ``Agreement`` picks; a rank that reports a different host key forces the gloo channel, as
a TP group spread over hosts would. Nothing is replaced: the scheduler is a stand-in holding only
the attributes the guard reads, because the guard reads nothing else.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from harness.servers import free_port

WIDTH = 11  # the prefill loop's vector: 3 queues x (length, digest) + 5 scalars
ITERS = 300


def _init(rank: int, world: int, port: int):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return dist.new_group(list(range(world)), backend="gloo")


def _expected(i: int, world: int) -> list[int]:
    """Which fields the ranks' vectors differ in at iteration ``i`` (see ``_vector``)."""
    if world == 1 or i % 3:
        return []
    return sorted({i % WIDTH, (i * 7) % WIDTH})


def _vector(i: int, rank: int) -> list[int]:
    rng = random.Random(i)  # same base on every rank
    v = [rng.randrange(2**62) for _ in range(WIDTH)]
    if i % 3 == 0 and rank:
        v[i % WIDTH] += rank
        v[(i * 7) % WIDTH] ^= 1 << (rank % 61)
    return v


def _compare_channels(rank: int, world: int, port: int, split_hosts: bool, out) -> None:
    try:
        from dsv4_sm120.guard import consensus

        if split_hosts and rank == world - 1:
            consensus.host_key = lambda: "another-host"
        group = _init(rank, world, port)
        auto, gloo = consensus.Agreement(group), consensus.Agreement(group, shared_memory=False)
        answers = [(auto.disagreeing_fields(_vector(i, rank)), gloo.disagreeing_fields(_vector(i, rank)))
                   for i in range(ITERS)]
        out.put((rank, auto.transport, gloo.transport, answers))
    except BaseException as e:  # report, so the parent fails with the reason instead of a timeout
        out.put((rank, "error", repr(e), []))


def _run_ranks(target, world: int, *args, timeout_s: float = 120.0) -> list:
    ctx = mp.get_context("fork")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout_s) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_channel_agrees_with_gloo_on_every_iteration(world):
    results = _run_ranks(_compare_channels, world, False)
    for rank, auto, gloo, answers in results:
        assert (auto, gloo) == ("shm", "gloo"), f"rank {rank}: {auto} {gloo}"
        for i, (via_shm, via_gloo) in enumerate(answers):
            assert via_shm == via_gloo == _expected(i, world), f"rank {rank} iteration {i}"
    assert len(results) == world


def test_a_group_spread_over_hosts_agrees_over_gloo():
    results = _run_ranks(_compare_channels, 2, True)
    for rank, auto, gloo, answers in results:
        assert (auto, gloo) == ("gloo", "gloo"), f"rank {rank}: {auto} {gloo}"
        assert [a for a, _ in answers] == [_expected(i, 2) for i in range(ITERS)]


def _one_rank_dies(rank: int, world: int, port: int, out) -> None:
    from dsv4_sm120.guard import loop_guard

    group = _init(rank, world, port)
    sched = SimpleNamespace(  # what check_iteration and snapshot.take read on a prefill scheduler
        attn_tp_cpu_group=group, attn_cp_cpu_group=None, tp_rank=rank, metrics_reporter=None,
        disagg_prefill_bootstrap_queue=SimpleNamespace(queue=[]), waiting_queue=[],
        disagg_prefill_inflight_queue=[], last_batch=None, chunked_req=None, result_queue=[],
        _deferred_input_requests=[],
    )
    for _ in range(50):
        loop_guard.check_iteration(sched, "prefill")
    transport = sched._dsv4_guard.groups[0].transport
    if rank == world - 1:
        _put_and_exit(out, (rank, transport, None, 0.0))  # dies between iterations; unreaped: a zombie
    t0 = time.perf_counter()
    try:
        loop_guard.check_iteration(sched, "prefill")
        result = (rank, transport, "returned without its peer", time.perf_counter() - t0)
    except loop_guard.CollectiveGuardFailFast as e:
        result = (rank, transport, str(e), time.perf_counter() - t0)
    _put_and_exit(out, result)  # skip the fail-fast exit timer and gloo teardown with a dead peer


def _ranks_at_different_points(rank: int, world: int, port: int, split_hosts: bool, out) -> None:
    """Rank 0 reaches the waiting queue's poll site, rank 1 the batch check, as when an upstream
    branch between them (decode's early return on retracted requests, say) went differently."""
    from dsv4_sm120.guard import batch_check, consensus, loop_guard, queue_check

    if split_hosts and rank == world - 1:
        consensus.host_key = lambda: "another-host"  # the gloo channel: equal-size messages still
    group = _init(rank, world, port)
    sched = SimpleNamespace(
        attn_tp_cpu_group=group, attn_cp_cpu_group=None, tp_rank=rank, metrics_reporter=None,
        disagg_prefill_bootstrap_queue=SimpleNamespace(queue=[]), waiting_queue=[],
        disagg_prefill_inflight_queue=[], last_batch=None, chunked_req=None, result_queue=[],
        _deferred_input_requests=[],
    )
    loop_guard.check_iteration(sched, "prefill")
    transport = sched._dsv4_guard.groups[0].transport
    try:
        if rank == 0:
            queue_check.agree_on_queue(sched, "waiting")
        else:
            batch_check._checked(sched, SimpleNamespace(batch_to_run=None, running_batch=None), None)
        result = (rank, transport, "went on")
    except loop_guard.CollectiveGuardFailFast as e:
        result = (rank, transport, str(e))
    _put_and_exit(out, result)


@pytest.mark.parametrize("split_hosts", [False, True], ids=["shm", "gloo"])
def test_ranks_at_different_guard_points_fail_fast_instead_of_pairing_unlike_agreements(monkeypatch, split_hosts):
    monkeypatch.setenv("DSV4_SM120_COLLECTIVE_GUARD", "1")
    results = sorted(_run_ranks(_ranks_at_different_points, 2, split_hosts, timeout_s=60.0))
    for rank, transport, what in results:
        assert transport == ("gloo" if split_hosts else "shm")
        assert "FAIL FAST" in what and "different guard points (waiting, batch" in what, (rank, what)


def _put_and_exit(out, item) -> None:
    out.put(item)
    out.close()
    out.join_thread()  # the queue's feeder thread must flush before os._exit
    os._exit(0)


def test_a_dead_rank_fails_the_survivors_fast_instead_of_hanging(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_COLLECTIVE_GUARD", "1")
    results = sorted(_run_ranks(_one_rank_dies, 2, timeout_s=60.0))
    (_, transport, why, waited), _ = results
    assert transport == "shm"
    assert "FAIL FAST" in why and "died" in why, why
    assert waited < 5.0, f"the survivor waited {waited:.1f} s"


def _polls_through_upstream(rank: int, world: int, port: int, out) -> None:
    try:
        from sglang.srt.disaggregation import utils as upstream

        from dsv4_sm120.guard import consensus

        group = _init(rank, world, port)
        before = upstream._all_reduce_polls([rank + 1, 4], group)  # no guard channel yet: gloo
        consensus.Agreement(group).disagreeing_fields([0] * WIDTH)  # what the guard does first
        upstream.all_reduce_flags = None  # from here on, a gloo reduction would raise TypeError
        pollers = [SimpleNamespace(poll=lambda v=v: v) for v in ((rank + 2) % 5, 4 - rank, 3)]
        after = [upstream.poll_and_all_reduce(pollers, group) for _ in range(ITERS)]
        out.put((rank, before, after))
    except BaseException as e:
        out.put((rank, repr(e), None))


def test_upstream_poll_reduction_goes_through_the_guards_shared_memory():
    """Upstream's real ``poll_and_all_reduce`` with the plugin's hook applied, on 3 gloo ranks."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from harness import pd_loop

    pd_loop._apply_guard_hooks()
    assert "sglang.srt.disaggregation.utils._all_reduce_polls" in HookRegistry._patched
    world = 3
    expected = [min((r + 2) % 5 for r in range(world)), 4 - (world - 1), 3]
    for rank, before, after in _run_ranks(_polls_through_upstream, world):
        assert before == [1, 4], f"rank {rank}: {before}"
        assert after == [expected] * ITERS, f"rank {rank}: {after if after is None else after[:3]}"

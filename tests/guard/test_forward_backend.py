"""The patched-loop harness's forward group and stall watchdog, on gloo (CPU): what the two-GPU NCCL
run of ``bench/guard_nccl_2gpu.py`` relies on, short of NCCL itself.

The pin's real patched loops run on 2 forked gloo ranks as in ``test_overlap_loops``; ``run_batch``'s
stand-in issues a DeepSeek-V4-Flash-shaped TP forward (the pin's hidden size and vocabulary, bf16;
2 layers instead of 43 to keep the test short) on a forward group of its own, beside the
scheduler's gloo group. What is replaced and why: see ``harness.pd_loop``. NCCL is what this
machine cannot run (no GPU); the gloo forward group takes its place, and the scheduler group's
timeout is set past the watchdog's, so, as with NCCL waiting on a missing peer, only the watchdog
can end the hang.
"""

from __future__ import annotations

import pytest

from harness import pd_loop as H

SCHEDULER = "scheduler gloo (TP CPU group)"
FORWARD = "forward gloo"
# Rank 1 alone leaves a request out of its batch: rank 0 runs a forward, rank 1 does not.
CASE = ("prefill", "batch_formation", "skip")


@pytest.fixture(scope="module", autouse=True)
def parent(tmp_path_factory):
    H.setup_parent(str(tmp_path_factory.mktemp("patched_sglang")))


def _forward() -> H.ForwardSpec:
    return H.ForwardSpec("gloo", H.dsv4_flash_shape(layers=2))


def test_the_forward_is_shaped_by_the_pins_config_and_every_rank_keeps_multicast_off():
    shape = H.dsv4_flash_shape()
    assert (shape.hidden, shape.layers, shape.vocab, shape.dtype) == (4096, 43, 129280, "bfloat16")
    assert shape.collectives() == 2 * 43 + 2  # per layer attention + MoE; embedding; logits
    for backend in ("gloo", "nccl"):
        env = H.rank_env(H.ForwardSpec(backend), "/tmp/dumps")
        assert {k: env[k] for k in H.MULTICAST_OFF} == H.MULTICAST_OFF
    nccl = H.rank_env(H.ForwardSpec("nccl"), "/tmp/dumps")
    assert nccl["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and int(nccl["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert nccl["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and nccl["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith("/tmp/dumps/")


def test_guard_off_the_hang_is_located_per_rank_and_the_watchdog_ends_it(tmp_path):
    """Guard switched off: rank 0 waits in the forward group's first all-reduce, rank 1 in the
    scheduler group's request broadcast (the incident's wedge: two groups at once). Each rank's
    watchdog records where it is (the collective, its group, the stack), and the hang is ended."""
    sc = H.at_point(*CASE)
    watch = H.Watch(str(tmp_path), stall_s=2.0, kill_s=6.0)
    res = H.run_group(2, [(sc, "patched", {"DSV4_SM120_COLLECTIVE_GUARD": "0"})], timeout_s=120, wall_s=90,
                      forward=_forward(), watch=watch)
    # Each rank's watchdog ends it kill_s after its own stall. The rank ended first closes its gloo
    # sockets, so the other one's pending collective may fail with the peer gone before its own
    # watchdog fires (on a loaded machine the two deadlines drift apart): it then ends "error".
    # Both have recorded where they hung: the stall record comes kill_s - stall_s before the kill.
    statuses = [r.status for r in res[sc.seed]]
    assert "killed_by_watchdog" in statuses and set(statuses) <= {"killed_by_watchdog", "error"}, res[sc.seed]
    for rank, status in enumerate(statuses):
        if status == "killed_by_watchdog":
            assert res["exits"][rank][0] == H.WATCHDOG_EXIT and res["stalls"][rank]["stalls"][-1]["killed"]
    hung = {rank: info["hung"] for rank, info in res["stalls"].items() if info["hung"]}
    assert sorted(hung) == [0, 1], res["stalls"]
    assert hung[0]["where"].startswith(FORWARD) and hung[0]["forward_pending"][0]["op"] == "all_reduce"
    assert any("_run_batch" in frame for frame in hung[0]["main_stack"])
    assert hung[1]["where"].startswith(f"{SCHEDULER}: broadcast")
    assert any("broadcast_pyobj" in frame for frame in hung[1]["main_stack"])
    for info in res["stalls"].values():  # every thread's stack, from faulthandler
        assert info["faulthandler"].count("most recent call first") >= 2  # the loop's thread and the watchdog's
    assert "_run_batch" in res["stalls"][0]["faulthandler"]


def test_guard_on_reconciles_with_the_forward_on_its_own_group(tmp_path):
    """The same divergence and one on the decode side, guard on: every rank finishes, the ranks'
    forward collectives pair one to one (the harness compares their sequences), nothing stalls."""
    cases = [CASE, ("decode", "transfer", "complete")]
    jobs = []
    for i, case in enumerate(cases):
        sc = H.at_point(*case)
        sc.seed = i
        jobs.append((sc, "patched", {"DSV4_SM120_COLLECTIVE_GUARD": "1"}))
    res = H.run_group(2, jobs, timeout_s=20, wall_s=120, forward=_forward(),
                      watch=H.Watch(str(tmp_path), stall_s=10.0, kill_s=30.0))
    for i, case in enumerate(cases):
        per_rank = res[i]
        assert [r.status for r in per_rank] == ["ok", "ok"], (case, per_rank)
        assert per_rank[1].injected == 1 and all(r.counters["reconciled"] >= 1 for r in per_rank), case
        assert per_rank[0].forward_ops == per_rank[1].forward_ops > 0, case
    assert not any(info["stalls"] for info in res["stalls"].values())


@pytest.mark.slow
def test_spawned_ranks_run_the_patched_loops_too(tmp_path):
    """The NCCL run starts its ranks as fresh interpreters (CUDA does not survive a fork of a process
    that imported sglang): the same guard-on scenario through ``start="spawn"``."""
    sc = H.at_point(*CASE)
    res = H.run_group(2, [(sc, "patched", {"DSV4_SM120_COLLECTIVE_GUARD": "1"})], timeout_s=20, wall_s=300,
                      forward=_forward(), watch=H.Watch(str(tmp_path), stall_s=30.0, kill_s=60.0), start="spawn")
    assert [r.status for r in res[sc.seed]] == ["ok", "ok"], res[sc.seed]
    assert res[sc.seed][0].forward_ops == res[sc.seed][1].forward_ops > 0

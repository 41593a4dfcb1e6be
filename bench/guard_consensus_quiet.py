"""Cost of the collective guard's own per-iteration call on a quiet host, gloo, TP = 2, 4, 8.

Why this exists beside ``bench/guard_cpu.py``: that bench runs upstream's real patched loop, so
it needs sglang, and on the 2-core shared dev machine one gloo collective takes about a
millisecond, which buries a cost measured in microseconds. This one needs only torch, so it runs
on any many-core host (here: the 16-core CPU of an H200 host; the GPU is unused).

What one iteration does, on one gloo group of ``tp`` processes over 127.0.0.1:

- base (what upstream's ``event_loop_overlap_disagg_prefill`` issues every iteration while
  requests wait in the bootstrap queue and nothing new arrives): the request broadcast with
  ``broadcast_pyobj`` semantics (a length tensor, then the pickled bytes when non-empty; here the
  idle case, length 0), then the bootstrap-queue poll, a MIN all-reduce of one int32 per queued
  request (``all_reduce_flags``);
- guard: the same, plus the exact call the patch adds between the two,
  ``dsv4_sm120.guard.loop_guard.check_iteration(scheduler, "prefill")``, on a stand-in scheduler
  that holds ``--queued`` request ids in its bootstrap queue (the real ``snapshot.take`` and
  ``consensus.Agreement``; the ranks agree, so no reconciliation runs). All ranks share the host,
  so the agreement goes through the shared-memory channel, as it does for a one-host TP group;
- top_only: guard, with the poll's MIN-reduction going through the plugin's AROUND hook on
  upstream's ``_all_reduce_polls`` (``dsv4_sm120.guard.poll_reduce``), i.e. through the guard's
  shared memory (what the package ran before the later agreements existed);
- top_batch: top_only plus the second agreement, on the formed batch, after the poll
  (``dsv4_sm120.guard.batch_check``'s check with no batch formed, as in an idle iteration);
- package: top_batch plus the agreements the package runs before the waiting-queue and in-flight
  polls (``queue_check.agree_on_queue``, both queues empty here): one idle prefill iteration with
  the package as shipped on a one-host TP group, guard on;
- guard_gloo: the guard call with the agreement forced onto the gloo channel (what a TP group
  spread over hosts uses), for comparison;
- snapshot_only and agree_only: the guard's two parts alone, to say where its cost goes: reading
  this rank's queues into a vector (no agreement), and the shared-memory agreement on a fixed
  vector (no queue reading).

Rounds run the kinds in rotating order in the same processes after a warm-up of each;
per round the slowest rank's time per iteration counts (collectives make ranks wait for each
other); figures are medians over rounds. It does NOT run sglang's loop, a scheduler, a model or a
serving workload: only the guard's collectives against the collectives they sit between. It imports
only the guard's torch-only modules (no sglang, no plugin registration), so a checkout with
``PYTHONPATH=src`` runs it where the package is not installed, from the repository root:

    PYTHONPATH=src python -m bench.guard_consensus_quiet --out bench/results/guard/guard_quiet_h200host_$(date -u +%F).json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from harness import run_record
from harness.servers import free_port


def broadcast_pyobj(data: list, rank: int, group, src: int = 0) -> list:
    """``broadcast_pyobj`` semantics on CPU: length tensor, then the pickled bytes if non-empty."""
    import torch
    import torch.distributed as dist

    if rank == src:
        payload = pickle.dumps(data) if data else b""
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.long), src=src, group=group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=src, group=group)
        return data
    size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if n == 0:
        return []
    buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return pickle.loads(buf.numpy().tobytes())


def poll_min_all_reduce(polls: list[int], group) -> list[int]:
    """The bootstrap-queue poll: MIN all-reduce of one int32 per queued request."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(polls, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.tolist()


def stand_in_scheduler(rank: int, group, queued: int) -> SimpleNamespace:
    """The attributes ``loop_guard.check_iteration`` and ``snapshot.take`` read, and nothing else."""
    reqs = [SimpleNamespace(rid=f"{i:032x}", http_worker_ipc=None) for i in range(queued)]
    return SimpleNamespace(
        attn_tp_cpu_group=group,
        attn_cp_cpu_group=None,
        tp_rank=rank,
        metrics_reporter=None,
        disagg_prefill_bootstrap_queue=SimpleNamespace(queue=reqs),
        waiting_queue=[],
        disagg_prefill_inflight_queue=[],
        last_batch=None,
        chunked_req=None,
        result_queue=[],
        _deferred_input_requests=[],
    )


KINDS = ("base", "guard", "top_only", "top_batch", "package", "guard_gloo", "snapshot_only", "agree_only")


def _worker(rank: int, tp: int, port: int, args: dict, results) -> None:
    os.environ["DSV4_SM120_COLLECTIVE_GUARD"] = "1"
    import torch
    import torch.distributed as dist

    from dsv4_sm120.guard import consensus, loop_guard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    group = dist.new_group(list(range(tp)), backend="gloo")  # like upstream's TP CPU group
    sched = stand_in_scheduler(rank, group, args["queued"])
    sched_gloo = stand_in_scheduler(rank, group, args["queued"])
    polls = [1] * args["queued"]  # KVPoll.WaitingForInput: still bootstrapping

    # self-check once: a non-empty broadcast round-trips, the poll reduces, the guard agrees
    assert broadcast_pyobj([{"rid": "x"}] if rank == 0 else [], rank, group) == [{"rid": "x"}]
    assert poll_min_all_reduce([rank + 1] * 3, group) == [1, 1, 1]
    loop_guard.check_iteration(sched_gloo, "prefill")  # builds its state; then force the gloo channel
    sched_gloo._dsv4_guard.groups = [consensus.Agreement(group, shared_memory=False)]
    loop_guard.check_iteration(sched_gloo, "prefill")
    assert [a.transport for a in sched_gloo._dsv4_guard.groups] == ["gloo"]
    loop_guard.check_iteration(sched, "prefill")  # set up last: the group's shared channel is its
    assert [a.transport for a in sched._dsv4_guard.groups] == ["shm"], "guard is not on shared memory"
    from dsv4_sm120.guard import batch_check, poll_reduce, queue_check, snapshot

    agree = sched._dsv4_guard.groups[0]
    constant = snapshot.take(sched, "prefill").vector()
    top = lambda: loop_guard.check_iteration(sched, "prefill")  # noqa: E731
    steps = {
        "guard": top,
        "top_only": top,
        "top_batch": top,
        "package": top,
        "guard_gloo": lambda: loop_guard.check_iteration(sched_gloo, "prefill"),
        "snapshot_only": lambda: snapshot.take(sched, "prefill").vector(),
        "agree_only": lambda: agree.disagreeing_fields(constant),
    }
    no_batch = SimpleNamespace(batch_to_run=None, running_batch=None)

    def batch_agreement():  # the second agreement, on the batch this idle iteration formed (none)
        assert batch_check._checked(sched, no_batch, None) is no_batch

    def later_agreements():  # get_next's waiting poll site, the batch check, then the in-flight poll site
        queue_check.agree_on_queue(sched, "waiting")
        batch_agreement()
        queue_check.agree_on_queue(sched, "inflight")

    after_poll = {"top_batch": batch_agreement, "package": later_agreements}
    assert consensus.shared_channel(group) is agree
    assert poll_reduce.all_reduce_polls(None, [rank + 1] * 3, group) == [1, 1, 1]  # no gloo: original is None

    def shm_poll(p, g):  # the plugin's AROUND hook on upstream's _all_reduce_polls
        return poll_reduce.all_reduce_polls(poll_min_all_reduce, p, g)

    def run(kind: str, iters: int) -> tuple[float, float, float]:
        inside = inside_after = 0.0
        step = steps.get(kind)
        poll = shm_poll if kind in ("top_only", "top_batch", "package") else poll_min_all_reduce
        after = after_poll.get(kind)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            broadcast_pyobj([], rank, group)  # ingest_requests: nothing new arrived
            if step is not None:
                g0 = time.perf_counter()
                step()
                inside += time.perf_counter() - g0
            poll(polls, group)  # pop_bootstrapped
            if after is not None:
                g0 = time.perf_counter()
                after()
                inside_after += time.perf_counter() - g0
        us = (time.perf_counter() - t0) / iters * 1e6
        return us, (inside + inside_after) / iters * 1e6, inside_after / iters * 1e6

    kinds = args["kinds"]
    for kind in kinds:
        run(kind, args["warmup"])
    rounds = []
    for i in range(args["rounds"]):
        order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]  # rotate which kind goes first
        for kind in order:
            us, inside, inside_after = run(kind, args["iters"])
            rounds.append({"kind": kind, "us": us, "inside_us": inside, "inside_after_us": inside_after})
    c = loop_guard.counters
    assert c.divergences_seen == 0 and c.fail_fasts == 0, f"ranks disagreed during the bench: {c.line()}"
    per_rank = [None] * tp
    dist.all_gather_object(per_rank, rounds, group=group)
    if rank == 0:
        results.put(per_rank)
    dist.barrier(group=group)
    dist.destroy_process_group()


def measure(tp: int, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, tp, port, args, results)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        per_rank = results.get(timeout=args["timeout_s"])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise SystemExit(f"TP={tp}: worker exit codes {bad}")
    kinds = args["kinds"]
    slowest = {k: [] for k in kinds}
    inside = {k: [] for k in kinds}
    inside_after = {k: [] for k in kinds}
    for j, first in enumerate(per_rank[0]):
        slowest[first["kind"]].append(max(rank_rounds[j]["us"] for rank_rounds in per_rank))
        inside[first["kind"]].append(statistics.median(rank_rounds[j]["inside_us"] for rank_rounds in per_rank))
        inside_after[first["kind"]].append(
            statistics.median(rank_rounds[j]["inside_after_us"] for rank_rounds in per_rank))
    row = {"tp": tp}
    for kind in kinds:
        row[f"us_per_iter_{kind}"] = round(statistics.median(slowest[kind]), 2)
    for kind in kinds[1:]:
        row[f"{kind}_cost_us"] = round(row[f"us_per_iter_{kind}"] - row["us_per_iter_base"], 2)
        row[f"{kind}_ratio"] = round(row[f"us_per_iter_{kind}"] / row["us_per_iter_base"], 3)
        row[f"us_inside_{kind}_call"] = round(statistics.median(inside[kind]), 2)
    if {"top_only", "top_batch"} <= set(kinds):
        row["second_agreement_us"] = round(row["us_per_iter_top_batch"] - row["us_per_iter_top_only"], 2)
        # the same agreement timed from inside: the batch check's call alone (median over ranks,
        # waiting for the slowest rank included), in the top_batch kind
        row["us_inside_second_agreement"] = round(statistics.median(inside_after["top_batch"]), 2)
    if {"top_only", "package"} <= set(kinds):
        row["later_agreements_us"] = round(row["us_per_iter_package"] - row["us_per_iter_top_only"], 2)
        row["us_inside_later_agreements"] = round(statistics.median(inside_after["package"]), 2)
    for kind in kinds:
        row[f"rounds_{kind}_us"] = [round(x, 2) for x in slowest[kind]]
    if "top_batch" in kinds:
        row["rounds_us_inside_second_agreement"] = [round(x, 2) for x in inside_after["top_batch"]]
    return row


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=1500, help="loop iterations per round")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of every kind per TP size")
    ap.add_argument("--warmup", type=int, default=500, help="iterations of each kind before timing")
    ap.add_argument("--queued", type=int, default=16, help="request ids in the bootstrap queue")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per TP size")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                    help="what to time (base first); default: all")
    ap.add_argument("--commit", default=None, help="commit measured (when run outside a git checkout)")
    ap.add_argument("--device", default=None, help="host description prefix, e.g. where it ran")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if min(a.tp) < 2:
        ap.error("--tp sizes must be >= 2: the guard does nothing on a single rank")
    import torch

    if a.kinds[0] != "base":
        ap.error("--kinds must start with base")
    args = {"iters": a.iters, "rounds": a.rounds, "warmup": a.warmup, "queued": a.queued, "timeout_s": a.timeout_s,
            "kinds": tuple(a.kinds)}
    load_start = os.getloadavg()
    rows = []
    for tp in a.tp:
        row = measure(tp, args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("rounds_")}), flush=True)
    cores = os.cpu_count()
    host = (
        f"{a.device + '; ' if a.device else ''}CPU only: {_cpu_model()}, os.cpu_count()={cores}, "
        f"{len(os.sched_getaffinity(0))} usable; GPU unused; gloo over 127.0.0.1"
    )
    out = {
        "date": run_record.now_utc(),
        "device": host,
        "commit": run_record.commit(a.commit),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "method": (
            "Per TP size, tp spawned processes on one gloo group over 127.0.0.1. One iteration: base = "
            "broadcast_pyobj-equivalent request broadcast (idle: length tensor 0) + bootstrap poll MIN "
            f"all-reduce of {a.queued} int32; guard = base + dsv4_sm120.guard.loop_guard.check_iteration"
            f"(stand-in scheduler with {a.queued} request ids in the bootstrap queue, ranks agreeing) between "
            "the two, as the patch places it, agreeing through the shared-memory channel (one host); "
            "top_only = guard with the poll MIN-reduced through dsv4_sm120.guard.poll_reduce (the plugin's hook on "
            "_all_reduce_polls: shared memory); top_batch = top_only + the second agreement (batch_check, no batch "
            "formed) after the poll; package = top_batch + the waiting and in-flight poll-site agreements "
            "(queue_check, empty queues): an idle iteration as shipped; second_agreement_us = top_batch - top_only "
            "(per-iteration medians); us_inside_second_agreement = time inside the batch check's call in top_batch "
            "(median over rounds of the median over ranks, waiting for the slowest rank included); "
            "guard_gloo = guard with the agreement forced onto the gloo channel; snapshot_only / agree_only = "
            "the guard's queue reading alone / its shared-memory agreement on a fixed vector alone. "
            f"{a.warmup} warm-up iterations of each, then {a.rounds} rounds of {a.iters} iterations of each "
            "kind, in rotating order. Per round: the slowest "
            "rank's time per iteration; figures: medians over rounds; guard_cost_us = guard - base; "
            "us_inside_guard_call = median over ranks of time inside the call (includes waiting for the "
            "slowest rank). Not sglang's loop, no scheduler, no model, no serving."
        ),
        "goal": "package iteration below base; second agreement <= 30 us at TP=8 on shared memory",
        "iters_per_round": a.iters,
        "rounds": a.rounds,
        "warmup_iters": a.warmup,
        "queued_requests": a.queued,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "kinds": list(a.kinds),
        "tp": [r["tp"] for r in rows],
        "results": rows,
    }
    for key in ("us_per_iter_base", "us_per_iter_package", "package_cost_us", "package_ratio",
                "second_agreement_us", "us_inside_second_agreement", "later_agreements_us",
                "us_per_iter_guard", "guard_cost_us", "us_per_iter_guard_gloo"):
        if all(key in r for r in rows):
            out[key] = [r[key] for r in rows]
    out["results"] = out.pop("results")  # last, after the headline lists
    run_record.write(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

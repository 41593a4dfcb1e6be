"""Run upstream's REAL PD loops on TP ranks joined by REAL gloo groups, without a model.

What is real (sglang 0.5.23, unmodified except for our patch):
- ``Scheduler.event_loop_overlap_disagg_prefill`` / ``event_loop_overlap_disagg_decode`` and the
  non-overlap ``event_loop_normal_disagg_*``, taken from a COPY of the pinned files with
  ``patches/`` applied by ``dsv4_sm120.patching`` (``loops="patched"``), or from a pristine copy
  (``loops="upstream"``), whatever state the venv's sglang is in (``pristine``);
- ``Scheduler.ingest_requests`` and the request broadcast (``broadcast_pyobj`` on the TP CPU group);
- prefill: ``PrefillBootstrapQueue.pop_bootstrapped`` / ``finalize_bootstrap``,
  ``get_next_disagg_prefill_batch_to_run``, ``resolve_waiting_queue_bootstrap``,
  ``process_disagg_prefill_inflight_queue``, ``handle_bootstrap_failure``,
  ``handle_inflight_transfer_failure``; decode: ``process_decode_queue``,
  ``get_next_disagg_decode_batch_to_run``'s caller, ``DecodePreallocQueue._update_handshake_waiters``
  (the handshake poll), ``DecodeTransferQueue.pop_transferred`` whole (its poll, failure handling,
  the ``all_reduce_flags`` of failure holds, metadata-slot release) and ``resolve_deferred_releases``;
  all queue polls go through upstream's ``poll_and_all_reduce*`` (MIN all-reduce on gloo, or, with
  the guard on, through the package's shared-memory reduction hooked on ``_all_reduce_polls``);
- the guard's hooks, registered by ``dsv4_sm120.guard.hooks.register`` with upstream's
  ``HookRegistry`` as the plugin does (they act only on a scheduler the patched loop guards);
- ``Scheduler.on_idle``; ``Scheduler.send_abort_output`` through upstream's ``SenderWrapper`` over a
  real zmq PUSH/PULL pair on TP rank 0 (the only rank with a tokenizer socket, as upstream);
- ``Req`` objects, ``prepare_abort``, ``ReqToMetadataIdxAllocator``.

What is replaced, and why (each replacement issues on the same gloo group the collectives that
upstream's version issues, so a rank that runs it and a rank that does not desynchronise exactly as
in production):
- batch building (``get_new_batch_prefill``; decode ``get_next_disagg_decode_batch_to_run``): needs
  KV pools and a memory planner that need a model. The replacement batches every admitted request.
- ``run_batch``: a model forward. The replacement issues a TP forward's collectives, sized by the
  batch's token count, on a "forward" group of its own (``ForwardSpec``): gloo (the default, CPU)
  or NCCL (one GPU per rank), as production runs the forward on NCCL beside the scheduler's gloo
  CPU group. Its result processing waits for them where upstream's does (``copy_done``).
- result processing (``process_batch_result``): needs logits. Prefill: requests move to the
  in-flight (KV transfer) queue as upstream's disagg prefill result processing does; decode: each
  request decodes its tokens and finishes.
- ``process_input_requests``: tokenized-request handling needs a tokenizer and model config; the
  replacement turns each broadcast request into a real ``Req`` placed in the bootstrap (prefill) or
  preallocation (decode) queue, as ``handle_generate_request`` + the queue's ``add`` do.
- KV senders/receivers (NIXL): replaced by pollers scripted per rank (bootstrap done, transfer done,
  failed at given iterations); their poll() is what the real polls reduce.
- decode queues: upstream's classes, built without ``__init__`` (it needs a KV manager). Of the
  preallocation queue only ``pop_preallocated``'s KV preallocation is replaced (pools need a model):
  it calls upstream's handshake poll, streams failed requests as upstream does, and admits every
  request whose handshake is done. Of the transfer queue only ``_commit_transfer_to_req`` (it reads
  the model's first token from the metadata buffers), and the metadata buffers themselves (a slot
  table whose rooms always read "landed").
- tree cache, metrics and load publishers, invariant checker: observe KV pools that do not exist.

The divergences a mass abort creates are injected on one rank only, at every point of an
iteration where rank-local state changes (``POINTS``): after the request broadcast; in
``process_pending_chunked_abort``; in ``resolve_waiting_queue_bootstrap``; in batch formation; in
batch-result processing; before the in-flight poll; decode: before the preallocation and transfer
polls, in batch formation and result processing. What is injected: a request aborted on that rank
only; a bootstrap or transfer completing on that rank only; a request left out of that rank's batch;
one rank's queue emptied while another's is not.

Bounded waits and where a hang sits (``Watch``): every collective of a group times out (gloo, and
NCCL through ``new_group(timeout=...)`` with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); with a ``Watch``
each rank also records which collective it is in, by group (``CollectiveTrace``), and runs a
watchdog that, when the loop stops iterating, writes every thread's Python stack (faulthandler),
the collectives in flight and, on NCCL, torch's flight recorder; later it ends the rank. NVLink
multicast is off in every rank (``rank_env``).
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

from harness.servers import free_port

WAITING, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS, FAILED = "W", "B", "WI", "T", "S", "F"
HIDDEN = 8


# ----------------------------------------------------------------------------------------------
# Scenarios: seeded, reproducible, identical on every rank (each rank rebuilds it from the seed).
@dataclass
class ReqPlan:
    rid: str
    arrive: int  # iteration at which rank 0 receives it and broadcasts it
    ready: list[int]  # per rank: iterations after arrival until bootstrap (prefill) / prealloc (decode) completes
    transfer: list[int]  # per rank: iterations after the transfer starts until it completes
    fail_rank: int | None = None  # this rank's poller reports Failed (a real, MIN-reduced failure)
    fail_in_transfer: bool = False  # ... only once its transfer started (else from its bootstrap on)
    tokens: int = 2  # decode steps


@dataclass
class Injection:
    at: int  # the first iteration it may fire; it fires the first time its point has something to act on
    rank: int
    kind: str  # "abort" | "complete" | "empty" | "batch" | "skip" | "chunk"
    rid: str | None = None  # the request it acts on; None: the ``pick``-th candidate at that point
    point: str = "broadcast"
    pick: int = 0


# Where in an iteration a rank-local change is injected, and what may be injected there.
POINTS = {
    "prefill": {"broadcast": ("abort", "complete", "empty"), "chunked_abort": ("abort",),
                "resolve_waiting": ("abort",), "batch_formation": ("abort", "skip"),
                "batch_result": ("abort",), "inflight": ("abort", "complete")},
    "decode": {"broadcast": ("abort", "complete", "empty"), "prealloc": ("abort", "complete"),
               "transfer": ("abort", "complete"), "batch_formation": ("abort", "skip"),
               "batch_result": ("abort",)},
}


@dataclass
class Scenario:
    seed: int
    loop: str
    world: int
    reqs: list[ReqPlan]
    injections: list[Injection]
    max_iters: int = 400
    ends_at_max: bool = False  # the bench: running max_iters iterations is the point, not a failure
    kind: str = "overlap"  # which of upstream's loops: "overlap" or "normal" (--disable-overlap-schedule)


def make_scenario(seed: int, loop: str, world: int, kind_of_loop: str = "overlap") -> Scenario:
    rng = random.Random(f"{loop}-{world}-{seed}" + ("" if kind_of_loop == "overlap" else f"-{kind_of_loop}"))
    n = rng.randint(2, 8)
    reqs = []
    for i in range(n):
        base_ready, base_tr = rng.randint(0, 4), rng.randint(1, 4)
        reqs.append(ReqPlan(
            rid=f"s{seed}-r{i}",
            arrive=rng.randint(0, 6),
            ready=[base_ready + rng.randint(0, 2) for _ in range(world)],
            transfer=[base_tr + rng.randint(0, 2) for _ in range(world)],
            fail_rank=rng.randrange(world) if rng.random() < 0.1 else None,
            tokens=rng.randint(1, 3),
            fail_in_transfer=rng.random() < 0.5,
        ))
    injections = []
    for _ in range(rng.randint(1, 3)):
        point = rng.choice(sorted(POINTS[loop]))
        kind = rng.choice(POINTS[loop][point])
        r = rng.choice(reqs)
        injections.append(Injection(at=r.arrive + rng.randint(0, 5), rank=rng.randrange(world), kind=kind,
                                    rid=r.rid if point == "broadcast" else None, point=point,
                                    pick=rng.randrange(8)))
    return Scenario(seed, loop, world, reqs, injections, kind=kind_of_loop)


def steady(loop: str, world: int, iters: int, queued: int) -> Scenario:
    """For the bench: ``queued`` requests arrive at once and stay bootstrapping for ``iters``
    iterations (every iteration polls them), then the scenario ends at ``iters``."""
    reqs = [ReqPlan(rid=f"st-r{i}", arrive=0, ready=[iters + 10] * world, transfer=[1] * world) for i in range(queued)]
    return Scenario(-3, loop, world, reqs, [], max_iters=iters, ends_at_max=True)


def steady_decode(world: int, iters: int, batch: int) -> Scenario:
    """For the bench: ``batch`` requests reach the running batch within a few iterations and decode
    until the scenario ends at ``iters``: a forward every iteration, beside the guard's agreements."""
    reqs = [ReqPlan(rid=f"sd-r{i}", arrive=0, ready=[0] * world, transfer=[1] * world, tokens=iters + 10)
            for i in range(batch)]
    return Scenario(-5, "decode", world, reqs, [], max_iters=iters, ends_at_max=True)


def batch_desync(loop: str, world: int) -> Scenario:
    """Unreconcilable: one rank's batch state differs; the guard must fail fast."""
    reqs = [ReqPlan(rid=f"bd-r{i}", arrive=0, ready=[1] * world, transfer=[9] * world) for i in range(2)]
    return Scenario(-2, loop, world, reqs, [Injection(at=3, rank=world - 1, kind="batch")], max_iters=60)


def at_point(loop: str, point: str, kind: str, world: int = 2, kind_of_loop: str = "overlap") -> Scenario:
    """One divergence, ``kind`` at ``point`` on the last rank, in a scenario that reaches every point:
    requests arrive over a few iterations and stay long enough in every queue."""
    reqs = [ReqPlan(rid=f"pt-r{i}", arrive=i, ready=[2] * world, transfer=[3] * world, tokens=3) for i in range(4)]
    return Scenario(-4, loop, world, reqs, [Injection(at=1, rank=world - 1, kind=kind, point=point)],
                    max_iters=80, kind=kind_of_loop)


def one_sided_empty(loop: str, world: int) -> Scenario:
    """The deterministic incident: one rank's queue empties while the other ranks' do not."""
    reqs = [ReqPlan(rid=f"inc-r{i}", arrive=0, ready=[6] * world, transfer=[2] * world) for i in range(3)]
    return Scenario(-1, loop, world, reqs, [Injection(at=2, rank=world - 1, kind="empty")], max_iters=60)


# ----------------------------------------------------------------------------------------------
# Replacements for the parts that need a model, pools or NIXL.
class ScriptedPoller:
    """Stands in for a NIXL KV sender/receiver: per-rank scripted state, polled by upstream's polls."""

    def __init__(self, plan: ReqPlan, rank: int, clock):
        self.plan, self.rank, self.clock = plan, rank, clock
        self.ready_at = clock() + plan.ready[rank]
        self.transfer_from = None
        self.aborted = False
        self.kv_mgr = None

    def poll(self):
        from sglang.srt.disaggregation.base.conn import KVPoll

        now = self.clock()
        failing = self.plan.fail_rank == self.rank and now >= self.ready_at
        if self.aborted or (failing and (self.transfer_from is not None or not self.plan.fail_in_transfer)):
            return KVPoll.Failed
        if now < self.ready_at:
            return KVPoll.Bootstrapping
        if self.transfer_from is None:
            return KVPoll.WaitingForInput
        if now < self.transfer_from + self.plan.transfer[self.rank]:
            return KVPoll.Transferring
        return KVPoll.Success

    # sender side (prefill)
    def init(self, num_pages, metadata_index):
        pass

    def pop_decode_prefix_len(self):
        return 0

    def start_transfer(self):
        self.transfer_from = self.clock()

    def abort(self):
        self.aborted = True

    def clear(self):
        pass

    def failure_exception(self):
        raise RuntimeError(f"scripted KV failure on rank {self.rank}")

    def get_transfer_metric(self):
        return SimpleNamespace(transfer_total_bytes=None)  # nothing was moved: no speed to report


class FakeBatch:
    """What upstream's batch builder returns, reduced to what the loops read."""

    def __init__(self, reqs, mode: str = "extend", chunked=None):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.reqs = list(reqs)
        self.mode = mode
        self.forward_mode = ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE
        self.prefill_chunk_processed = False
        self.inner_idle_batch = None
        self.chunked_req = chunked  # a request of this batch whose prefill is split: half its tokens this time
        self.batch_is_full = False

    @property
    def extend_num_tokens(self):
        if self.mode != "extend":
            return None
        return sum(len(r.origin_input_ids) // (2 if r is self.chunked_req else 1) for r in self.reqs)

    @property
    def seq_lens_sum(self):
        return sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.reqs)

    def is_empty(self):
        return not self.reqs

    def batch_size(self):
        return len(self.reqs)

    def copy(self):
        return FakeBatch(self.reqs, self.mode, self.chunked_req)

    def filter_batch(self, reqs_to_exclude=None, keep_indices=None, **_):
        if keep_indices is None:
            excluded = set(map(id, reqs_to_exclude or []))
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and id(r) not in excluded]
        self.reqs = [self.reqs[i] for i in keep_indices]

    def merge_batch(self, other):
        self.reqs += other.reqs


class TreeCacheStub:
    """No KV pools exist on this machine: nothing to release. ``supports_mamba`` lets upstream's
    ``release_kv_cache`` accept a request that never held a KV row."""

    def finish(self, *a, **k):
        pass

    def unlock(self, lock):
        pass

    def supports_mamba(self):
        return True

    def check_hicache_events(self):
        pass


class Null:
    """Metrics/load/invariant observers: they watch pools that do not exist here."""

    enable_metrics = False

    def __getattr__(self, name):
        return lambda *a, **k: None


# ----------------------------------------------------------------------------------------------
# The forward stand-in's collectives, and how a stalled rank is found and ended.
@dataclass(frozen=True)
class ForwardShape:
    """What one forward step issues on the forward group, for ``tokens`` tokens and ``rows`` sampled rows.

    Assumed for a DeepSeek-V4-Flash forward with plain tensor parallelism (attention TP = MoE TP =
    the TP size, no expert parallelism, no DP attention), from the pin's model: per layer one
    all-reduce of ``[tokens, hidden]`` after attention's output projection (``wo_b``, row-parallel)
    and one after the MoE; with a vocabulary (``vocab`` > 0), one all-reduce of ``[tokens, hidden]``
    after the vocab-parallel embedding and one all-gather of the sampled rows' logits shards
    ``[rows, vocab / world]`` (the parallel LM head). The pin fuses some of these with the mHC mixing,
    which changes when they run, not what is reduced. The default is the harness's small stand-in.
    """

    layers: int = 1
    hidden: int = HIDDEN
    vocab: int = 0
    dtype: str = "float32"

    def collectives(self) -> int:
        return 2 * self.layers + (2 if self.vocab else 0)


def dsv4_flash_shape(layers: int | None = None) -> ForwardShape:
    """The pin's ``DeepSeekV4Config`` defaults (hidden 4096, 43 layers, vocabulary 129280), in bf16."""
    import dataclasses

    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config

    pin = {f.name: f.default for f in dataclasses.fields(DeepSeekV4Config)}
    return ForwardShape(layers=pin["num_hidden_layers"] if layers is None else layers, hidden=pin["hidden_size"],
                        vocab=pin["vocab_size"], dtype="bfloat16")


@dataclass(frozen=True)
class ForwardSpec:
    """The forward group: its backend ("gloo": CPU; "nccl": one GPU per rank, GPU index = TP rank),
    what a step issues on it, and its collectives' timeout (None: the scheduler group's)."""

    backend: str = "gloo"
    shape: ForwardShape = ForwardShape()
    timeout_s: float | None = None


@dataclass(frozen=True)
class Watch:
    """The per-rank watchdog: after ``stall_s`` without a new loop iteration it writes where the rank
    is into ``dump_dir``; after ``kill_s`` it ends the rank with ``WATCHDOG_EXIT``."""

    dump_dir: str
    stall_s: float = 3.0
    kill_s: float = 20.0


WATCHDOG_EXIT = 86
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_env(forward: ForwardSpec, dump_dir: str | None = None) -> dict:
    """Every rank's environment: NVLink multicast off (it can take a shared host's GPUs out of
    service), and for NCCL the timeout handling and flight recorder, read when the group is made."""
    env = dict(MULTICAST_OFF)
    if forward.backend == "nccl":
        env.update(TORCH_NCCL_ASYNC_ERROR_HANDLING="1",  # a timed-out collective takes the rank down
                   TORCH_NCCL_TRACE_BUFFER_SIZE="2000",  # the flight recorder: the group's last collectives
                   TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_NCCL_DESYNC_DEBUG="1", NCCL_DEBUG="WARN")
        if dump_dir:
            env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = env["TORCH_FR_DUMP_TEMP_FILE"] = f"{dump_dir}/nccl_fr_rank"
    return env


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/tests/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


class CollectiveTrace:
    """Which collective this rank is in, by group, and what its forward stand-in issued.

    ``install`` wraps ``torch.distributed``'s collectives in this rank process (upstream and the
    guard call them through the module), so a stall can be pinned to one call on one group; the
    forward stand-in records its asynchronous collectives with their work handles, so an NCCL
    collective that was issued but never completed is named too.
    """

    # collective -> position of its ``group`` argument
    WRAPPED = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2, "gather": 3,
               "reduce_scatter_tensor": 3, "barrier": 0, "all_gather_object": 2, "broadcast_object_list": 2}

    def __init__(self, labels: dict):
        from collections import deque

        self.labels = labels  # group -> its name in the records
        self.inflight: dict[int, dict] = {}  # thread -> the blocking collective it is in
        self.forward = deque(maxlen=512)  # (record, work) of the forward stand-in's collectives

    def label(self, group) -> str:
        import torch.distributed as dist

        return self.labels.get(dist.group.WORLD if group is None else group, "another group")

    def install(self) -> None:
        import threading

        import torch.distributed as dist

        for name, pos in self.WRAPPED.items():
            inner = getattr(dist, name)

            def traced(*args, _inner=inner, _name=name, _pos=pos, **kwargs):
                group = kwargs.get("group", args[_pos] if len(args) > _pos else None)
                me = threading.get_ident()
                outer = self.inflight.get(me)
                self.inflight[me] = self._record(_name, group, args[0] if args else None)
                try:
                    return _inner(*args, **kwargs)
                finally:
                    if outer is None:
                        self.inflight.pop(me, None)
                    else:
                        self.inflight[me] = outer

            setattr(dist, name, traced)

    def _record(self, op: str, group, tensor) -> dict:
        shape = list(tensor.shape) if hasattr(tensor, "shape") else None
        return {"group": self.label(group), "op": op, "shape": shape,
                "dtype": str(getattr(tensor, "dtype", "")).replace("torch.", ""), "since": time.monotonic()}

    def issued(self, op: str, group, tensor, work, step: str) -> None:
        self.forward.append((self._record(op, group, tensor) | {"step": step}, work))

    def pending_forward(self) -> list[dict]:
        out = []
        for record, work in list(self.forward):
            try:
                done = work.is_completed()
            except Exception:  # noqa: BLE001 - an aborted communicator: not completed either
                done = False
            if not done:
                out.append(record)
        return out


def _nccl_flight_recorder(raw: bytes | None = None) -> list[dict] | str:
    """torch's NCCL flight recorder (this rank's, or a dump file's bytes), reduced to what locates a hang."""
    import pickle

    try:
        if raw is None:
            from torch._C._distributed_c10d import _dump_nccl_trace

            try:
                raw = _dump_nccl_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            except TypeError:
                raw = _dump_nccl_trace()
        entries = pickle.loads(raw).get("entries", [])
    except Exception as exc:  # noqa: BLE001 - the record says why there is no recorder
        return f"flight recorder unavailable: {type(exc).__name__}: {exc}"
    keep = ("record_id", "pg_id", "process_group", "collective_seq_id", "profiling_name", "input_sizes",
            "input_dtypes", "output_sizes", "state", "timeout_ms")
    rows = [{k: e.get(k) for k in keep if k in e} for e in entries]
    return [r for r in rows if r.get("state") != "completed"] + [r for r in rows if r.get("state") == "completed"][-4:]


class StallWatchdog:
    """A daemon thread per rank: notices a loop that stopped iterating, records where, then ends the rank.

    The loop beats once per iteration (the request broadcast). A rank that has not beaten for
    ``stall_s`` gets one record per stall (``rank<R>_stall<N>.json``: the collective it is in, by
    group, the forward collectives it issued and that never completed, its main thread's stack,
    NCCL's flight recorder) and every thread's stack from faulthandler (``rank<R>_stacks.txt``).
    Past ``kill_s`` it records again and exits with ``WATCHDOG_EXIT``: a hang ends here, detected.
    """

    POLL_S = 0.2

    def __init__(self, rank: int, watch: Watch, dump_dir: str, trace: CollectiveTrace, nccl: bool):
        import threading

        self.rank, self.watch, self.dump_dir, self.trace, self.nccl = rank, watch, dump_dir, trace, nccl
        self.armed, self.label, self.iteration, self.last, self.dumped, self.count = False, "", -1, 0.0, False, 0
        threading.Thread(target=self._run, name="stall-watchdog", daemon=True).start()

    def arm(self, label: str) -> None:
        self.label, self.iteration, self.last, self.dumped, self.armed = label, -1, time.monotonic(), False, True

    def beat(self, iteration: int) -> None:
        self.iteration, self.last, self.dumped = iteration, time.monotonic(), False

    def disarm(self) -> None:
        self.armed = False

    def _run(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            if not self.armed:
                continue
            idle = time.monotonic() - self.last
            if idle > self.watch.kill_s:
                self.dump(idle, killed=True)
                os._exit(WATCHDOG_EXIT)
            if idle > self.watch.stall_s and not self.dumped:
                self.dumped = True
                self.dump(idle, killed=False)

    def dump(self, idle: float, killed: bool) -> None:
        import faulthandler
        import json
        import sys
        import threading

        main = threading.main_thread().ident
        frame = sys._current_frames().get(main)
        # the caller's frames: torch's and the trace's own wrappers are in the faulthandler dump
        frames = [f for f in traceback.extract_stack(frame) if "/torch/" not in f.filename and f.name != "traced"] \
            if frame else []
        stack = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in frames]
        blocking = self.trace.inflight.get(main)
        pending = self.trace.pending_forward()
        if blocking:
            where = f"{blocking['group']}: {blocking['op']} {blocking['shape']} {blocking['dtype']}"
        elif pending:
            first = pending[0]
            where = (f"{first['group']}: {len(pending)} collective(s) issued and not completed, the first "
                     f"{first['op']} {first['shape']} {first['dtype']} ({first['step']}); the loop waits in "
                     f"{stack[-1] if stack else '?'}")
        else:
            where = f"no collective: {stack[-1] if stack else '?'}"
        now = time.monotonic()
        record = {"rank": self.rank, "scenario": self.label, "iteration": self.iteration, "idle_s": round(idle, 2),
                  "killed": killed, "where": where, "main_stack": stack[-14:],
                  "inflight": [r | {"for_s": round(now - r["since"], 2)} for r in self.trace.inflight.values()],
                  "forward_pending": [r | {"for_s": round(now - r["since"], 2)} for r in pending[:8]],
                  "nccl_flight_recorder": _nccl_flight_recorder() if self.nccl else None}
        self.count += 1
        with open(f"{self.dump_dir}/rank{self.rank}_stall{self.count}.json", "w") as f:
            json.dump(record, f, indent=1, default=str)
        with open(f"{self.dump_dir}/rank{self.rank}_stacks.txt", "a") as f:
            f.write(f"--- rank {self.rank}, {self.label}, idle {idle:.1f} s{' (ending the rank)' if killed else ''}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)


@dataclass
class RankResult:
    rank: int
    status: str  # ok | stuck (not concluded by max_iters) | hang | error
    detail: str = ""
    leftovers: dict = field(default_factory=dict)
    outcomes: dict = field(default_factory=dict)  # rank 0 only: rid -> (kind, message)
    iters: int = 0
    counters: dict = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the loop call
    guard_seconds: float = 0.0  # bench only: time spent inside the guard's calls (all its agreements)
    batch_check_seconds: float = 0.0  # bench only: ... of which inside the second agreement (batch check)
    injected: int = 0  # how many of the scenario's injections fired on this rank
    forward_seconds: float = 0.0  # the forward stand-in's collectives (NCCL: their GPU time, CUDA events)
    forward_ops: int = 0  # collectives the forward stand-in issued


# ----------------------------------------------------------------------------------------------
class Harness:
    """One TP rank: owns the gloo group and the forward group, builds a fresh model-less Scheduler per scenario."""

    def __init__(self, rank: int, world: int, port: int, timeout_s: float, ipc_dir: str,
                 forward: ForwardSpec = ForwardSpec(), watch: Watch | None = None, dump_dir: str | None = None):
        import torch
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self.tp = dist.group.WORLD
        singles = [dist.new_group([r]) for r in range(world)]
        self.cp = singles[rank]  # attention CP = 1: a one-rank group, as upstream builds it
        self.forward = forward
        self.device = torch.device("cpu")
        if forward.backend == "nccl":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        self.fwd = dist.new_group(list(range(world)), backend=forward.backend,
                                  timeout=timedelta(seconds=forward.timeout_s or timeout_s))
        self.trace = CollectiveTrace({self.tp: "scheduler gloo (TP CPU group)", self.fwd: f"forward {forward.backend}"})
        self.watchdog = None
        if watch is not None:
            self.trace.install()
            self.watchdog = StallWatchdog(rank, watch, dump_dir, self.trace, forward.backend == "nccl")
        warm = torch.zeros(1, device=self.device)  # the communicator is made here, not in the first forward
        dist.all_reduce(warm, group=self.fwd)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        get_parallel().override_permanently(
            pp_rank=0, pp_size=1, tp_rank=rank, tp_size=world, attn_tp_rank=rank, attn_tp_size=world,
            attn_cp_rank=0, attn_cp_size=1, attn_dp_rank=0, attn_dp_size=1, moe_tp_size=world, moe_ep_size=1, moe_dp_size=1,
            tp_group=SimpleNamespace(rank=rank, ranks=list(range(world)), cpu_group=self.tp, world_size=world),
        )
        self.ipc = f"ipc://{ipc_dir}/tok"
        self.pull = None
        if rank == 0:
            import zmq

            ctx = zmq.Context.instance()
            self.pull = ctx.socket(zmq.PULL)
            self.pull.bind(self.ipc)
            self.push = ctx.socket(zmq.PUSH)
            self.push.connect(self.ipc)

    # ---- scheduler ------------------------------------------------------------------------
    def build(self, sc: Scenario):
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.disaggregation.utils import DisaggregationMode, ReqToMetadataIdxAllocator
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper

        s = object.__new__(Scheduler)
        self.iteration = -1
        clock = lambda: self.iteration  # noqa: E731
        self.clock, self.sc, self.s = clock, sc, s
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.busy: dict = {}
        self.fired: set[int] = set()  # indices of this scenario's injections that fired on this rank
        self.forward_seconds, self.forward_ops, self.forward_digest, self.forward_events = 0.0, 0, 0, []
        self.plans = {p.rid: p for p in sc.reqs}
        s.tp_rank, s.tp_size, s.pp_size = self.rank, self.world, 1
        s.tp_cpu_group = s.attn_tp_cpu_group = self.tp
        s.attn_cp_cpu_group = self.cp
        s.gracefully_exit = False
        s._engine_paused = False
        s._deferred_input_requests = []
        s.waiting_queue = []
        s.running_batch = FakeBatch([], "extend" if sc.loop == "prefill" else "decode")
        s.last_batch = None
        s.chunked_req = None
        s._pending_chunked_abort_req = None
        s.cur_batch_for_debug = None
        s.enable_overlap = True
        s.enable_staging = False
        s.enable_hierarchical_cache = s.enable_hicache_storage = False
        s.enable_unified_cache_external_linker = s.enable_lmcache = False
        s.enable_decode_hicache = s.enable_hisparse = False
        s.enable_unified_memory = False
        s._war_barrier_enabled = False
        s.scheduler_stage_metrics = None
        s.rust_server = None
        s.return_health_check_ipcs = []
        s.tree_cache = TreeCacheStub()
        s.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(64)
        s.token_to_kv_pool_allocator = SimpleNamespace(page_size=1)
        s.metrics_reporter = s.metrics_collector = s.invariant_checker = Null()
        s.dp_attn_adapter = SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda b: b, drop_sync_wait_carry=lambda: None)
        s.ngram_embedding_manager = SimpleNamespace(prepare_for_forward=lambda b, chunked_req=None: b)
        s.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
        s.disagg_prefill_pending_chunk_rids = set()
        s.processed_tokens_counter = 0
        s.ipc_channels = SimpleNamespace(send_to_tokenizer=SenderWrapper(self.push if self.rank == 0 else None))
        s.output_streamer = SimpleNamespace(stream_output=self._stream_output)
        s.request_receiver = SimpleNamespace(recv_requests=self._recv_requests)
        s.process_input_requests = self._process_input_requests
        s.run_batch = self._run_batch
        s.process_batch_result = self._process_batch_result
        s.is_fully_idle = lambda *a, **k: False  # upstream's reads pool and PP state that is not built here
        s._pp_microbatches_drained = lambda: True
        s._last_stall_publish_ts = float("inf")  # the load publisher reads pool state that is not built here
        s.load_publisher = s.kv_events_publisher = s.new_token_ratio_tracker = Null()
        if sc.loop == "prefill":
            s.disaggregation_mode = DisaggregationMode.PREFILL
            q = object.__new__(PrefillBootstrapQueue)
            q.queue, q.pp_size, q.scheduler, q.scheduler_stage_metrics = [], 1, s, None
            q.req_to_metadata_buffer_idx_allocator = s.req_to_metadata_buffer_idx_allocator
            s.disagg_prefill_bootstrap_queue = q
            s.disagg_prefill_inflight_queue = []
            s.get_new_batch_prefill = self._build_prefill_batch
            # Injection points inside upstream's iteration: each runs the injection, then upstream's
            # method as the class holds it (with the guard's hook, when registered).
            self._inject_before(s, "process_pending_chunked_abort", "chunked_abort")
            self._inject_before(s, "resolve_waiting_queue_bootstrap", "resolve_waiting")
            self._inject_before(s, "process_disagg_prefill_inflight_queue", "inflight")
        else:
            s.disaggregation_mode = DisaggregationMode.DECODE
            s.polling_count, s.polling_interval = 0, 1
            s.enable_decode_hicache = s.enable_hisparse = False
            s.kv_checksum_computer = None
            prealloc, transfer = _decode_queue_classes()
            s.disagg_decode_prealloc_queue = prealloc.build(s, self)
            s.disagg_decode_transfer_queue = transfer.build(s, self)
            self._inject_before(s.disagg_decode_prealloc_queue, "pop_preallocated", "prealloc")
            self._inject_before(s.disagg_decode_transfer_queue, "pop_transferred", "transfer")
            s.get_new_prebuilt_batch = self._prebuilt_decode_batch
            s.update_running_batch = self._update_running_batch
            s.batch_result_processor = Null()
            s.is_disable_overlap_for_batch = lambda batch, last_batch=None: False
            s.launch_batch_sample_if_needed = lambda *a, **k: None
            s.future_map = None
        return s

    def _inject_before(self, owner, method: str, point: str) -> None:
        upstream = getattr(type(owner), method)

        def injected(*args, **kwargs):
            self._inject(point)
            return upstream(owner, *args, **kwargs)

        setattr(owner, method, injected)

    # ---- replaced input path ---------------------------------------------------------------
    def _recv_requests(self, local_reqs=None):
        """Rank 0 'receives' this iteration's arrivals; the REAL broadcast shares them."""
        from sglang.srt.utils import broadcast_pyobj

        self.iteration += 1
        if self.watchdog is not None:
            self.watchdog.beat(self.iteration)
        payload = None
        if self.rank == 0:
            payload = [("req", p.rid) for p in self.sc.reqs if p.arrive == self.iteration]
            if self._done_on_rank0() or self.iteration >= self.sc.max_iters:
                payload.append(("shutdown", None))
        return broadcast_pyobj(payload, self.rank, self.tp, src=0)

    def _done_on_rank0(self) -> bool:
        """Rank 0 ends the scenario once every request has reached its client and its queues are empty."""
        s = self.s
        self._drain()
        busy = s.waiting_queue or s.running_batch.reqs or s.last_batch or getattr(s, "result_queue", None)
        busy = busy or any(q for _, q in self._queues())
        last_injection = max((i.at for i in self.sc.injections), default=-1)
        self.busy = {"queues": {n: len(q) for n, q in self._queues() if q}, "last_batch": bool(s.last_batch),
                     "result_queue": len(getattr(s, "result_queue", ()) or ()),
                     "no_outcome": [p.rid for p in self.sc.reqs if p.rid not in self.outcomes]}
        return not busy and self.iteration > last_injection and all(p.rid in self.outcomes for p in self.sc.reqs)

    def _process_input_requests(self, recv):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        for kind, rid in recv:
            if kind == "shutdown":
                self.s.gracefully_exit = True
                continue
            plan = self.plans[rid]
            req = Req(rid, "", [1, 2, 3, 4], SamplingParams(max_new_tokens=plan.tokens))
            poller = ScriptedPoller(plan, self.rank, self.clock)
            if self.sc.loop == "prefill":
                req.disagg_kv_sender = poller
                req.pending_bootstrap = True
                req.sampling_params.max_new_tokens = 1
                self.s.disagg_prefill_bootstrap_queue.queue.append(req)
            else:
                from sglang.srt.disaggregation.decode import DecodeRequest

                self.s.disagg_decode_prealloc_queue.queue.append(DecodeRequest(req=req, kv_receiver=poller))
        self._inject("broadcast")

    # ---- injected rank-local divergences ------------------------------------------------------
    def _inject(self, point: str, candidates: list | None = None) -> dict:
        """Run this rank's due injections at ``point``; returns {"skip"|"chunk": the candidate picked}."""
        picked = {}
        for n, inj in enumerate(self.sc.injections):
            if inj.point != point or inj.rank != self.rank or n in self.fired or self.iteration < inj.at:
                continue
            if inj.kind == "batch":
                # Batch state no queue edit can repair: this rank alone believes a forward is pending.
                self.s.last_batch = None if self.s.last_batch is not None else FakeBatch([])
                acted = True
            elif inj.kind == "empty":
                acted = self._empty_one_queue()
            elif inj.kind in ("skip", "chunk"):  # batch formation decides otherwise on this rank
                pool = [x for x in candidates or [] if not x.finished()]
                if pool:
                    picked[inj.kind] = pool[inj.pick % len(pool)]
                acted = bool(pool)
            else:
                acted = self._local(inj, point, candidates)
            if acted:
                self.fired.add(n)
        return picked

    def _queues(self):
        s = self.s
        if self.sc.loop == "prefill":
            return [("bootstrap", s.disagg_prefill_bootstrap_queue.queue), ("waiting", s.waiting_queue),
                    ("inflight", s.disagg_prefill_inflight_queue)]
        return [("prealloc", s.disagg_decode_prealloc_queue.queue), ("transfer", s.disagg_decode_transfer_queue.queue),
                ("waiting", s.waiting_queue), ("running", s.running_batch.reqs)]

    def _empty_one_queue(self) -> bool:
        for name, q in self._queues():
            if q and name != "running":
                for item in list(q):
                    self._drop(q, item)
                return True
        return False

    # the queue each point acts on
    _POINT_QUEUE = {"chunked_abort": "waiting", "resolve_waiting": "waiting", "batch_formation": "waiting",
                    "inflight": "inflight", "prealloc": "prealloc", "transfer": "transfer"}

    def _local(self, inj: Injection, point: str, candidates: list | None) -> bool:
        """A rank-local abort or completion of one request; False when there is nothing to act on."""
        if point == "batch_result":  # this rank alone finds the request failed while processing the result
            live = [r for r in candidates if not r.finished()]
            if live:
                self._drop(None, live[inj.pick % len(live)])
            return bool(live)
        queues = self._queues()
        names = [n for n, _ in queues]
        if point == "broadcast":
            found = [(i, x) for i, (name, q) in enumerate(queues) if name != "running"
                     for x in q if inj.rid in (None, getattr(x, "req", x).rid)]
            found = found[inj.pick % len(found):][:1] if found else []
        else:
            name = "running" if (point == "batch_formation" and self.sc.loop == "decode") else self._POINT_QUEUE[point]
            i = names.index(name)
            live = [x for x in queues[i][1] if not getattr(x, "req", x).finished()]
            found = [(i, live[inj.pick % len(live)])] if live else []
        if not found:
            return False
        i, item = found[0]
        name, q = queues[i]
        if inj.kind == "abort":
            self._drop(q, item)
            return True
        # "complete": this rank alone saw the bootstrap/transfer finish and moved the request on.
        q.remove(item)
        if name == "inflight":
            from sglang.srt.managers.schedule_batch import FINISH_LENGTH

            item.finished_reason = FINISH_LENGTH(length=0)
            self._stream_output([item])  # reaches the client only from rank 0, as upstream
            return True
        if name == "prealloc":
            self.s.disagg_decode_prealloc_queue.admit(item)
        nxt = queues[i + 1][1]
        nxt.append(item.req if name == "transfer" else item)
        return True

    def _drop(self, q, item):
        """A rank-local abort: upstream's abort paths abort the transfer and stream the abort, which
        reaches the client only when this rank owns the tokenizer socket (rank 0)."""
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort

        if q is not None:
            q.remove(item)
        poller = getattr(item, "kv_receiver", None) or getattr(item, "disagg_kv_sender", None)
        if poller is not None:
            poller.abort()
        req = getattr(item, "req", item)
        prepare_abort(req, f"aborted on rank {self.rank} only (injected)", status_code=HTTPStatus.BAD_REQUEST)
        self._stream_output([req])

    # ---- replaced batch building / forward / result processing ---------------------------------
    def _build_prefill_batch(self, running_batch):
        """For ``get_new_batch_prefill``: batch every request whose bootstrap is resolved."""
        s = self.s
        ready = [r for r in s.waiting_queue if not r.pending_bootstrap]
        picked = self._inject("batch_formation", ready)
        ready = [r for r in ready if r is not picked.get("skip") and r in s.waiting_queue]  # an "abort" left
        s.waiting_queue = [r for r in s.waiting_queue if r not in ready]
        if not ready:
            return SimpleNamespace(batch_to_run=None, running_batch=running_batch)
        batch = FakeBatch(ready, chunked=picked.get("chunk"))
        s.chunked_req = batch.chunked_req or s.chunked_req  # as upstream: the formation names the chunked request
        return SimpleNamespace(batch_to_run=batch, running_batch=running_batch)

    def _prebuilt_decode_batch(self, running_batch):
        """For ``get_new_prebuilt_batch``: every request whose KV arrived joins as a decode request."""
        s = self.s
        skipped = self._inject("batch_formation", s.waiting_queue).get("skip")
        joining = [r for r in s.waiting_queue if r is not skipped]
        s.waiting_queue = [r for r in s.waiting_queue if r is skipped]
        return FakeBatch(joining, "decode") if joining else None

    def _update_running_batch(self, running_batch):
        """For ``update_running_batch`` (no memory to check, nothing to retract): the injection point
        of a rank-local change to the running batch (a retraction or abort on this rank only)."""
        self._inject("batch_formation")
        return running_batch

    def _run_batch(self, batch):
        """A TP forward's collectives (``ForwardShape``) for this batch's tokens, on the forward group.

        gloo runs each on the CPU, so the rank waits in it; NCCL only enqueues them on the GPU (the
        forward's stream waits for each), and the rank waits where upstream's result processing does,
        on the result's ``copy_done`` event.
        """
        import torch
        import torch.distributed as dist

        shape, group, dev = self.forward.shape, self.fwd, self.device
        tokens = batch.extend_num_tokens if batch.mode == "extend" else len(batch.reqs)
        rows = len(batch.reqs)
        dtype = getattr(torch, shape.dtype)
        steps = [f"layer{i}.{part}" for i in range(shape.layers) for part in ("attn", "moe")]
        if shape.vocab:
            steps = ["embed", *steps]
        gpu = dev.type == "cuda"
        # which batch this forward is: equal-size collectives of different batches must not pair unseen
        self._fold_forward(int.from_bytes(hashlib.blake2b("\0".join(r.rid for r in batch.reqs).encode(),
                                                          digest_size=7).digest(), "little"))
        started = time.perf_counter()
        if gpu:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        hidden = torch.zeros(tokens, shape.hidden, dtype=dtype, device=dev)
        for step in steps:
            self._forward_collective(dist.all_reduce, "all_reduce", hidden, step, hidden, group=group, async_op=True)
        if shape.vocab:
            shard = torch.zeros(rows, shape.vocab // self.world, dtype=dtype, device=dev)
            logits = torch.empty(rows * self.world, shard.shape[1], dtype=dtype, device=dev)
            self._forward_collective(dist.all_gather_into_tensor, "all_gather_into_tensor", shard, "logits",
                                     logits, shard, group=group, async_op=True)
        if not gpu:
            self.forward_seconds += time.perf_counter() - started
            return SimpleNamespace(delay_sample_func=None, copy_done=None)
        end.record()
        self.forward_events.append((begin, end))
        return SimpleNamespace(delay_sample_func=None, copy_done=end)

    def _forward_collective(self, fn, op: str, tensor, step: str, *args, **kwargs) -> None:
        work = fn(*args, **kwargs)
        self.trace.issued(op, self.fwd, tensor, work, step)
        self.forward_ops += 1
        self._fold_forward(tensor.numel() * 4 + len(op))
        work.wait()  # gloo: the CPU waits (within the group's timeout); NCCL: the stream waits, as a forward's

    def _fold_forward(self, value: int) -> None:
        """The order-sensitive digest of this rank's forward collectives and the batches they belong to."""
        self.forward_digest = (self.forward_digest * 1_000_003 + value) % (1 << 61)

    def _process_batch_result(self, batch, result):
        s = self.s
        if result.copy_done is not None:
            result.copy_done.synchronize()  # as upstream's disagg result processing waits for the forward
        self._inject("batch_result", batch.reqs)
        if self.sc.loop == "prefill":
            for req in batch.reqs:
                if req.finished():
                    continue
                req.disagg_kv_sender.start_transfer()
                s.disagg_prefill_inflight_queue.append(req)
            return
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        for req in batch.reqs:
            if req.finished():
                continue
            req.output_ids.append(7)
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
                self._stream_output([req])
        s.running_batch.filter_batch()

    # ---- rank 0's tokenizer side ------------------------------------------------------------
    def _stream_output(self, reqs, *a, **k):
        if self.rank != 0:
            return  # upstream streams from the rank that owns the detokenizer socket only
        for req in reqs:
            reason = req.finished_reason
            kind = "abort" if type(reason).__name__ == "FINISH_ABORT" else "done"
            msg = getattr(reason, "message", "") or ""
            self.outcomes.setdefault(req.rid, (kind, msg))

    def _drain(self):
        if self.pull is None:
            return
        import zmq

        while True:
            try:
                obj = self.pull.recv_pyobj(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            reason = obj.finished_reason or {}
            self.outcomes.setdefault(obj.rid, ("abort", reason.get("message") or obj.abort_message or ""))

    def _time_guard_calls(self):
        """Bench only: time every guard agreement of an iteration, and the batch check apart."""
        from dsv4_sm120.guard import batch_check, loop_guard, queue_check

        def timed(module, name, also=None):
            inner = getattr(getattr(module, name), "__wrapped__", getattr(module, name))

            def call(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    spent = time.perf_counter() - t
                    self.guard_seconds += spent
                    if also:
                        setattr(self, also, getattr(self, also) + spent)

            call.__wrapped__ = inner
            setattr(module, name, call)

        timed(loop_guard, "check_iteration")
        timed(queue_check, "agree_on_queue")
        timed(batch_check, "_checked", also="batch_check_seconds")

    # ---- run ---------------------------------------------------------------------------------
    def run(self, sc: Scenario, loops: str) -> RankResult:
        use_loops(loops)
        s = self.build(sc)
        loop = getattr(s, f"event_loop_{sc.kind}_disagg_{sc.loop}")
        self.guard_seconds = self.batch_check_seconds = 0.0
        if sc.ends_at_max:  # the bench: also time the guard's calls themselves
            self._time_guard_calls()
        if self.watchdog is not None:
            self.watchdog.arm(f"seed {sc.seed} {sc.loop} {sc.kind} loops={loops}")
        try:
            return self._run_loop(loop)
        finally:
            if self.watchdog is not None:
                self.watchdog.disarm()

    def _run_loop(self, loop) -> RankResult:
        import torch.distributed as dist

        from dsv4_sm120.guard import loop_guard

        started = time.perf_counter()
        try:
            loop()
        except loop_guard.CollectiveGuardFailFast as exc:
            return self._ended("failfast", str(exc))
        except RuntimeError as exc:
            text = str(exc)
            status = "hang" if "imed out" in text or "timeout" in text.lower() else "error"
            return self._ended(status, f"{type(exc).__name__}: {text[:300]}")
        except Exception:  # noqa: BLE001
            return self._ended("error", traceback.format_exc()[-1500:])
        seconds = time.perf_counter() - started
        self._drain()
        leftovers = {name: [getattr(x, "req", x).rid for x in q] for name, q in self._queues() if q}
        # The ranks' forward collectives must have paired one to one: NCCL pairs equal-size unlike
        # collectives without a word, so a run can end "ok" with its forwards shifted against each other.
        streams = [None] * self.world
        dist.all_gather_object(streams, (self.forward_ops, self.forward_digest), group=self.tp)
        c = loop_guard.counters
        status = "ok" if self.iteration < self.sc.max_iters or self.sc.ends_at_max else "stuck"
        detail = "" if status == "ok" else f"still busy at max_iters: {self.busy}"
        if len(set(streams)) > 1:
            status = "desync"  # some collectives have no partner left: no waiting for them below
            detail = f"forward collectives per rank differ (count, digest): {streams}"
        elif self.forward_events:  # NCCL: every forward must have completed, within the group's timeout
            import torch

            torch.cuda.synchronize()
            self.forward_seconds += sum(b.elapsed_time(e) for b, e in self.forward_events) / 1e3
        return RankResult(self.rank, status, detail,
                          leftovers=leftovers, outcomes=dict(self.outcomes), iters=self.iteration,
                          counters={"seen": c.divergences_seen, "reconciled": c.divergences_reconciled,
                                    "aborted": c.requests_aborted, "fail_fasts": c.fail_fasts},
                          seconds=seconds, guard_seconds=self.guard_seconds,
                          batch_check_seconds=self.batch_check_seconds,
                          injected=len(self.fired), forward_seconds=self.forward_seconds,
                          forward_ops=self.forward_ops)

    def _ended(self, status: str, detail: str) -> RankResult:
        """A loop that raised: what this rank got through before."""
        return RankResult(self.rank, status, detail, iters=self.iteration, forward_ops=self.forward_ops,
                          injected=len(self.fired))


# ---- decode queues: upstream's classes, without the KV pools -----------------------------------
_DECODE_QUEUES: dict = {}


def _decode_queue_classes():
    """Upstream's decode queue classes with only their pool-bound parts replaced (built on first use:
    this module imports sglang only inside the forked ranks' setup)."""
    if _DECODE_QUEUES:
        return _DECODE_QUEUES["prealloc"], _DECODE_QUEUES["transfer"]
    import torch
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    class MetadataSlots:
        """The metadata buffers as the transfer queue reads them: every slot's room reads "landed"
        (the scripted poller decides when a transfer is done), and ``clear_slot`` as upstream calls it."""

        def __init__(self, size: int):
            self.bootstrap_room = torch.ones((size, 1), dtype=torch.int64)
            self.cleared: list[int] = []

        def clear_slot(self, idx: int) -> None:
            self.cleared.append(idx)

    class Prealloc(DecodePreallocQueue):
        """Upstream's preallocation queue; its handshake poll is upstream's, only the preallocation of
        KV (pools need a model) is replaced: every request whose handshake is done is admitted."""

        @classmethod
        def build(cls, s, h):
            q = object.__new__(cls)
            q.scheduler, q.queue, q.retracted_queue, q.pending_reqs = s, [], [], []
            q.pp_size, q.tp_rank, q.gloo_group = 1, h.rank, s.attn_tp_cpu_group
            q.req_to_metadata_buffer_idx_allocator = s.req_to_metadata_buffer_idx_allocator
            q._num_published_destinations = 0
            return q

        def prefetch_prefill_dp_rank_queries(self):
            pass  # queries the prefill's bootstrap server for its DP rank: there is none

        def resume_retracted_reqs(self):
            return []  # nothing is retracted without memory pressure

        def admit(self, decode_req) -> None:
            """What a successful preallocation leaves: a metadata slot, and the receiver told to start."""
            decode_req.metadata_buffer_index = self.req_to_metadata_buffer_idx_allocator.alloc()
            decode_req.kv_receiver.start_transfer()

        def pop_preallocated(self, rids_to_check=None, pp_good_rids=None, pp_bad_rids=None):
            self._update_handshake_waiters()
            failed, moved, keep = [], [], []
            for d in self.queue:
                if isinstance(d.req.finished_reason, FINISH_ABORT):  # as upstream: stream it, drop it
                    self.scheduler.output_streamer.stream_output([d.req], d.req.return_logprob)
                    d.kv_receiver.clear()
                    failed.append(d)
                elif d.waiting_for_input:
                    self.admit(d)
                    moved.append(d)
                else:
                    keep.append(d)
            self.queue = keep
            return moved, failed

    class Transfer(DecodeTransferQueue):
        """Upstream's transfer queue; only ``_commit_transfer_to_req`` (the model's first token, read
        from the metadata buffers) is replaced."""

        @classmethod
        def build(cls, s, h):
            q = object.__new__(cls)
            q.scheduler, q.queue, q.tree_cache, q.tp_rank, q.gloo_group = s, [], s.tree_cache, h.rank, s.attn_tp_cpu_group
            q.req_to_metadata_buffer_idx_allocator = s.req_to_metadata_buffer_idx_allocator
            q.metadata_buffers = MetadataSlots(s.req_to_metadata_buffer_idx_allocator.size)
            q.enable_host_receive = q.enable_staging = q.enable_deferred_kv_release = False
            q.staging_handler, q.spec_algorithm, q.deferred_kv_release_timeout = None, None, 30.0
            q._skipped_checksum_signatures, q._deferred_releases = set(), []
            return q

        def _commit_transfer_to_req(self, decode_req):
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None

    _DECODE_QUEUES.update(prealloc=Prealloc, transfer=Transfer)
    return Prealloc, Transfer




# ----------------------------------------------------------------------------------------------
# Loop selection: upstream's unpatched methods, or the same methods from the patched copy.
_LOOPS: dict[str, dict] = {}
_TREES: dict[str, str] = {}  # "dir": where setup_parent wrote the pristine and patched copies


def prepare_loops(tmp: str) -> None:
    """In the parent, before forking: load the pin's loop methods, pristine and patched.

    Both come from copies under ``tmp`` (``pristine``: the pin's bytes, reverted there if the venv's
    sglang was patched; ``patched``: ``dsv4-sm120 patch apply --sglang-root`` on a copy), never from
    the installed modules, so the suite means the same whether or not the venv was patched. Each copy
    is executed under its real module name (without replacing the installed modules in
    ``sys.modules``); its loop methods are kept for ``use_loops``.
    """
    from pathlib import Path

    from harness import pristine

    pristine.pristine_tree(Path(tmp) / "pristine")
    pristine.patched_tree(Path(tmp) / "patched")
    load_loops(tmp)


def load_loops(tmp: str) -> None:
    """Load the loop methods from the copies ``prepare_loops`` wrote under ``tmp``."""
    import importlib.util
    from pathlib import Path

    import sglang.srt.disaggregation.decode as dec
    import sglang.srt.disaggregation.prefill as pre
    from sglang.srt.managers.scheduler import Scheduler  # noqa: F401 - imports the mixins first

    from harness import pristine

    trees = {"upstream": Path(tmp) / "pristine", "patched": Path(tmp) / "patched"}
    for which, root in trees.items():
        loaded = {}
        for mod in (pre, dec):
            spec = importlib.util.spec_from_file_location(mod.__name__, root / pristine.DISAGG / Path(mod.__file__).name)
            m = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(m)
            loaded[mod] = m
        prefill_mixin = loaded[pre].SchedulerDisaggregationPrefillMixin
        decode_mixin = loaded[dec].SchedulerDisaggregationDecodeMixin
        _LOOPS[which] = {
            ("prefill", "overlap"): prefill_mixin.event_loop_overlap_disagg_prefill,
            ("decode", "overlap"): decode_mixin.event_loop_overlap_disagg_decode,
            ("prefill", "normal"): prefill_mixin.event_loop_normal_disagg_prefill,
            ("decode", "normal"): decode_mixin.event_loop_normal_disagg_decode,
        }


def use_loops(which: str) -> None:
    """Point upstream's mixins at the chosen loop functions (in this forked worker only)."""
    import sglang.srt.disaggregation.decode as dec
    import sglang.srt.disaggregation.prefill as pre

    mixins = {"prefill": pre.SchedulerDisaggregationPrefillMixin, "decode": dec.SchedulerDisaggregationDecodeMixin}
    for (loop, kind), fn in _LOOPS[which].items():
        setattr(mixins[loop], fn.__name__, fn)


def setup_parent(tmp: str) -> None:
    """Once per test process, before starting ranks: import sglang, publish a CPU ServerArgs, load the loops."""
    _publish_server_args()
    prepare_loops(tmp)
    _TREES["dir"] = tmp
    _apply_guard_hooks()


def _setup_spawned_rank(tmp: str) -> None:
    """What a spawned rank (a fresh interpreter) would have inherited from ``setup_parent`` by forking."""
    import torch

    torch.set_num_threads(1)
    _publish_server_args()
    load_loops(tmp)
    _apply_guard_hooks()


def _publish_server_args() -> None:
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(ServerArgs(model_path="dummy", device="cpu", disaggregation_mode="prefill"),
                            role="scheduler")


def _apply_guard_hooks() -> None:
    """The guard area's hooks, registered and applied with upstream's HookRegistry as the plugin does
    with the guard on, and, as a scheduler with TP peers does at ``init_disaggregation``'s end (these
    ranks are such schedulers, built without it), the peers' hooks. They act only on schedulers the
    patched loop guards, so the guard-off and upstream-loop scenarios run upstream's code."""
    import dataclasses

    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_sm120 import settings
    from dsv4_sm120.guard import hooks, poll_reduce

    if poll_reduce.TARGET not in HookRegistry._patched:
        hooks.register(dataclasses.replace(settings.load(), collective_guard=True))
        HookRegistry.apply_hooks()
        hooks.apply_peer_hooks()


_RANK_FILES: list = []  # this rank's open stack file, kept alive for faulthandler's signal handler


def _record_rank_output(rank: int, dump_dir: str) -> None:
    """With a watchdog: this rank's stderr (NCCL's and torch's watchdog messages) into ``rank<R>.log``,
    and every thread's stack into ``rank<R>_stacks.txt`` on a fatal signal and on SIGUSR1 (the
    parent's last look at a rank it is about to kill); faulthandler writes without the interpreter lock."""
    import faulthandler
    import signal

    fd = os.open(f"{dump_dir}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    stacks = open(f"{dump_dir}/rank{rank}_stacks.txt", "a")  # noqa: SIM115 - lives as long as the rank
    _RANK_FILES.append(stacks)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)  # and on a fatal signal (an abort in gloo or NCCL)


def _worker(rank, world, port, timeout_s, ipc_dir, jobs, conn, env, forward=ForwardSpec(), watch=None,
            dump_dir=None, trees=None):
    os.environ.update(env)
    try:
        if dump_dir:
            _record_rank_output(rank, dump_dir)
        if not _LOOPS:  # a spawned rank: nothing was inherited
            _setup_spawned_rank(trees)
        h = Harness(rank, world, port, timeout_s, ipc_dir, forward, watch, dump_dir)
        for sc_args, loops, *job_env in jobs:
            os.environ.update(*job_env)  # optional per-job environment (the bench flips the guard switch)
            sc = sc_args if isinstance(sc_args, Scenario) else make_scenario(*sc_args)
            res = h.run(sc, loops)
            conn.send((sc.seed, res))
            if res.status == "failfast":
                conn.close()
                time.sleep(60)  # the guard's own timer must end this process, non-zero, well before this
            if res.status != "ok":
                break  # the group is unusable after a hang or an error
    except Exception:  # noqa: BLE001
        conn.send((None, RankResult(rank, "error", traceback.format_exc()[-1500:])))
    finally:
        conn.close()
        os._exit(0)


def run_group(world: int, jobs: list, timeout_s: float = 20.0, env: dict | None = None, wall_s: float = 600.0,
              forward: ForwardSpec = ForwardSpec(), watch: Watch | None = None, start: str = "fork"):
    """Start ``world`` ranks and run ``jobs``: forked from this process, which has already imported
    sglang (``start="fork"``), or spawned as fresh interpreters (``"spawn"``, what NCCL needs: CUDA
    does not survive a fork of a process that touched it, and importing sglang does).

    Returns ``{seed: [RankResult per rank]}`` plus ``"exits"``, and with a ``watch`` ``"stalls"``
    (``read_stalls``); a rank that neither answered nor exited by ``wall_s`` is killed and reported
    as a hang. A group whose rendezvous port was taken between ``free_port`` and rank 0's bind (the
    machine is shared: EADDRINUSE before any job ran) is started again on another port, up to twice.
    """
    for attempt in range(3):
        results = _run_group_once(world, jobs, timeout_s, env, wall_s, forward, watch, start)
        lost_port = results.get(None)
        if attempt == 2 or not lost_port or not any(
                r is not None and r.status == "error" and "EADDRINUSE" in (r.detail or "") for r in lost_port):
            return results
    return results


def _run_group_once(world: int, jobs: list, timeout_s: float, env: dict | None, wall_s: float,
                    forward: ForwardSpec, watch: Watch | None, start: str):
    import multiprocessing as mp
    import signal

    ctx = mp.get_context(start)
    port = free_port()
    ipc_dir = tempfile.mkdtemp(prefix="dsv4guard")
    dump_dir = tempfile.mkdtemp(prefix="group", dir=watch.dump_dir) if watch else None
    rank_environment = rank_env(forward, dump_dir) | (env or {})
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(rank, world, port, timeout_s, ipc_dir, jobs, child, rank_environment),
                        kwargs={"forward": forward, "watch": watch, "dump_dir": dump_dir, "trees": _TREES.get("dir")})
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: dict = {}
    exits: dict = {}
    deadline = time.monotonic() + wall_s
    open_conns = dict(enumerate(conns))
    while open_conns and time.monotonic() < deadline:
        for rank, c in list(open_conns.items()):
            if c.poll(0.05):
                try:
                    seed, res = c.recv()
                except EOFError:
                    del open_conns[rank]
                    continue
                results.setdefault(seed, [None] * world)[rank] = res
    answered = time.monotonic()
    seeds = [sc.seed if isinstance(sc, Scenario) else sc[0] for sc, *_ in jobs]
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        exits[rank] = (p.exitcode, time.monotonic() - answered)
        if p.is_alive():
            if watch:  # its stacks first, through faulthandler's signal handler
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)
            p.kill()
            p.join()
        if p.exitcode not in (0, None):
            death = _died(rank, p.exitcode)
            unanswered = [seed for seed in seeds if (results.get(seed) or [None] * world)[rank] is None]
            if unanswered:  # the job it died in, even when no rank answered it
                results.setdefault(unanswered[0], [None] * world)
            for per_rank in results.values():
                if per_rank[rank] is None:
                    per_rank[rank] = death
    results["exits"] = exits  # rank -> (exit code, seconds from the last answer to the exit)
    if dump_dir:
        results["stalls"] = read_stalls(dump_dir, world)
    return results


def _died(rank: int, code: int) -> RankResult:
    import signal

    if code == WATCHDOG_EXIT:
        return RankResult(rank, "killed_by_watchdog", f"the stall watchdog ended the rank (exit code {code})")
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return RankResult(rank, "error", f"process died with {how}")


LOG_LINES = ("watchdog", "timed out", "timeout", "desync", "nccl warn", "error", "abort", "terminate", "what()",
             "enforce", "fatal python error")


def read_stalls(dump_dir: str, world: int) -> dict:
    """Per rank, what the group's dump folder holds: the watchdog's stall records (in order), the rank's
    log lines about timeouts, watchdogs and errors (NCCL's and torch's), NCCL's own flight-recorder
    dump on timeout, and the start of its faulthandler stack dumps (the first stall). ``hung`` is the
    record that locates the hang: the last one (an earlier one can be a rank slowed past ``stall_s``
    by a loaded machine, mid-iteration)."""
    import glob
    import json
    import re

    out = {}
    for rank in range(world):
        def number(path):
            return int(re.search(r"stall(\d+)\.json$", path).group(1))

        stalls = [json.load(open(p)) for p in sorted(glob.glob(f"{dump_dir}/rank{rank}_stall*.json"), key=number)]
        log = []
        if os.path.exists(f"{dump_dir}/rank{rank}.log"):
            lines = open(f"{dump_dir}/rank{rank}.log", errors="replace").read().splitlines()
            log = [ln[:400] for ln in lines if any(w in ln.lower() for w in LOG_LINES)][-20:]
        fr = f"{dump_dir}/nccl_fr_rank{rank}"
        stacks = f"{dump_dir}/rank{rank}_stacks.txt"
        out[rank] = {"stalls": stalls, "hung": stalls[-1] if stalls else None, "log": log,
                     "nccl_dump_on_timeout": _nccl_flight_recorder(open(fr, "rb").read()) if os.path.exists(fr) else None,
                     "faulthandler": open(stacks).read()[:8000] if os.path.exists(stacks) else ""}
    return out

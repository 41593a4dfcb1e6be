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
- ``run_batch``: a model forward. The replacement issues two all-reduces shaped
  ``[batch size, hidden]``, like a TP forward's per-layer all-reduces.
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
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

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


# ----------------------------------------------------------------------------------------------
class Harness:
    """One TP rank: owns the gloo group, builds a fresh model-less Scheduler per scenario."""

    def __init__(self, rank: int, world: int, port: int, timeout_s: float, ipc_dir: str):
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self.tp = dist.group.WORLD
        singles = [dist.new_group([r]) for r in range(world)]
        self.cp = singles[rank]  # attention CP = 1: a one-rank group, as upstream builds it
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
        """A TP forward's collective pattern: all-reduces sized by the batch, on the TP group."""
        import torch
        import torch.distributed as dist

        x = torch.ones(len(batch.reqs), HIDDEN)
        for _ in range(2):
            dist.all_reduce(x, group=self.tp)
        return SimpleNamespace(delay_sample_func=None, copy_done=None)

    def _process_batch_result(self, batch, result):
        s = self.s
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
        import torch.distributed as dist

        from dsv4_sm120.guard import loop_guard

        use_loops(loops)
        s = self.build(sc)
        loop = getattr(s, f"event_loop_{sc.kind}_disagg_{sc.loop}")
        self.guard_seconds = self.batch_check_seconds = 0.0
        if sc.ends_at_max:  # the bench: also time the guard's calls themselves
            self._time_guard_calls()
        started = time.perf_counter()
        try:
            loop()
        except loop_guard.CollectiveGuardFailFast as exc:
            return RankResult(self.rank, "failfast", str(exc), iters=self.iteration)
        except RuntimeError as exc:
            text = str(exc)
            status = "hang" if "imed out" in text or "timeout" in text.lower() else "error"
            return RankResult(self.rank, status, f"{type(exc).__name__}: {text[:300]}", iters=self.iteration)
        except Exception:  # noqa: BLE001
            return RankResult(self.rank, "error", traceback.format_exc()[-1500:], iters=self.iteration)
        self._drain()
        leftovers = {name: [getattr(x, "req", x).rid for x in q] for name, q in self._queues() if q}
        dist.barrier(group=self.tp)
        c = loop_guard.counters
        status = "ok" if self.iteration < self.sc.max_iters or self.sc.ends_at_max else "stuck"
        return RankResult(self.rank, status, "" if status == "ok" else f"still busy at max_iters: {self.busy}",
                          leftovers=leftovers, outcomes=dict(self.outcomes), iters=self.iteration,
                          counters={"seen": c.divergences_seen, "reconciled": c.divergences_reconciled,
                                    "aborted": c.requests_aborted, "fail_fasts": c.fail_fasts},
                          seconds=time.perf_counter() - started, guard_seconds=self.guard_seconds,
                          batch_check_seconds=self.batch_check_seconds,
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


def prepare_loops(tmp: str) -> None:
    """In the parent, before forking: load the pin's loop methods, pristine and patched.

    Both come from copies under ``tmp`` (``pristine``: the pin's bytes, reverted there if the venv's
    sglang was patched; ``patched``: ``dsv4-sm120 patch apply --sglang-root`` on a copy), never from
    the installed modules, so the suite means the same whether or not the venv was patched. Each copy
    is executed under its real module name (without replacing the installed modules in
    ``sys.modules``); its loop methods are kept for ``use_loops``.
    """
    import importlib.util
    from pathlib import Path

    import sglang.srt.disaggregation.decode as dec
    import sglang.srt.disaggregation.prefill as pre
    from sglang.srt.managers.scheduler import Scheduler  # noqa: F401 - imports the mixins first

    import pristine

    trees = {"upstream": pristine.pristine_tree(Path(tmp) / "pristine"),
             "patched": pristine.patched_tree(Path(tmp) / "patched")}
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
    """Once per test process, before forking ranks: import sglang, publish a CPU ServerArgs, load the loops."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(ServerArgs(model_path="dummy", device="cpu", disaggregation_mode="prefill"),
                            role="scheduler")
    prepare_loops(tmp)
    _apply_guard_hooks()


def _apply_guard_hooks() -> None:
    """The guard area's hooks, registered and applied with upstream's HookRegistry as the plugin does
    with the guard on. They act only on schedulers the patched loop guards, so the guard-off and
    upstream-loop scenarios run upstream's code."""
    import dataclasses

    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_sm120 import settings
    from dsv4_sm120.guard import hooks, poll_reduce

    if poll_reduce.TARGET not in HookRegistry._patched:
        hooks.register(dataclasses.replace(settings.load(), collective_guard=True))
        HookRegistry.apply_hooks()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world, port, timeout_s, ipc_dir, jobs, conn, env):
    os.environ.update(env)
    try:
        h = Harness(rank, world, port, timeout_s, ipc_dir)
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


def run_group(world: int, jobs: list, timeout_s: float = 20.0, env: dict | None = None, wall_s: float = 600.0):
    """Fork ``world`` ranks (from this process, which has already imported sglang) and run ``jobs``.

    Returns ``{seed: [RankResult per rank]}`` plus ``"exits"``; a rank that neither answered nor exited by ``wall_s``
    is killed and reported as a hang. A group whose rendezvous port was taken between ``free_port``
    and rank 0's bind (the machine is shared: EADDRINUSE before any job ran) is started again on
    another port, up to twice.
    """
    for attempt in range(3):
        results = _run_group_once(world, jobs, timeout_s, env, wall_s)
        lost_port = results.get(None)
        if attempt == 2 or not lost_port or not any(
                r is not None and r.status == "error" and "EADDRINUSE" in (r.detail or "") for r in lost_port):
            return results
    return results


def _run_group_once(world: int, jobs: list, timeout_s: float, env: dict | None, wall_s: float):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    port = free_port()
    ipc_dir = tempfile.mkdtemp(prefix="dsv4guard")
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(rank, world, port, timeout_s, ipc_dir, jobs, child, env or {}))
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
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        exits[rank] = (p.exitcode, time.monotonic() - answered)
        if p.is_alive():
            p.kill()
            p.join()
        if p.exitcode not in (0, None):
            for per_rank in results.values():
                if per_rank[rank] is None:
                    per_rank[rank] = RankResult(rank, "error", f"process died with exit code {p.exitcode}")
    results["exits"] = exits  # rank -> (exit code, seconds from the last answer to the exit)
    return results

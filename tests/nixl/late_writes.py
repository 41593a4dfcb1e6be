"""CPU stand-ins for the PD abort-safety tests: a slow prefill send, the decode's hold list, and an ACK listener.

Everything NIXL-side is the pin's real code over the loopback pair (:mod:`dsv4_sm120.loopback.pair`).
What cannot run on a CPU without a scheduler is played here, and only that:

- :func:`slow_send`: the prefill's transfer worker posts a room's KV write ``delay_s`` late (a busy or
  stalled transport), the fault that lets a write land after its room was aborted;
- :class:`HoldList`: upstream's own ``DecodeTransferQueue`` (``_defer_release`` and
  ``resolve_deferred_releases`` unchanged), built without a scheduler: releasing a request hands its
  destination pages to a callback instead of the KV allocator (or, given a tree cache, to upstream's
  ``_release_request``), and the TP reduction runs over a real one-rank gloo group;
- :class:`DecodeKV`: a decode's KV books, upstream's own classes on CPU (request rows, paged token allocator,
  the radix tree a PD decode runs disabled, the idle memory-leak check) under such a hold list;
- :func:`acks_on_their_way`: the decode's incoming ABORT_ACKs are delayed until the test delivers them;
- :class:`AckListener`: a decode endpoint of the test's own, where the prefill's ABORT_ACKs for an ABORT
  the test sent arrive.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np


@contextlib.contextmanager
def slow_send(mgr, delay_s: float, calls: int = 1, until: threading.Event | None = None):
    """The next ``calls`` KV sends of prefill manager ``mgr`` are posted ``delay_s`` late (with ``until``: once the
    test sets it, ``delay_s`` at most), so that what a test checks meanwhile does not race the clock; yields an
    event set when the first delayed send has begun (the worker holds the chunk and has not posted it yet), its
    ``at`` the time it began."""
    original = mgr.send_kvcache
    began = threading.Event()
    left = [calls]

    def delayed(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            began.at = time.monotonic()
            began.set()
            if until is None:
                time.sleep(delay_s)
            else:
                until.wait(delay_s)
        return original(*args, **kwargs)

    mgr.send_kvcache = delayed
    try:
        yield began
    finally:
        mgr.send_kvcache = original


_gloo = threading.Lock()


def one_rank_gloo_group():
    """A real gloo process group of this process alone (upstream's TP CPU group at TP=1)."""
    import torch.distributed as dist

    from dsv4_sm120.loopback.pair import free_port

    with _gloo:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return dist.new_group([0], backend="gloo")


RESERVED_DECODE_TOKENS = 64  # what the decode preallocates past a prompt (upstream's reserved decode tokens)


def pin_req(rid: str, room: int, tokens: int = 1, max_new_tokens: int = 1 << 20):
    """The pin's own ``Req`` of a PD room, holding ``tokens`` KV tokens where upstream keeps that count; its
    prompt is :data:`RESERVED_DECODE_TOKENS` shorter, as the decode preallocates past it."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    prompt = max(tokens - RESERVED_DECODE_TOKENS, 1)
    req = Req(rid, "", array("q", range(prompt)), SamplingParams(max_new_tokens=max_new_tokens), bootstrap_room=room)
    req.kv.kv_allocated_len = tokens
    return req


class _Slots:
    def clear_slot(self, idx):
        pass

    def free(self, idx):
        pass


class _Scheduler:
    enable_hisparse = False

    class metrics_reporter:  # noqa: N801 - the attribute upstream reads
        enable_metrics = False


class HoldList:
    """Upstream's ``DecodeTransferQueue`` deferred-release path; ``released(decode_req)`` runs where the pages
    would go back to the allocator (``released=None``: upstream's ``_release_request`` gives them back to
    ``tree_cache``'s allocator)."""

    def __init__(self, timeout_s: float, released=None, tree_cache=None):
        from sglang.srt.disaggregation.decode import DecodeTransferQueue

        queue = object.__new__(DecodeTransferQueue)
        queue._deferred_releases = []
        queue.enable_deferred_kv_release = True
        queue.deferred_kv_release_timeout = timeout_s
        queue.gloo_group = one_rank_gloo_group()
        queue.enable_host_receive = False
        queue.enable_staging = False
        queue.metadata_buffers = queue.req_to_metadata_buffer_idx_allocator = _Slots()
        queue.scheduler = _Scheduler()
        queue.tree_cache = tree_cache
        if released is not None:
            queue._release_request = released
        self.queue = queue

    def hold(self, session):
        """The decode aborted ``session`` mid-transfer: its request goes into the hold list, as upstream's
        failure path does for a room it notified."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        req = pin_req(f"req-{session.room}", session.room, 256 * len(session.dst))
        decode_req = DecodeRequest(req=req, kv_receiver=session.receiver, metadata_buffer_index=0)
        self.queue._defer_release(decode_req)
        return decode_req

    def resolve(self):
        self.queue.resolve_deferred_releases()

    def held(self) -> int:
        return len(self.queue._deferred_releases)


class DecodeKV:
    """A decode's KV books as upstream keeps them, on CPU, and its hold list (:class:`HoldList`): a request-row
    pool, a paged token allocator, the radix tree a PD decode runs (disabled), and the invariant checker the
    scheduler's idle self-check runs."""

    PAGE = 16

    def __init__(self, release_timeout_s: float, pages: int = 64, rows: int = 8):
        import torch
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
        from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.rows = ReqToTokenPool(size=rows, max_context_len=pages * self.PAGE, device="cpu", enable_memory_saver=False)
        self.allocator = PagedTokenToKVPoolAllocator(size=pages * self.PAGE, page_size=self.PAGE, dtype=torch.bfloat16,
                                                     device="cpu", kvcache=None, need_sort=False)
        self.tree = UnifiedRadixCache(CacheInitParams(
            disable=True, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator,
            page_size=self.PAGE, tree_components=(ComponentType.FULL,)))
        self.total = self.allocator.size
        books = dict(tree_cache=self.tree, token_to_kv_pool_allocator=self.allocator, req_to_token_pool=self.rows,
                     is_hybrid_swa=False, is_hybrid_ssm=False, full_tokens_per_layer=None, swa_tokens_per_layer=None,
                     max_total_num_tokens=self.total)
        self.observer = SchedulerPoolStatsObserver(session_controller=None, hisparse_coordinator=None,
                                                   enable_hisparse=False, **books)
        self.checker = SchedulerInvariantChecker(
            disaggregation_mode=DisaggregationMode.DECODE, page_size=self.PAGE, pool_stats_observer=self.observer,
            get_last_batch=lambda: None, get_running_batch=lambda: None, scheduler_stage_metrics=None, **books)
        self.queue = HoldList(release_timeout_s, tree_cache=self.tree).queue

    def admit(self, room: int, pages: int):
        """A request of room ``room`` whose received KV fills ``pages`` pages, allocated as the decode's
        preallocation does (a request row, its token slots written into it)."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        tokens = pages * self.PAGE
        req = Req(f"req-{room}", "", array("q", range(tokens)), SamplingParams(max_new_tokens=1 << 20),
                  bootstrap_room=room)
        self.rows.alloc([req])
        self.rows.write((req.kv.req_pool_idx, slice(0, tokens)), self.allocator.alloc(tokens))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = tokens
        return req

    def finish(self, req) -> None:
        """What upstream's decode result processing does for a request whose ``to_finish`` is set: finish it, then
        release its KV (with a checkpoint into the tree), through its own module's binding."""
        from sglang.srt.managers.scheduler_components import batch_result_processor

        req.update_finish_state()
        batch_result_processor.release_kv_cache(req, self.tree, checkpoint=True)

    def free_tokens(self) -> int:
        return self.allocator.available_size()

    def idle_leaks(self) -> list[str]:
        """What the scheduler's idle self-check (``Scheduler.self_check_during_idle``) reports: nothing while its
        hold list has entries (it skips the check then), else its token-pool and request-row leaks."""
        if self.queue.has_pending_deferred_releases():
            return []
        leak, messages = self.checker._check_all_pools(self.observer.get_pool_stats())
        rows_before = self.checker.count_req_pool_leak_warnings
        self.checker._check_req_pool()
        return (messages if leak else []) + (
            ["request rows leaked"] if self.checker.count_req_pool_leak_warnings > rows_before else [])


@contextlib.contextmanager
def acks_on_their_way(mgr):
    """The decode manager ``mgr``'s incoming ABORT_ACKs are held on their way (a slow network); yields
    ``deliver()``, which hands the held ones to upstream as its listener would (so does leaving the block). Its
    ``held`` lists them."""
    original = mgr.note_abort_ack
    held: list[tuple] = []

    def deliver():
        while held:
            original(*held.pop(0))

    deliver.held = held
    mgr.note_abort_ack = lambda *args: held.append(args)
    try:
        yield deliver
    finally:
        del mgr.note_abort_ack
        deliver()


class AckListener:
    """A decode endpoint of the test's own: the ABORT it sends names this socket, the prefill's ACK comes here."""

    def __init__(self):
        import zmq

        from dsv4_sm120.loopback.pair import free_port

        self.port = free_port()
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.acks: list[tuple[float, list[bytes]]] = []

    def abort_frame(self, room: int, generation: int = 1) -> list[bytes]:
        from sglang.srt.disaggregation.common.conn import AbortNotification

        return AbortNotification(room=room, decode_ip="127.0.0.1", decode_port=self.port,
                                 generation=generation).to_zmq()

    def drain(self) -> int:
        import zmq

        while self._sock.poll(0, zmq.POLLIN):
            self.acks.append((time.monotonic(), self._sock.recv_multipart()))
        return len(self.acks)

    def close(self):
        self._sock.close(0)


def landed(pd, s) -> bool:
    """Whether ``s``'s prefill pages are now what its decode pages hold (its write has landed)."""
    return bool(pd.verify(s))


def stamp(pd, pages: np.ndarray, value: int) -> None:
    """A new owner of ``pages`` writes its own bytes into them (its transfer, or its decode steps)."""
    for layer in pd.dst_kv:
        layer[pages] = value


def stamped(pd, pages: np.ndarray, value: int) -> bool:
    return all(bool((layer[pages] == value).all()) for layer in pd.dst_kv)


@contextlib.contextmanager
def stuck_handles(mgr, seconds: float):
    """For ``seconds``, the prefill's NIXL handles read as a broken batch: the first one asked about ERR, every
    other one still running (PROC); then their real states. Yields the handles it answered for."""
    agent = mgr.agent
    original = agent.check_xfer_state
    until = time.monotonic() + seconds
    seen: list = []

    def state(handle):
        if time.monotonic() >= until:
            return original(handle)
        if not any(h is handle for h in seen):
            seen.append(handle)
        return "ERR" if seen[0] is handle else "PROC"

    agent.check_xfer_state = state
    try:
        yield seen
    finally:
        agent.check_xfer_state = original

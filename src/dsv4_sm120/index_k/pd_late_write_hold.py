"""Integrity mode on the decode: a request failed for a late write keeps its KV pages until no write can reach them.

The changed page :mod:`.pd_late_writes` finds is an aborted room's NIXL write that landed after that room's
pages went to this request. NIXL cannot cancel a posted write, so the room may have more writes on their way:
handed back to the allocator when the failed request finishes, the pages would go to the next request and
corrupt it too. So they go where upstream (sglang 0.5.23) holds an aborted room's pages, its own hold list
``DecodeTransferQueue._deferred_releases``:

* **Hand-over** (AROUND ``release_kv_cache``): when upstream releases the failed request's KV at its finish, the
  request enters the hold list instead, as a ``DecodeRequest`` whose receiver is its :class:`Hold` and whose
  deadline is infinity. Nothing is freed, and nothing of the corrupt KV enters the prefix cache.
* **Release**: each scheduler iteration upstream asks every entry's receiver whether its pages may go back
  (``resolve_deferred_releases``, ``kv_mgr.is_abort_release_safe``). The hold says yes once
  ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (as upstream read it: 30 s by default) has passed
  since the hand-over and every aborted room the list held at the verdict (deferred, or quarantined by
  :mod:`dsv4_sm120.nixl.decode_hold`) has left it; or at once when the decode's heartbeat has declared lost,
  after the verdict, every prefill that could be the writer: the request's own and those of these rooms.
  Upstream then releases the entry; an AROUND hook on ``_do_release`` frees only the request's KV, with
  upstream's ``_release_request`` (its metadata slot went back when its transfer completed).

Upstream's own accounting covers the entry: its idle memory-leak check (``Scheduler.self_check_during_idle``)
is skipped while the list holds anything, the scheduler does not count as idle, and ``release_memory_occupation``
drops the entry with the others. Nothing here launches device work or waits for it. On ``/metrics``:
``sglang:dsv4_pd_late_write_tokens_held`` and ``sglang:dsv4_pd_late_write_holds_released_total{why}``.

What it cannot know is which room wrote. A room upstream released before the verdict (at its timeout with
``DSV4_SM120_NIXL_HARDENING=0``, or at once with deferred release off) is not among those waited for: the hold
then ends at its timeout, and a later write of that room lands wherever the allocator has put those pages since.
The heartbeat rule takes the writer to be on one of the prefills named above, and sees the heartbeat only with
NIXL hardening on (:mod:`dsv4_sm120.nixl.decode_hold` tracks it). A request retracted between its verdict and its
finish gives its pages up with the retraction. With more than one attention TP rank no request is failed, so
nothing is held: upstream reduces the list over those ranks, which must hold the same entries.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass

from dsv4_sm120 import metrics
from dsv4_sm120.nixl import decode_hold

logger = logging.getLogger("dsv4_sm120.index_k.pd_late_writes")

RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"
DO_RELEASE = "sglang.srt.disaggregation.decode.DecodeTransferQueue._do_release"

_failed: dict[int, Hold] = {}  # id(req) -> its hold, from the verdict until upstream releases the request's KV
_queues: weakref.WeakSet = weakref.WeakSet()  # the hold lists a request was handed to, for the gauge


@dataclass(eq=False)
class Hold:
    """A failed request's place in upstream's hold list. It is the entry's receiver and that receiver's manager:
    upstream asks it :meth:`is_abort_release_safe`."""

    queue: object  # the decode's DecodeTransferQueue
    req: object
    rooms: tuple  # DecodeRequests of the aborted rooms the list held at the verdict, until they leave it
    prefills: frozenset  # bootstrap addresses of the prefills that could be the writer
    found: float  # when the late write was found
    until: float = math.inf  # the pages go back no earlier than this (set at the hand-over)
    tokens: int = 0
    why: str = ""  # why upstream may release it: "waited" or "prefill_lost"

    @property
    def kv_mgr(self) -> Hold:
        return self

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Upstream's question to the entry: may the pages go back to the allocator now?"""
        if not self.why:
            if self._prefills_lost():
                self.why = "prefill_lost"
            elif time.monotonic() >= self.until and not self._rooms_still_held():
                self.why = "waited"
        return bool(self.why)

    def _prefills_lost(self) -> bool:
        return bool(self.prefills) and all(decode_hold.lost_since(addr, self.found) for addr in self.prefills)

    def _rooms_still_held(self) -> bool:
        held = {id(entry[0]) for entry in self.queue._deferred_releases}
        self.rooms = tuple(d for d in self.rooms if id(d) in held)
        return bool(self.rooms)


def fail(req, prefill: str | None, queue) -> None:
    """The late-write check failed the running ``req``: hold its pages when upstream releases them. ``prefill`` is
    the bootstrap address its KV came from; ``queue`` the decode's transfer queue (None: nothing is held)."""
    if queue is None:
        return
    rooms = tuple(entry[0] for entry in queue._deferred_releases if not isinstance(entry[0].kv_receiver, Hold))
    writers = {prefill, *(getattr(d.kv_receiver, "bootstrap_addr", None) for d in rooms)} - {None}
    _failed[id(req)] = Hold(queue, req, rooms, frozenset(writers), time.monotonic())


def hand_over(original, req, tree_cache, *args, **kwargs):
    """AROUND ``release_kv_cache``: a request failed for a late write enters the hold list instead of freeing its
    KV when it finishes."""
    hold = _failed.pop(id(req), None) if _failed else None
    if hold is None:
        return original(req, tree_cache, *args, **kwargs)
    if not req.finished():
        logger.warning("PD late write: request %s (room %s) was retracted before it finished; its pages went back "
                       "with the retraction", req.rid, req.bootstrap_room)
        return original(req, tree_cache, *args, **kwargs)
    _enter_hold_list(hold)
    return None


def _enter_hold_list(hold: Hold) -> None:
    from sglang.srt.disaggregation.decode import DecodeRequest

    now = time.monotonic()
    hold.until = now + hold.queue.deferred_kv_release_timeout
    hold.tokens = decode_hold.kv_tokens_held(hold.req)
    hold.queue._deferred_releases.append((DecodeRequest(req=hold.req, kv_receiver=hold), now, math.inf, -1, 0))
    _queues.add(hold.queue)
    logger.warning("PD late write: request %s (room %s) failed; its %d KV tokens stay out of the allocator for at "
                   "least %g s and until the %d aborted rooms held at the verdict are released, or until the heartbeat "
                   "declares prefill %s lost", hold.req.rid, hold.req.bootstrap_room, hold.tokens,
                   hold.queue.deferred_kv_release_timeout, len(hold.rooms), ", ".join(sorted(hold.prefills)) or "?")


def release_held(original, queue, decode_req, idx):
    """AROUND ``DecodeTransferQueue._do_release``: a held request gives its KV back with upstream's
    ``_release_request``; the rest of ``_do_release`` tears down a transfer, which this request finished long ago."""
    hold = decode_req.kv_receiver
    if not isinstance(hold, Hold):
        return original(queue, decode_req, idx)
    queue._release_request(decode_req)
    decode_req.kv_receiver = None
    metrics.inc("pd_late_write_holds_released_total", why=hold.why)
    logger.info("PD late write: request %s (room %s) released (%s) after %.1f s; its %d KV tokens are free again",
                hold.req.rid, hold.req.bootstrap_room, hold.why.replace("_", " "), time.monotonic() - hold.found,
                hold.tokens)
    return None


def held(queue) -> list[Hold]:
    """The failed requests ``queue`` holds now."""
    receivers = [entry[0].kv_receiver for entry in list(queue._deferred_releases)]
    return [r for r in receivers if isinstance(r, Hold)]


def sample_gauges() -> dict:
    """``sglang:dsv4_pd_late_write_tokens_held``: the KV tokens the hold lists keep for failed requests now."""
    return {"pd_late_write_tokens_held": sum(h.tokens for queue in list(_queues) for h in held(queue))}

"""Decode pages of an aborted room stay out of the allocator until no NIXL write can reach them.

Upstream (sglang 0.5.23) holds an aborted room's decode pages until every prefill rank that could
write them acknowledges the abort (``DecodeTransferQueue.resolve_deferred_releases``, switched by
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``). When no acknowledgement comes within
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s) it releases them anyway. NIXL cannot
cancel a posted write, so a write still on its way then lands in pages the allocator has handed to
another request, which decodes on the aborted request's KV and index keys with nothing logged.

A missing acknowledgement is exactly the case where a write may still be running (a prefill whose
handles never settled withholds it on purpose), so here the timeout *quarantines* the room's pages
instead: the entry stays in upstream's own hold list, its deadline put out of reach, and upstream
releases it through its own path once the acknowledgement comes (the prefill's write ledger sends it
when the room finally drains, :mod:`.write_ledger`) or once the decode's heartbeat declares that
prefill lost (its process, and so its writes, are gone). Upstream reduces every rank's readiness with
MIN over the attention TP group, so a rank that quarantined keeps the others holding too: the ranks
stay in step.

Nothing waits here: the hook only rewrites the deadlines of entries already past them. Counted on
``/metrics`` as ``sglang:dsv4_pd_rooms_quarantined`` and ``sglang:dsv4_pd_tokens_quarantined`` (what is held
past the timeout now), ``sglang:dsv4_pd_quarantines_total`` and ``sglang:dsv4_pd_quarantine_released_total{why}``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass

from dsv4_sm120 import metrics, settings

logger = logging.getLogger("dsv4_sm120.nixl")

RESOLVE = "sglang.srt.disaggregation.decode.DecodeTransferQueue.resolve_deferred_releases"
NODE_FAILURE = "sglang.srt.disaggregation.common.conn.CommonKVManager._handle_node_failure"

_lock = threading.Lock()
# bootstrap address -> when the decode's heartbeat last declared that prefill lost
_lost_at: dict[str, float] = {}
_queues: "weakref.WeakSet" = weakref.WeakSet()  # the hold lists that quarantined something, for the gauges
_STATE = "_dsv4_quarantined"


@dataclass
class Quarantined:
    room: int
    tokens: int  # KV tokens the request holds
    since: float  # when its deadline passed
    prefill_lost: bool = False


def kv_tokens_held(req) -> int:
    """The KV tokens ``req`` holds in the decode's pool (its allocation past what the prefix cache protects)."""
    return req.kv.kv_allocated_len - req.kv.cache_protected_len


def _prefill_lost_since(decode_req, since: float) -> bool:
    """Whether the heartbeat declared this request's prefill lost after ``since`` (its writes ended with it)."""
    return lost_since(getattr(decode_req.kv_receiver, "bootstrap_addr", None), since)


def lost_since(bootstrap_addr: str | None, since: float) -> bool:
    """Whether the heartbeat declared the prefill at ``bootstrap_addr`` lost after ``since``."""
    with _lock:
        lost = _lost_at.get(bootstrap_addr)
    return lost is not None and lost >= since


def hold_until_drained(original, queue):
    """AROUND ``resolve_deferred_releases``: an entry past its deadline without the prefill's drain
    acknowledgement stays held (quarantined) until it drains or its prefill is declared lost."""
    entries = queue._deferred_releases
    held: dict[int, Quarantined] = queue.__dict__.setdefault(_STATE, {})
    if not entries:
        held.clear()  # upstream dropped its holds (the pool's memory released): nothing is quarantined
        return original(queue)
    if not settings.load().nixl_hardening:  # read per call: one process may hold both behaviours
        return original(queue)
    now = time.monotonic()
    kept = []
    for entry in entries:
        decode_req, start, deadline, idx, acks = entry
        key = id(decode_req)
        if key in held:
            if _prefill_lost_since(decode_req, start):
                held[key].prefill_lost = True
                entry = (decode_req, start, start, idx, acks)  # upstream releases it now
        elif now >= deadline and not queue._is_host_destination(decode_req) \
                and not _prefill_lost_since(decode_req, start):
            held[key] = _quarantine(decode_req, now, now - start)
            _queues.add(queue)
            entry = (decode_req, start, math.inf, idx, acks)
        kept.append(entry)
    queue._deferred_releases = kept
    try:
        return original(queue)
    finally:
        if held:
            _note_released(queue, held)


def _quarantine(decode_req, now: float, waited_s: float) -> Quarantined:
    q = Quarantined(decode_req.req.bootstrap_room, kv_tokens_held(decode_req.req), now)
    metrics.inc("pd_quarantines_total")
    logger.warning(
        "dsv4-sm120: room %s (request %s) aborted %.0f s ago has no drain acknowledgement from prefill %s; its %d "
        "KV tokens stay quarantined, out of the allocator, until that prefill reports the room drained or is "
        "declared lost (DSV4_SM120_NIXL_HARDENING=1)",
        q.room, decode_req.req.rid, waited_s, getattr(decode_req.kv_receiver, "bootstrap_addr", "?"), q.tokens)
    return q


def _note_released(queue, held: dict[int, Quarantined]) -> None:
    """Forget, count and log the quarantined entries upstream released in this call."""
    still = {id(entry[0]) for entry in queue._deferred_releases}
    for key in [k for k in held if k not in still]:
        q = held.pop(key)
        why = "prefill_lost" if q.prefill_lost else "drained"
        metrics.inc("pd_quarantine_released_total", why=why)
        logger.info("dsv4-sm120: quarantined room %s released (%s) after %.0f s; its %d KV tokens are free again",
                    q.room, why.replace("_", " "), time.monotonic() - q.since, q.tokens)


def prefill_lost(result, manager, failed_bootstrap_addr, *args, **kwargs):
    """AFTER ``_handle_node_failure``: the heartbeat lost this prefill, so no write of it can still land."""
    with _lock:
        _lost_at[failed_bootstrap_addr] = time.monotonic()
    return result


def quarantined(queue) -> list[Quarantined]:
    """The rooms ``queue`` holds past their deadline now."""
    return list(queue.__dict__.get(_STATE, {}).values())


def sample_gauges() -> dict:
    """``sglang:dsv4_pd_rooms_quarantined`` and ``..._tokens_quarantined``: what the hold lists keep now."""
    held = [q for queue in list(_queues) for q in quarantined(queue)]
    return {"pd_rooms_quarantined": len(held), "pd_tokens_quarantined": sum(q.tokens for q in held)}

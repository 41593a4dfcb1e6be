"""Bring the ranks' queues back into agreement after a rank-local divergence.

Rule: a request stays only if EVERY rank of the group holds it in the same
queue; every other request is retired, on the ranks that hold it, with
upstream's own release routine for that queue, and its client receives an
abort that says why. The surviving items are put in one canonical order (the
lowest rank's) because upstream pairs all-reduced poll states by position.

Nothing here issues a collective: the caller has already exchanged the id lists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus
from types import SimpleNamespace

from dsv4_sm120.guard import snapshot

logger = logging.getLogger("dsv4_sm120.guard")

# Status the client sees: the server is fine, this one request lost a race with a mass abort.
ABORT_STATUS = HTTPStatus.SERVICE_UNAVAILABLE


@dataclass
class Plan:
    """What every rank agreed to do, computed identically from the gathered lists."""

    keep: dict[str, list[str]]  # queue -> rids every rank holds there, canonical order
    orphans: dict[str, dict[str, list[int]]]  # queue -> rid -> group ranks holding it
    ipc: dict[str, str | None]  # rid -> http_worker_ipc route for the abort message


def plan(gathered: list[dict], keep_common: bool = True) -> Plan:
    """From every rank's ``{"queues": {name: [rid]}, "ipc": {rid: route}}`` decide keep/orphans.

    ``keep_common=False``: keep nothing, every request listed is retired where held (a decode batch
    that cannot be run nor rolled back).
    """
    names = list(gathered[0]["queues"])
    keep, orphans, ipc = {}, {}, {}
    for name in names:
        per_rank = [g["queues"][name] for g in gathered]
        common = set(per_rank[0]).intersection(*map(set, per_rank[1:])) if keep_common else set()
        keep[name] = [rid for rid in per_rank[0] if rid in common]
        lost: dict[str, list[int]] = {}
        for rank, rids in enumerate(per_rank):
            for rid in rids:
                if rid not in common:
                    lost.setdefault(rid, []).append(rank)
        if lost:
            orphans[name] = lost
    for g in gathered:
        ipc.update(g["ipc"])
    return Plan(keep, orphans, ipc)


def reason(loop: str, queue: str, holders: list[int], world: int) -> str:
    return (
        f"aborted by the dsv4-sm120 collective guard: the {world} tensor-parallel ranks of the "
        f"{loop} scheduler disagreed on the {queue} queue after a rank-local abort or transfer "
        f"change (held by rank(s) {holders} only); the request was dropped so the ranks "
        f"could not deadlock. Retrying it is safe."
    )


def apply(scheduler, loop: str, p: Plan, world: int) -> int:
    """Retire this rank's orphans, reorder survivors, send each orphan's client its abort.

    Returns how many requests this rank retired.
    """
    retired = 0
    held = {}
    for name, keep in p.keep.items():
        items = snapshot.queue_items(scheduler, loop, name)
        by_rid = {snapshot.rid_of(x): x for x in items}
        lost = p.orphans.get(name, {})
        for rid, item in by_rid.items():
            if rid in lost:
                held[rid] = item
                _retire(scheduler, loop, name, item, reason(loop, name, lost[rid], world))
                retired += 1
        _keep_only(scheduler, loop, name, [by_rid[rid] for rid in keep])
    # One abort per orphan request, from whichever rank owns the tokenizer socket
    # (upstream's sender is a no-op on the others).
    told = set()
    for name, lost in p.orphans.items():
        for rid, holders in lost.items():
            if rid in told:
                continue
            told.add(rid)
            item = held.get(rid)
            recv_obj = getattr(item, "req", item) if item is not None else SimpleNamespace(http_worker_ipc=p.ipc.get(rid))
            _tell(scheduler, rid, recv_obj, reason(loop, name, holders, world))
    return retired


def retire_and_tell(scheduler, loop: str, queue: str, item, holder: int, world: int) -> None:
    """Retire one request this rank holds outside any queue (a chunked request of a dropped batch)."""
    message = reason(loop, queue, [holder], world)
    _retire(scheduler, loop, queue, item, message)
    _tell(scheduler, snapshot.rid_of(item), getattr(item, "req", item), message)


def _tell(scheduler, rid: str, recv_obj, message: str) -> None:
    """The client's abort, through upstream's sender (a no-op on ranks without the tokenizer socket)."""
    from sglang.srt.managers.io_struct import AbortReq

    scheduler.send_abort_output(
        AbortReq(rid=rid, abort_message=message,
                 finished_reason={"type": "abort", "status_code": ABORT_STATUS, "message": message}),
        recv_obj,
    )


def _tell_decode(req, message: str) -> None:
    """The PD router answers from the decode: it must learn, with this message, that the prefill dropped the request."""
    sender = getattr(req, "disagg_kv_sender", None)
    mgr = getattr(sender, "kv_mgr", None)
    if mgr is None or not hasattr(mgr, "conclude_failure"):  # no transfer backend that can tell it
        return
    from dsv4_sm120.nixl import tell_decode

    try:
        tell_decode.room_failed(mgr, sender.bootstrap_room, message)
    except Exception:  # noqa: BLE001 - the decode then waits for its own timeout; the release must still run
        logger.exception("dsv4-sm120: could not tell the decode of room %s", sender.bootstrap_room)


def _keep_only(scheduler, loop: str, name: str, items: list) -> None:
    """Make the live queue hold exactly ``items`` in this order."""
    if loop == "decode" and name == "running":
        batch = scheduler.running_batch
        if batch is None or [id(r) for r in batch.reqs] == [id(r) for r in items]:
            return
        index = {id(r): i for i, r in enumerate(batch.reqs)}
        batch.filter_batch(keep_indices=[index[id(r)] for r in items])
        return
    live = snapshot.queue_items(scheduler, loop, name)
    live[:] = items


def _retire(scheduler, loop: str, name: str, item, message: str) -> None:
    """Release one request this rank holds alone, with upstream's routine for its queue."""
    from sglang.srt.disaggregation.utils import prepare_abort

    req = getattr(item, "req", item)
    prepare_abort(req, message, status_code=ABORT_STATUS)
    try:
        if loop == "prefill":
            _tell_decode(req, message)
            if name == "inflight":
                scheduler._retire_aborted_prefill_result(req)
            else:
                scheduler.release_aborted_prefill_waiting_req(req)
        elif name in ("prealloc", "transfer"):
            item.kv_receiver.abort()
            if name == "transfer":
                queue = scheduler.disagg_decode_transfer_queue
                queue._release_request(item)
                if item.metadata_buffer_index != -1:  # given back as upstream's pop_transferred does
                    queue.metadata_buffers.clear_slot(item.metadata_buffer_index)
                    queue.req_to_metadata_buffer_idx_allocator.free(item.metadata_buffer_index)
        elif name == "retracted":
            from sglang.srt.mem_cache.common import discard_kv_cache_backup
            from sglang.srt.runtime_context import get_disagg

            discard_kv_cache_backup(req, scheduler.tree_cache, get_disagg().disaggregation_decode_retraction_backup)
        else:  # decode waiting / running: KV allocated, nothing in flight
            from sglang.srt.mem_cache.common import release_kv_cache

            release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
    except Exception:  # noqa: BLE001 - the queue must still be reconciled; the leak is logged
        logger.exception("dsv4-sm120 guard: releasing %s request %s failed; it is dropped anyway", name, req.rid)

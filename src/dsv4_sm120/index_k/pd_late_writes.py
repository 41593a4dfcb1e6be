"""Integrity mode on the decode: a page received over NIXL must not change while its request decodes.

A NIXL write cannot be cancelled. When an aborted room's write lands after the decode handed its
pages to another request, that request decodes on the other request's KV and index keys, and
nothing fails. With ``DSV4_SM120_INDEX_K_CHECKSUM=1`` the decode watches for it at the reader:

* **Baseline**, when the receive of a room first answers Success (after the index-K send/receive
  check of :mod:`.pd_integrity`): the checksums of the room's *full* received pages (every page of
  its destination list but the last, which the request's own decode steps append to) in each
  registered KV buffer indexed by those pages: the bf16 index-K rows and the compressed KV rows of
  the same page numbers. Queued on the device's side stream; nothing waits.
* **Re-read**, at the request's first decode forward, every :data:`EVERY` decode forwards after
  it, and its last one where its length bounds it (``max_new_tokens``) (an AROUND hook on
  ``Scheduler.run_batch``, before the forward is launched): the due requests' pages are
  checksummed again, one gather and one checksum launch per buffer for the whole batch,
  compared with their baselines on the device, and the per-page verdicts go to pinned host memory
  behind an event. The current stream waits for the baselines' event on the device, never the host.
* **Verdict**, at a later ``run_batch`` once the event has completed: a changed page is a late
  write. It is counted once per page and request (``sglang:dsv4_pd_late_writes_total``),
  logged with the room, request, page and buffer, and the request, when still running, is failed
  with HTTP 500 naming them and the switch; its pages then stay out of the allocator until no write can
  reach them (:mod:`.pd_late_write_hold`). The last forward's verdict lands after the answer went
  out: it is counted and logged, the log saying so. Verdicts are rank-local: with more than one attention
  TP rank they are counted and logged, and the request is left to run (a rank-local abort would
  split the ranks' batches).

What it does not see: a write that lands before the baseline (the index-K part of that is the
send/receive check's), a write into the partial last page or the pages the request appends to,
and one that lands after the request's last re-read. A request that is retracted gives its pages
up, so its baseline is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus

import numpy as np

logger = logging.getLogger("dsv4_sm120.index_k.pd_late_writes")

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
EVERY = 16  # decode forwards between two re-reads of a request's pages
MAX_RECORDS = 8192  # baselines kept at most (the oldest go first): rooms whose request never decoded
STALE_S = 600.0


@dataclass(eq=False)
class Record:
    """One received room: its full pages, their rows in each watched buffer, and their baseline sums."""

    room: int
    pages: np.ndarray  # int64 [n] destination pages
    rows: list  # uint8 [pages, item] views of the watched buffers
    owner: int  # id of the decode manager whose buffers these are
    prefill: str | None  # bootstrap address of the prefill the pages came from
    names: list[str]
    index: object  # int64 tensor [n] on the buffers' device
    baseline: object  # int64 tensor [buffers, n] on the device
    ready: object  # CUDA event behind the baseline; None off CUDA
    made: float = field(default_factory=time.monotonic)
    forwards: int = 0
    retractions: int | None = None  # the request's retraction count when first seen: a retraction frees its pages
    bad: set = field(default_factory=set)  # (buffer, page) already reported


@dataclass(eq=False)
class _Check:
    records: list[Record]
    reqs: list
    spans: list[tuple[int, int]]  # each record's columns in ``verdict``
    verdict: object  # bool tensor [buffers, total]: on the host once ``landed`` completed
    landed: object


# Process-wide totals, read by tests and exported as ``sglang:dsv4_<name>``: pages whose baseline was taken (a
# page once per watched buffer), page rows re-read, distinct (request, page) pairs found changed, requests failed.
COUNTERS = {"pd_pages_watched_total": 0, "pd_page_rereads_total": 0, "pd_late_writes_total": 0,
            "pd_late_write_requests_failed_total": 0}


def count(name: str, n: int = 1) -> None:
    from dsv4_sm120 import metrics

    COUNTERS[name] += n
    metrics.inc(name, n)


_lock = threading.Lock()
_records: dict[int, Record] = {}
_pending: list[_Check] = []
_described: set[int] = set()


def watched_buffers(kv_args, index_k: list[int]) -> list[int]:
    """The registered KV buffers indexed by the destination pages: those with the index-K buffers' page count."""
    if not index_k:
        return []
    pages = kv_args.kv_data_lens[index_k[0]] // kv_args.kv_item_lens[index_k[0]]
    return [i for i, (n, item) in enumerate(zip(kv_args.kv_data_lens, kv_args.kv_item_lens)) if n // item == pages]


def record(receiver, state) -> None:
    """Queue the baseline of ``receiver``'s room, whose receive just answered Success."""
    import torch

    from dsv4_sm120.index_k import integrity, pd_rows

    dst = getattr(receiver, pd_rows.DST, None)
    if dst is None or len(dst) < 2:
        return
    mgr = receiver.kv_mgr
    buffers = watched_buffers(mgr.kv_args, state.buffers)
    if not buffers:
        return
    pages = np.asarray(dst[:-1], dtype=np.int64)
    rows = [pd_rows.page_rows(mgr.kv_args, i) for i in buffers]
    layer_ids = list(getattr(mgr.kv_args, "kv_layer_ids", None) or [])
    names = [f"buffer {i}" + (f" (kv layer id {layer_ids[i]})" if i < len(layer_ids) else "") for i in buffers]
    device = rows[0].device
    index = torch.as_tensor(pages)
    if device.type == "cuda":
        with pd_rows.behind_current(device):
            index = integrity.on_device(device, index)
            baseline = pd_rows.row_sums(rows, index)
            ready = torch.cuda.Event()
            ready.record()
    else:
        baseline, ready = pd_rows.row_sums(rows, index), None
    rec = Record(receiver.bootstrap_room, pages, rows, id(mgr), getattr(receiver, "bootstrap_addr", None), names,
                 index, baseline, ready)
    if id(mgr) not in _described:
        _described.add(id(mgr))
        logger.info("PD late-write check on (%s=1): the full received pages of %d registered buffers are re-read "
                    "every %d decode forwards (item bytes %s)", pd_rows.SWITCH, len(buffers), EVERY,
                    [mgr.kv_args.kv_item_lens[i] for i in buffers])
    with _lock:
        _records.pop(rec.room, None)  # kept in the order they were made: the stale ones are the first
        _records[rec.room] = rec
        while len(_records) > MAX_RECORDS:
            _records.pop(next(iter(_records)))
    count("pd_pages_watched_total", len(pages) * len(rows))


def _due(batch) -> list[tuple[Record, object]]:
    """The records whose re-read is due in this decode batch; a finished request's record is dropped."""
    out = []
    with _lock:
        for req in batch.reqs:
            rec = _records.get(getattr(req, "bootstrap_room", None))
            if rec is None:
                continue
            if req.finished():
                del _records[rec.room]
                continue
            retractions = getattr(req, "retraction_count", 0)
            if rec.retractions is None:
                rec.retractions = retractions
            elif retractions != rec.retractions:  # retracted: its KV went elsewhere, the pages to others
                del _records[rec.room]
                continue
            if rec.forwards % EVERY == 0 or _last_forward(req):
                out.append((rec, req))
            rec.forwards += 1
    return out


def _last_forward(req) -> bool:
    """Whether the forward about to run makes the request's last token (its length bound reached)."""
    bound = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    return bound is not None and len(getattr(req, "output_ids", None) or ()) + 1 >= bound


def check(batch) -> None:
    """Queue the re-read of the due requests of a decode ``batch`` (before its forward is launched)."""
    import torch

    from dsv4_sm120.index_k import integrity, pd_rows

    due = _due(batch)
    if not due:
        return
    owner = due[0][0].owner  # a decode process has one manager per rank; its rooms share the buffers
    due = [(rec, req) for rec, req in due if rec.owner == owner]
    records = [rec for rec, _ in due]
    rows = records[0].rows
    device = rows[0].device
    spans, start = [], 0
    for rec in records:
        spans.append((start, start + len(rec.pages)))
        start += len(rec.pages)
    cuda = device.type == "cuda"
    if cuda:
        stream = torch.cuda.current_stream(device)
        for rec in records:
            if rec.ready is not None:
                stream.wait_event(rec.ready)
    index = torch.cat([rec.index for rec in records])
    baseline = torch.cat([rec.baseline for rec in records], dim=1)
    changed = pd_rows.row_sums(rows, index) != baseline
    if cuda:
        verdict, landed = integrity.pinned_copy(changed)
    else:
        verdict, landed = changed, None
    with _lock:
        _pending.append(_Check(records, [req for _, req in due], spans, verdict, landed))
    count("pd_page_rereads_total", int(index.numel()) * len(rows))


def collect(attn_tp_size: int = 1, hold_list=None) -> None:
    """Read the re-reads that landed: count, log and fail what changed; a failed request's pages go to
    ``hold_list`` (the decode's ``DecodeTransferQueue``) when it finishes."""
    with _lock:
        ready, waiting = [], []
        for c in _pending:
            (ready if c.landed is None or c.landed.query() else waiting).append(c)
        _pending[:] = waiting
    for c in ready:
        changed = c.verdict.numpy()
        for rec, req, (lo, hi) in zip(c.records, c.reqs, c.spans):
            found = [(int(b), int(rec.pages[j])) for b, j in zip(*np.nonzero(changed[:, lo:hi]))]
            new = [(b, page) for b, page in found if (b, page) not in rec.bad]
            if new:
                _late_write(rec, req, new, attn_tp_size, hold_list)
    _forget_stale()


def _late_write(rec: Record, req, found: list[tuple[int, int]], attn_tp_size: int, hold_list) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from dsv4_sm120.index_k import pd_late_write_hold
    from dsv4_sm120.index_k.pd_rows import SWITCH

    pages = {page for _, page in found} - {page for _, page in rec.bad}  # a page counts once per request
    rec.bad.update(found)
    count("pd_late_writes_total", len(pages))
    answered = " (its answer went out before this verdict)" if req.finished() else ""
    for b, page in found[:16]:
        logger.error("PD late write: room=%s rid=%s page=%d %s changed after its receive completed%s",
                     rec.room, req.rid, page, rec.names[b], answered)
    where = ", ".join(f"page {page} {rec.names[b]}" for b, page in found[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    if attn_tp_size > 1 or req.finished():
        return
    message = (f"Request {req.rid} failed: a NIXL write landed in its received KV after the receive completed "
               f"(room {rec.room}: {where}{more}), most likely the late write of an aborted request. Caught by "
               f"{SWITCH}=1; retry it.")
    req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    count("pd_late_write_requests_failed_total", 1)
    pd_late_write_hold.fail(req, rec.prefill, hold_list)


def _forget_stale() -> None:
    """Drop the baselines older than ``STALE_S`` (rooms whose request never decoded): the oldest come first."""
    now = time.monotonic()
    with _lock:
        while _records:
            room, rec = next(iter(_records.items()))
            if now - rec.made <= STALE_S:
                return
            del _records[room]


def run_batch(original, scheduler, batch, *args, **kwargs):
    """AROUND ``Scheduler.run_batch`` (a decode server with integrity mode): collect the re-reads that landed,
    then queue those due for this decode batch, before its forward."""
    if _records or _pending:
        if _pending:
            collect(getattr(scheduler, "attn_tp_size", None) or _attn_tp_size(),
                    getattr(scheduler, "disagg_decode_transfer_queue", None))
        if batch is not None and batch.forward_mode.is_decode():
            check(batch)
    return original(scheduler, batch, *args, **kwargs)


def _attn_tp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_size)
    except Exception:  # noqa: BLE001 - unknown: act as one rank would not
        return 2

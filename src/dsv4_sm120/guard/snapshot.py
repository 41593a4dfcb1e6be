"""What the TP ranks must agree on before an overlap PD iteration issues collectives.

Each loop keeps queues whose polls are all-reduced only when the queue is not
empty, and whose order pairs the reduced poll states element by element; and
batch state that decides whether a forward or ``on_idle`` runs. A snapshot is
one ordered list of request ids per queue plus a few scalars. Its vector form
(per queue: length and an order-sensitive 62-bit digest) is what the ranks
compare each iteration; the id lists are exchanged only when the vectors differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from operator import is_

DIGEST_BITS = 62  # a non-negative int64 with room to spare

# Queues per loop: name -> how to read the scheduler's items for that queue.
PREFILL_QUEUES = ("bootstrap", "waiting", "inflight")
DECODE_QUEUES = ("prealloc", "retracted", "transfer", "waiting", "running")


def rid_of(item) -> str:
    """Request id of a queue item (a Req, or a decode-side DecodeRequest wrapping one)."""
    req = getattr(item, "req", None)
    return item.rid if req is None else req.rid


def _batch_rids(batch) -> list[str]:
    return [] if batch is None else [r.rid for r in getattr(batch, "reqs", ())]


def queue_items(scheduler, loop: str, name: str) -> list:
    """The scheduler's live list for one queue of ``loop`` ("prefill" or "decode")."""
    if loop == "prefill":
        if name == "bootstrap":
            return scheduler.disagg_prefill_bootstrap_queue.queue
        if name == "waiting":
            return scheduler.waiting_queue
        if name == "inflight":
            return scheduler.disagg_prefill_inflight_queue
    else:
        if name == "prealloc":
            return scheduler.disagg_decode_prealloc_queue.queue
        if name == "retracted":
            return scheduler.disagg_decode_prealloc_queue.retracted_queue
        if name == "transfer":
            return scheduler.disagg_decode_transfer_queue.queue
        if name == "waiting":
            return scheduler.waiting_queue
        if name == "running":
            batch = scheduler.running_batch
            return [] if batch is None else batch.reqs
    raise KeyError(f"no queue {name!r} in the {loop} loop")


def digest(rids: list[str]) -> int:
    """Order-sensitive digest of a list of request ids, in [0, 2**62): one hash over the joined ids."""
    if not rids:
        return 0
    h = hashlib.blake2b("\0".join(rids).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> (64 - DIGEST_BITS)


class Digests:
    """Per scheduler: each queue's id digest, recomputed only when the queue's items changed.

    The vectors the ranks compare every iteration are a function of the request ids in each queue,
    in order. Reading every id and hashing them again each time is most of an agreement's local
    work; instead the items last digested are kept (which also keeps their ``id()`` from being
    reused) and compared by identity, one C-level pass. A request's id never changes (upstream sets
    ``Req.rid`` once, in ``__init__``; a decode queue item wraps one ``Req`` for life), so the same
    items in the same order have the same ids and digest. ``tests/guard/test_guard_units.py``
    checks the cached vectors against fresh snapshots after every kind of queue change.
    """

    __slots__ = ("_items", "_digest")

    def __init__(self):
        self._items: dict[str, tuple] = {}
        self._digest: dict[str, int] = {}

    def of(self, key: str, items) -> int:
        """``digest`` of the ids of ``items`` (a sequence of queue items or requests)."""
        old = self._items.get(key)
        if old is not None and len(old) == len(items) and all(map(is_, old, items)):
            return self._digest[key]
        kept = tuple(items)
        value = digest([rid_of(x) for x in kept])
        self._items[key], self._digest[key] = kept, value
        return value


def top_vector(scheduler, loop: str, digests: Digests) -> list[int]:
    """``take(scheduler, loop).vector()``, from cached digests: what the first agreement compares."""
    out = []
    for name in PREFILL_QUEUES if loop == "prefill" else DECODE_QUEUES:
        items = queue_items(scheduler, loop, name)
        out += (len(items), digests.of(name, items))
    last = getattr(scheduler, "last_batch", None)
    chunked = getattr(scheduler, "chunked_req", None)
    out += (
        digests.of("chunked_req", () if chunked is None else (chunked,)),
        int(bool(last)),
        # decode's last batch is its running batch, a queue reconciled above; any other is not
        0 if last is None or last is getattr(scheduler, "running_batch", None) else digests.of("last_batch", last.reqs),
        len(getattr(scheduler, "result_queue", ()) or ()),
        len(getattr(scheduler, "_deferred_input_requests", ()) or ()),
    )
    return out


def queue_vector(scheduler, loop: str, name: str, digests: Digests) -> list[int]:
    """``take_queue(scheduler, loop, name).vector()``, from cached digests."""
    items = queue_items(scheduler, loop, name)
    return [len(items), digests.of(name, items)]


@dataclass
class Snapshot:
    loop: str
    queues: dict[str, list[str]]  # queue name -> request ids in queue order
    scalars: dict[str, int]  # batch state that picks forward vs on_idle

    def vector(self) -> list[int]:
        out = []
        for rids in self.queues.values():
            out += [len(rids), digest(rids)]
        return out + list(self.scalars.values())

    def labels(self) -> list[str]:
        out = []
        for name in self.queues:
            out += [f"{name}.len", f"{name}.digest"]
        return out + list(self.scalars)


def take(scheduler, loop: str) -> Snapshot:
    """Read this rank's state; cheap (no copies of requests, one pass over each queue)."""
    names = PREFILL_QUEUES if loop == "prefill" else DECODE_QUEUES
    queues = {name: [rid_of(x) for x in queue_items(scheduler, loop, name)] for name in names}
    last = getattr(scheduler, "last_batch", None)
    chunked = getattr(scheduler, "chunked_req", None)
    scalars = {
        "chunked_req.digest": digest([] if chunked is None else [chunked.rid]),
        "last_batch.present": int(bool(last)),
        # decode's last batch is its running batch, a queue reconciled above; any other is not
        "last_batch.digest": 0 if last is getattr(scheduler, "running_batch", None) else digest(_batch_rids(last)),
        "result_queue.len": len(getattr(scheduler, "result_queue", ()) or ()),
        "deferred_inputs.len": len(getattr(scheduler, "_deferred_input_requests", ()) or ()),
    }
    return Snapshot(loop, queues, scalars)


def take_queue(scheduler, loop: str, name: str) -> Snapshot:
    """One queue alone: what a poll site agrees on before upstream reduces that queue's polls."""
    return Snapshot(loop, {name: [rid_of(x) for x in queue_items(scheduler, loop, name)]}, {})


BATCH_FIELDS = ("batch.present", "batch.forward_mode", "batch.size", "batch.digest", "batch.extend_tokens",
                "batch.seq_lens_sum")


def batch_vector(batch, digests: Digests | None = None) -> list[int]:
    """What decides the forward's collectives: whether it runs, its mode, its requests, its token counts."""
    if not batch:
        return [0] * len(BATCH_FIELDS)
    reqs = getattr(batch, "reqs", ())
    mode = getattr(batch, "forward_mode", None)
    return [1, -1 if mode is None else int(mode), len(reqs),
            digest(_batch_rids(batch)) if digests is None else digests.of("batch", reqs),
            int(getattr(batch, "extend_num_tokens", None) or 0), int(getattr(batch, "seq_lens_sum", None) or 0)]

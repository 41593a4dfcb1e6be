"""Which rooms may still have NIXL writes landing on the decode: an abort is acknowledged only after them.

The decode frees an aborted room's pages once every prefill rank acknowledges the abort
(``ABORT_ACK``, upstream's deferred release). Upstream decides when to acknowledge from a per-room
chunk count, ``_staging_outstanding``, that several of its paths erase while a write may still run:
a room opened again drops it together with the room's acknowledgement targets and poison
(``update_status``), and a chunk skipped for a Failed or cleared room pops it. An acknowledgement
sent then frees pages a write can still reach; the decode hands them to another request and the
write lands in that request's KV. An acknowledgement dropped instead leaves the decode to its
timeout (then to :mod:`.decode_hold`).

This ledger keeps its own account, which none of those paths touch, and gates ``_send_abort_ack``
on it. A room is *live* while

* a transfer worker holds one of its chunks: from the worker's dequeue until it comes back to its
  queue for the next one (every handle of the chunk is posted and awaited in between), or
* a NIXL handle posted for it has not settled: ``_await_handles`` gave up on it (a sibling handle
  failed and this one kept running past upstream's settle timeout). Such handles are *parked* here
  and polled by the hardened bootstrap thread until each reads DONE or ERR.

An acknowledgement for a live room is withheld. Every target the decode registered for a room is
remembered, so when the room drains the ledger sends what upstream withheld or dropped, the way a
drained room is acknowledged normally; a room upstream poisoned because a post was refused (the
refused write is in no handle, so nothing can prove it over) is never acknowledged here either.
"""

from __future__ import annotations

import logging
import threading

from dsv4_sm120 import metrics

logger = logging.getLogger("dsv4_sm120.nixl")

SETTLED = ("DONE", "ERR")
_ATTR = "_dsv4_write_ledger"
_create_lock = threading.Lock()


class WriteLedger:
    """One prefill ``NixlKVManager``'s rooms with writes that may still land, and the acks they hold back."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}  # room -> chunks in transfer workers' hands
        self.parked: dict[int, list] = {}  # room -> handles that had not settled when the worker moved on
        self.targets: dict[int, dict] = {}  # room -> {(ip, port): AckTarget} registered and not yet acknowledged
        self.unprovable: set[int] = set()  # rooms poisoned for a refused post: never acknowledged
        self._worker = threading.local()  # .room: the room of the chunk this worker thread holds

    # -- transfer workers -------------------------------------------------------------------------
    def taken(self, room: int) -> None:
        """A worker dequeued a chunk of ``room``."""
        with self.lock:
            self.held[room] = self.held.get(room, 0) + 1
        self._worker.room = room

    def back_for_more(self) -> None:
        """The worker came back to its queue: the chunk it held is done with, its handles settled or parked."""
        room = getattr(self._worker, "room", None)
        if room is None:
            return
        self._worker.room = None
        with self.lock:
            left = self.held.get(room, 0) - 1
            if left > 0:
                self.held[room] = left
            else:
                self.held.pop(room, None)
        self.flush(room)

    def park(self, handles) -> None:
        """``_await_handles`` returned with some of ``handles`` still running: keep polling them."""
        room = getattr(self._worker, "room", None)
        if room is None or not handles:
            return
        with self.lock:
            self.parked.setdefault(room, []).extend(handles)
        metrics.inc("nixl_rooms_parked_total")
        logger.warning("dsv4-sm120: room %s has NIXL writes still running after a failed sibling; its abort "
                       "acknowledgement waits until each settles", room)

    def poll_parked(self) -> None:
        """Drop the parked handles that settled; flush the rooms left with none (the bootstrap thread's poll)."""
        if not self.parked:
            return
        with self.lock:
            rooms = {room: list(handles) for room, handles in self.parked.items()}
        for room, handles in rooms.items():
            running = [h for h in handles if not self._settled(h)]
            with self.lock:
                if running:
                    self.parked[room] = running
                else:
                    self.parked.pop(room, None)
            if not running:
                logger.info("dsv4-sm120: room %s's parked NIXL writes settled", room)
                self.flush(room)

    def _settled(self, handle) -> bool:
        try:
            return self.mgr.agent.check_xfer_state(handle) in SETTLED
        except Exception:  # noqa: BLE001 - a state that cannot be read does not prove the write is over
            return False

    # -- acknowledgements -------------------------------------------------------------------------
    def _writing(self, room: int) -> bool:  # with self.lock held
        return room in self.held or room in self.parked

    def _remember(self, room: int, target) -> None:  # with self.lock held
        self.targets.setdefault(room, {})[(target.ip, target.port)] = target

    def live(self, room: int) -> bool:
        with self.lock:
            return self._writing(room)

    def remember(self, room: int, target) -> None:
        with self.lock:
            self._remember(room, target)

    def withhold(self, room: int, target) -> bool:
        """Whether the acknowledgement of ``room`` to ``target`` must wait (it is then remembered)."""
        with self.lock:
            wait = self._writing(room) or room in self.unprovable
            if wait:
                self._remember(room, target)
            else:
                targets = self.targets.get(room)
                if targets is not None:
                    targets.pop((target.ip, target.port), None)
                    if not targets:
                        del self.targets[room]
        if wait:
            metrics.inc("nixl_abort_acks_withheld_total")
        return wait

    def flush(self, room: int) -> None:
        """Acknowledge every remembered target of ``room`` if it drained (through upstream's own sender)."""
        with self.lock:
            if self._writing(room) or room in self.unprovable or room not in self.targets:
                return
            targets = list(self.targets.pop(room).values())
        for target in targets:
            self.mgr._send_abort_ack(room, target)
        metrics.inc("nixl_abort_acks_sent_after_drain_total", len(targets))

    def poisoned(self, room: int) -> None:
        """Upstream poisoned ``room``: provable later only when its running handles are the ones parked here."""
        with self.lock:
            if room not in self.parked:
                self.unprovable.add(room)
                self.targets.pop(room, None)


def ledger_of(mgr) -> WriteLedger | None:
    return getattr(mgr, _ATTR, None)


def ensure(mgr) -> WriteLedger:
    with _create_lock:
        ledger = getattr(mgr, _ATTR, None)
        if ledger is None:
            ledger = WriteLedger(mgr)
            setattr(mgr, _ATTR, ledger)
        return ledger


class LedgerQueue:
    """A transfer worker's queue as the ledger sees it: each dequeue takes a room, the next gives it back."""

    def __init__(self, queue, ledger: WriteLedger):
        self._queue = queue
        self._ledger = ledger

    def get(self):
        self._ledger.back_for_more()
        item = self._queue.get()
        self._ledger.taken(item.room)
        return item

    def __getattr__(self, name):  # put() and anything else go to the real queue
        return getattr(self._queue, name)


# -- hooks (registered by :mod:`.hooks` when DSV4_SM120_NIXL_HARDENING=1) ----------------------------
def await_handles(original, mgr, handles, *args, **kwargs):
    """AROUND ``_await_handles``: handles it gave up waiting for are parked in the ledger."""
    settled, failed = original(mgr, handles, *args, **kwargs)
    ledger = ledger_of(mgr)
    if ledger is not None and not settled:
        ledger.park(list(handles))
    return settled, failed


def send_abort_ack(original, mgr, room, target, *args, **kwargs):
    """AROUND ``_send_abort_ack``: no acknowledgement leaves while the room may still be written."""
    ledger = ledger_of(mgr)
    if ledger is not None and ledger.withhold(room, target):
        return None
    return original(mgr, room, target, *args, **kwargs)


def register_ack_target(result, mgr, room, target, *args, **kwargs):
    """AFTER ``register_deferred_ack_target``: the ledger remembers every target, poisoned rooms' too."""
    ledger = ledger_of(mgr)
    if ledger is not None:
        ledger.remember(room, target)
    return result


def poison_room(result, mgr, room, *args, **kwargs):
    """AFTER ``poison_deferred_ack_room``: a refused post cannot be proven over, parked handles can."""
    ledger = ledger_of(mgr)
    if ledger is not None:
        ledger.poisoned(room)
    return result

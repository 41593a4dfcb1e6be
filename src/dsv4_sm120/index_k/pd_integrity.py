"""Integrity mode on the PD path: bf16 index-K pages checksummed when sent, verified when received.

A bf16 index-K page that reaches the decode with a few wrong bytes (its source
page overwritten while NIXL read it, a transport fault) does not crash
anything: it silently changes the indexer's top-512 selection and the answer
degrades. With ``DSV4_SM120_INDEX_K_CHECKSUM=1`` each side of a NIXL PD pair
does its half, on the pin's own control messages:

* prefill, when a room's chunk is queued (``NixlKVManager.add_transfer_request``):
  queues the checksums of the index-K page rows of the chunk's source pages,
  together with their positions in the decode's destination page list (the
  chunk's ``index_slice``, which is how the transfer worker pairs them). The
  source pages stay unchanged until the transfer concludes, so these are the
  bytes NIXL sends.
* prefill, when the room's ``Success`` status is encoded
  (``_encode_kv_status_message``): reads the sums and appends them as one extra
  frame, after an empty failure-reason frame. Upstream's parser reads the room,
  status, rank and reason frames only, so an unmodified decode pairs as before.
* decode: keeps the frame per room when it parses the status
  (``parse_kv_status_message``; never raises there, it runs on the listener
  thread), remembers each receiver's destination pages (``send_metadata``), and
  when the receiver's poll first answers ``Success`` queues the checksums of the
  received rows at those pages; its polls answer ``Transferring`` until they have
  landed, then compare. A mismatch, or a checksum frame that does not parse, records a
  failure reason naming the room, page, layer and switch, increments
  :data:`~dsv4_sm120.index_k.integrity.COUNTERS` and answers ``Failed``: the
  decode's own failure path aborts the request before it is admitted, and its
  polls are MIN-reduced over TP ranks, so every rank drops it.

A prefill that sends no frame (switch off there, an upstream prefill, or a send
this check cannot pair page for page: DCP relayout, head-sliced or staged
heterogeneous TP) is logged once per peer and its rooms run unchecked. Index-K
buffers are the registered KV buffers whose item is one 16384-byte bf16 page
row, on a manager whose PD layout carries ``index_k:bf16``. The checksum is the
kernels area's ``page_checksum`` (Triton on CUDA, its torch reference on CPU).

Neither side makes its scheduler thread wait for the GPU: on CUDA the sums run on a
side stream of the rows' device and reach pinned host memory behind an event
(:class:`SumsInFlight`); the host reads them only where they are needed (the
prefill's transfer thread, long after the forward; the decode's poll once the
event has completed).
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass

import numpy as np

from dsv4_sm120.index_k import gate, layout, pd_late_write_hold, pd_late_writes
from dsv4_sm120.index_k.pd_rows import DST as _DST
from dsv4_sm120.index_k.pd_rows import SWITCH, behind_current, page_rows, row_sums

NIXL = "sglang.srt.disaggregation.nixl.conn"
ADD_TRANSFER = f"{NIXL}.NixlKVManager.add_transfer_request"
ENCODE_STATUS = f"{NIXL}.NixlKVManager._encode_kv_status_message"
PARSE_STATUS = f"{NIXL}.NixlKVManager.parse_kv_status_message"
SEND_METADATA = f"{NIXL}.NixlKVReceiver.send_metadata"
POLL = f"{NIXL}.NixlKVReceiver.poll"

MAGIC = b"DSV4SM120/index-k-sums/1\0"
_HEADER = struct.Struct("<II")  # index-K buffers, pages
_STATE = "_dsv4_pd_index_k"
_CHECKED = "_dsv4_index_k_checked"
_RECEIVED = "_dsv4_index_k_received_sums"

logger = logging.getLogger("dsv4_sm120.index_k.pd_integrity")


class FrameError(ValueError):
    """A checksum frame that does not parse: the room cannot be verified, so it fails."""


@dataclass(frozen=True)
class PageSums:
    """Checksums of the index-K rows one prefill rank sent for a room."""

    positions: np.ndarray  # int64 [n]: positions in the decode's destination page list
    sums: np.ndarray  # int64 [buffers, n]


def encode_frame(sums: PageSums) -> bytes:
    buffers, pages = sums.sums.shape
    return b"".join((MAGIC, _HEADER.pack(buffers, pages), sums.positions.astype("<i8").tobytes(),
                     sums.sums.astype("<i8").tobytes()))


def parse_frame(frame: bytes) -> PageSums:
    """The sums of one frame; :class:`FrameError` saying what is wrong when it does not parse."""
    if not frame.startswith(MAGIC):
        raise FrameError("not a bf16 index-K checksum frame (wrong magic)")
    body = frame[len(MAGIC):]
    if len(body) < _HEADER.size:
        raise FrameError(f"checksum frame header truncated ({len(body)} of {_HEADER.size} bytes)")
    buffers, pages = _HEADER.unpack_from(body)
    expected = _HEADER.size + 8 * pages * (1 + buffers)
    if len(body) != expected:
        raise FrameError(f"checksum frame announces {buffers} buffers x {pages} pages ({expected} bytes) "
                         f"but carries {len(body)} bytes")
    positions = np.frombuffer(body, dtype="<i8", count=pages, offset=_HEADER.size).astype(np.int64)
    if pages and positions.min() < 0:
        raise FrameError("checksum frame lists a negative destination position")
    sums = np.frombuffer(body, dtype="<i8", offset=_HEADER.size + 8 * pages).astype(np.int64)
    return PageSums(positions, sums.reshape(buffers, pages))


def index_k_buffers(kv_args) -> list[int]:
    """Positions, in the registered KV buffer lists, of the bf16 index-K page-row buffers."""
    if layout.pd_layout_dtype(getattr(kv_args, "kv_layout", None)) != "bf16":
        return []
    return [i for i, n in enumerate(kv_args.kv_item_lens) if n == layout.BF16_PAGE_ROW_BYTES]


@dataclass(frozen=True)
class SumsInFlight:
    """Checksums [buffers, n] of page rows at ``positions``, queued: the host reads them with :meth:`value`."""

    positions: np.ndarray  # int64 [n]
    sums: object  # int64 torch tensor [buffers, n]: pinned host memory a non-blocking copy fills, or a CPU result
    landed: object  # the CUDA event recorded behind that copy; None off CUDA (computed at once)

    def ready(self) -> bool:
        """Whether :meth:`value` returns without waiting for the GPU."""
        return self.landed is None or self.landed.query()

    def value(self) -> np.ndarray:
        """The sums, waiting for their copy if it has not landed: called only where the host may wait."""
        if self.landed is not None:
            self.landed.synchronize()
        return self.sums.numpy()


def _queue_sums(kv_args, buffers: list[int], pages: np.ndarray, positions: np.ndarray,
                wait_event=None) -> SumsInFlight:
    """Queue the checksums of rows ``pages`` of each registered buffer; the host waits for nothing here.

    On CUDA they run on the device's side stream after all the current stream has queued (the forward that
    writes the pages) and after ``wait_event`` (an early send is queued before the prior forward finished
    writing them), and go to pinned host memory behind an event. Off CUDA they are computed at once.
    """
    import torch

    from dsv4_sm120.index_k.integrity import on_device, pinned_copy

    rows = [page_rows(kv_args, i) for i in buffers]
    index = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    device = rows[0].device
    if device.type != "cuda":
        return SumsInFlight(positions, row_sums(rows, index), None)
    with behind_current(device, wait_event):
        return SumsInFlight(positions, *pinned_copy(row_sums(rows, on_device(device, index))))


@dataclass(frozen=True)
class _Received:
    """A room's received rows, per prefill rank (its columns of ``got``), and their sums on their way."""

    ranks: list[tuple[int, slice]]
    pages: np.ndarray  # int64 [n]: destination pages
    expected: np.ndarray  # int64 [buffers, n]: what the prefill ranks sent
    got: SumsInFlight


class PDIndexK:
    """One NIXL manager's integrity state: its index-K buffers and the sums of its live rooms."""

    def __init__(self, manager, enabled: bool):
        self.buffers = index_k_buffers(manager.kv_args) if enabled else []
        self.enabled = bool(self.buffers)
        self.layer_ids = list(getattr(manager.kv_args, "kv_layer_ids", None) or [])
        self.lock = threading.Lock()
        self.sent: dict[int, list[SumsInFlight] | None] = {}  # prefill: room -> chunks' sums (None: unsendable)
        self.received: dict[int, dict[int, PageSums | FrameError]] = {}  # decode: room -> prefill rank -> sums
        self.logged: set[str] = set()
        if self.enabled:
            logger.info("PD index-K integrity on (%s=1): %d bf16 index-K buffers checksummed", SWITCH,
                        len(self.buffers))

    def layer_name(self, ordinal: int) -> str:
        i = self.buffers[ordinal]
        layer = f" (kv layer id {self.layer_ids[i]})" if i < len(self.layer_ids) else ""
        return f"index-K layer {ordinal}{layer}"

    def log_once(self, key: str, message: str, *args) -> None:
        if key not in self.logged:
            self.logged.add(key)
            logger.warning(message, *args)

    # -- prefill ------------------------------------------------------------------------------------
    def record_send(self, manager, room: int, kv_indices, index_slice: slice, wait_event) -> None:
        from dsv4_sm120.index_k.integrity import count

        with self.lock:
            for stale in [r for r in self.sent if r not in manager.request_status]:
                del self.sent[stale]
            if room in self.sent and self.sent[room] is None:
                return
        why = _not_page_for_page(manager, room)
        if why:
            self.log_once(why, "PD index-K integrity: rooms sent %s are not checksummed (the decode logs "
                          "them as unchecked)", why)
            with self.lock:
                self.sent[room] = None
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        start, step = index_slice.start or 0, index_slice.step or 1
        positions = start + step * np.arange(len(pages), dtype=np.int64)
        sums = _queue_sums(manager.kv_args, self.buffers, pages, positions, wait_event)
        with self.lock:
            chunks = self.sent.setdefault(room, [])
            if chunks is not None:
                chunks.append(sums)
        count("pd_pages_recorded", len(pages) * len(self.buffers))

    def frame_for(self, room: int) -> bytes | None:
        """The room's frame, read in the transfer thread after NIXL sent its pages: the sums have landed by then."""
        with self.lock:
            chunks = list(self.sent.get(room) or ())
        if not chunks:
            return None
        return encode_frame(PageSums(np.concatenate([c.positions for c in chunks]),
                                     np.concatenate([c.value() for c in chunks], axis=1)))

    # -- decode -------------------------------------------------------------------------------------
    def note_received(self, manager, room: int, prefill_rank: int, found: PageSums | FrameError) -> None:
        with self.lock:
            for stale in [r for r in self.received if r not in manager.request_status]:
                del self.received[stale]
            if room in manager.request_status:
                self.received.setdefault(room, {})[prefill_rank] = found

    def verify(self, receiver):
        """The poll answer for a room that turned Success: Transferring while its received rows' sums are on
        their way to the host, then Success, or Failed with the reason recorded."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        received = getattr(receiver, _RECEIVED, None)
        if received is None:
            received = self._queue_received(receiver)
            if not isinstance(received, _Received):
                return received
            setattr(receiver, _RECEIVED, received)
        if not received.got.ready():
            return KVPoll.Transferring
        return self._compare(receiver, received)

    def _queue_received(self, receiver):
        """Queue the sums of the rows the room received; the answer at once when there is nothing to compare."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        from dsv4_sm120.index_k.integrity import count

        room, peer = receiver.bootstrap_room, receiver.bootstrap_addr
        with self.lock:
            frames = self.received.pop(room, None)
        dst = getattr(receiver, _DST, None)
        if not frames:
            count("pd_rooms_unchecked", 1)
            self.log_once(f"peer:{peer}", "PD index-K integrity not checked for prefill %s: it sends no "
                          "checksum frame (%s is off there, it is an upstream prefill, or it cannot pair "
                          "the pages it sends page for page)", peer, SWITCH)
            return KVPoll.Success
        errors = [f"prefill rank {rank}: {found}" for rank, found in sorted(frames.items())
                  if isinstance(found, FrameError)]
        if errors:
            return self._fail(receiver, f"its bf16 index-K checksum frame is malformed ({'; '.join(errors)}), "
                              f"so the pages it received cannot be verified")
        if dst is None:
            count("pd_rooms_unchecked", 1)
            self.log_once("no-dst", "PD index-K integrity: room %s polled Success before its destination "
                          "pages were known; not checked", room)
            return KVPoll.Success
        for found in frames.values():
            if found.sums.shape[0] != len(self.buffers):
                count("pd_rooms_unchecked", 1)
                self.log_once(f"buffers:{peer}", "PD index-K integrity not checked for prefill %s: it sums %d "
                              "index-K buffers, this decode registers %d (a PP stage or a layer-count "
                              "mismatch)", peer, found.sums.shape[0], len(self.buffers))
                return KVPoll.Success
        ranks, positions, expected, start = [], [], [], 0
        for rank, found in sorted(frames.items()):
            keep = found.positions < len(dst)  # what the transfer worker truncates is not sent either
            positions.append(found.positions[keep])
            expected.append(found.sums[:, keep])
            ranks.append((rank, slice(start, start + int(keep.sum()))))
            start = ranks[-1][1].stop
        positions = np.concatenate(positions)
        pages = dst[positions]
        got = _queue_sums(receiver.kv_mgr.kv_args, self.buffers, pages, positions)
        return _Received(ranks, pages, np.concatenate(expected, axis=1), got)

    def _compare(self, receiver, received: _Received):
        """Success, or Failed naming every received row whose sum differs from what its prefill rank sent."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        from dsv4_sm120.index_k.integrity import count

        room, peer = receiver.bootstrap_room, receiver.bootstrap_addr
        got, positions = received.got.value(), received.got.positions
        bad = []
        for rank, cols in received.ranks:
            for ordinal in range(len(self.buffers)):
                for j in np.nonzero(got[ordinal, cols] != received.expected[ordinal, cols])[0] + cols.start:
                    bad.append((rank, ordinal, int(positions[j]), int(received.pages[j])))
            count("pd_pages_checked", (cols.stop - cols.start) * len(self.buffers))
        if not bad:
            return KVPoll.Success
        count("pd_mismatches", len(bad))
        for rank, ordinal, position, page in bad:
            logger.error("PD index-K checksum mismatch: room=%s prefill=%s rank=%d %s destination page=%d "
                         "(position %d of the room's page list)", room, peer, rank, self.layer_name(ordinal),
                         page, position)
        where = ", ".join(f"page {page} {self.layer_name(ordinal)}" for _, ordinal, _, page in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        return self._fail(receiver, f"bf16 index-K checksum mismatch on {where}{more}: the rows received "
                          f"differ from what the prefill sent")

    def _fail(self, receiver, what: str):
        from sglang.srt.disaggregation.base.conn import KVPoll

        from dsv4_sm120.index_k.integrity import count

        room = receiver.bootstrap_room
        reason = (f"Room {room} from prefill {receiver.bootstrap_addr} failed: {what}. Caught by {SWITCH}=1; "
                  f"the request was not admitted. Retry it.")
        logger.error("%s", reason)
        count("pd_rooms_failed", 1)
        receiver.kv_mgr.record_failure(room, reason)
        receiver.kv_mgr.update_status(room, KVPoll.Failed)
        receiver.conclude_state = KVPoll.Failed
        return KVPoll.Failed


def _not_page_for_page(manager, room: int) -> str | None:
    """Why this room's destinations do not receive whole page rows at the listed positions, if so."""
    for info in list(manager.transfer_infos.get(room, {}).values()):
        if info.is_dummy:
            continue
        dst = manager.decode_kv_args_table.get(info.agent_name)
        if dst is None:
            return "to a decode this prefill has not registered"
        if getattr(dst, "requires_dcp_relayout", False):
            return "with DCP relayout"
        mla = manager.is_mla_backend or getattr(manager, "is_hybrid_mla_backend", False)
        if not mla and dst.decode_tp_size != manager.attn_tp_size:
            return "head-sliced to a decode of another TP width"
    return None


_lock = threading.Lock()


def configure(manager, enabled: bool) -> PDIndexK:
    """Set whether this manager checks index-K pages (otherwise the registered switch decides, once)."""
    state = PDIndexK(manager, enabled)
    setattr(manager, _STATE, state)
    return state


def state_of(manager) -> PDIndexK:
    state = getattr(manager, _STATE, None)
    if state is None:
        with _lock:
            state = getattr(manager, _STATE, None) or configure(manager, gate.switches().index_k_checksum)
    return state


# -- hooks ------------------------------------------------------------------------------------------
def add_transfer_request(original, manager, bootstrap_room, kv_indices, index_slice, *args, **kwargs):
    """AROUND hook (prefill): checksum the chunk's index-K source rows before it is queued."""
    state = state_of(manager)
    if state.enabled and bootstrap_room in manager.transfer_infos and len(kv_indices):
        try:
            state.record_send(manager, bootstrap_room, kv_indices, index_slice, kwargs.get("wait_event"))
        except Exception:
            logger.exception("PD index-K integrity: checksumming room %s failed; it is sent unchecked",
                             bootstrap_room)
            with state.lock:
                state.sent[bootstrap_room] = None
    return original(manager, bootstrap_room, kv_indices, index_slice, *args, **kwargs)


def encode_kv_status_message(original, manager, **kwargs):
    """AROUND hook (prefill): a room's Success status carries its index-K sums as one extra frame."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    parts = original(manager, **kwargs)
    state = getattr(manager, _STATE, None)
    if state is None or not state.enabled or kwargs.get("status") != KVPoll.Success:
        return parts
    frame = state.frame_for(kwargs.get("bootstrap_room"))
    if frame is None:
        return parts
    reason = [] if manager.kv_status_msg_carries_reason else [b""]  # upstream reads that slot as the reason
    return [*parts, *reason, frame]


def parse_kv_status_message(original, manager, msg):
    """AROUND hook (decode): keep a Success message's checksum frame for its room; never raises."""
    parsed = original(manager, msg)
    if parsed is None:
        return parsed
    try:
        from sglang.srt.disaggregation.base.conn import KVPoll

        state = state_of(manager)
        room, status, prefill_rank, _ = parsed
        if state.enabled and status == KVPoll.Success:
            frames = [f for f in msg[4:] if isinstance(f, (bytes, bytearray)) and f.startswith(MAGIC)]
            if frames:
                try:
                    found = parse_frame(bytes(frames[-1]))
                except FrameError as exc:
                    found = exc
                state.note_received(manager, room, prefill_rank, found)
    except Exception:
        logger.exception("PD index-K integrity: a status message's checksum frame could not be kept")
    return parsed


def send_metadata(original, receiver, kv_indices, *args, **kwargs):
    """AROUND hook (decode): remember the destination pages, in the order the prefill addresses them."""
    if state_of(receiver.kv_mgr).enabled:
        setattr(receiver, _DST, np.array(kv_indices, dtype=np.int64))
    return original(receiver, kv_indices, *args, **kwargs)


def poll(original, receiver):
    """AROUND hook (decode): a Success is verified, answered Transferring until the received rows' sums have
    landed; a mismatch answers Failed instead."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    status = original(receiver)
    if status != KVPoll.Success or getattr(receiver, _CHECKED, False):
        return status
    state = state_of(receiver.kv_mgr)
    if not state.enabled:
        return status
    try:
        verdict = state.verify(receiver)
    except Exception as exc:
        setattr(receiver, _CHECKED, True)
        logger.exception("PD index-K integrity: verifying room %s raised", receiver.bootstrap_room)
        return state._fail(receiver, f"its bf16 index-K pages could not be verified ({exc!r})")
    setattr(receiver, _CHECKED, verdict != KVPoll.Transferring)
    if verdict == KVPoll.Success:
        try:
            pd_late_writes.record(receiver, state)
        except Exception:
            logger.exception("PD late-write check: the baseline of room %s could not be taken; it is not watched",
                             receiver.bootstrap_room)
    return verdict


HOOKS = (
    (ADD_TRANSFER, add_transfer_request),
    (ENCODE_STATUS, encode_kv_status_message),
    (PARSE_STATUS, parse_kv_status_message),
    (SEND_METADATA, send_metadata),
    (POLL, poll),
    (pd_late_writes.RUN_BATCH, pd_late_writes.run_batch),
    (pd_late_write_hold.RELEASE_KV, pd_late_write_hold.hand_over),
    (pd_late_write_hold.DO_RELEASE, pd_late_write_hold.release_held),
)


def register_hooks() -> None:
    """Register the PD hooks, the decode's late-write re-reads and hold among them (the index_k area does so only
    when the switch is on)."""
    from dsv4_sm120 import metrics
    from dsv4_sm120.hooks import hook

    for target, fn in HOOKS:
        hook(target, fn)
    metrics.add_sampler(pd_late_write_hold.sample_gauges)

"""The hardened NIXL prefill bootstrap thread.

Upstream's ``NixlKVManager._start_bootstrap_thread`` (sglang 0.5.23) runs a loop,
defined as a closure, that dies on the first frame it cannot parse (an unknown
tag trips an ``assert``; a short frame, bad ascii, a bad int, a bad registration
payload or an error while adding the peer raise) and is never restarted. After
that, every new request on that rank waits in ``KVPoll.Bootstrapping`` for the
300 s bootstrap timeout, on every TP rank, and ``/health`` stays green.

The closure cannot be hooked, so an AROUND hook on ``_start_bootstrap_thread``
starts this loop instead, over the same socket, with the same per-frame
semantics written here, and calling the same upstream methods (``_add_remote_peer``,
``_handle_abort_notification``, ``update_status``, the ``from_zmq`` parsers).
What it adds:

* every frame is handled inside its own try: a bad frame is refused
  (:class:`~dsv4_sm120.nixl.rejects.RejectLog`), the thread keeps serving;
* a peer whose registration fails half way is rolled back, so it can register again;
* a transfer-info frame from an agent that never registered is refused;
* every ABORT buries its room (:class:`~dsv4_sm120.nixl.tombstones.Tombstones`),
  and a transfer-info frame for a buried room is dropped instead of creating it
  (answered with the failure when the prefill itself failed the room: :mod:`tell_decode`);
* the loop polls with a timeout and beats a heart, so
  :mod:`dsv4_sm120.nixl.liveness` can tell a dead or stuck thread.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from dsv4_sm120 import metrics
from dsv4_sm120.nixl import tell_decode, write_ledger
from dsv4_sm120.nixl.rejects import FrameRejected, RejectLog
from dsv4_sm120.nixl.tombstones import Tombstones

logger = logging.getLogger("dsv4_sm120.nixl")

POLL_MS = 200
SWEEP_EVERY_S = 5.0
_MIN_PARTS = 4  # room, endpoint, port, agent name after the guard frame


def _waiting_timeout_s() -> float:
    """The decode's waiting timeout, from the same variable both sides read (upstream's default 300 s)."""
    from sglang.srt.environ import envs

    return float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())


def _ascii(part: bytes, what: str) -> str:
    try:
        return part.decode("ascii")
    except UnicodeDecodeError:
        raise FrameRejected("bad encoding", f"{what} is not ascii: {part[:32]!r}") from None


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise FrameRejected("bad integer", f"{what} is not an integer: {text[:32]!r}") from None


def describe_peer(frames: list) -> str:
    """Best-effort name of the sender of ``frames``: agent name and endpoint when the frame carries them."""
    try:
        if len(frames) >= 5 and isinstance(frames[0], bytes) and frames[0].startswith(b"Nixl"):
            host = frames[2].decode("ascii", "replace")[:64]
            port = frames[3].decode("ascii", "replace")[:8]
            agent = frames[4].decode("ascii", "replace")[:64]
            return f"decode agent {agent!r} at {host}:{port}"
        if len(frames) >= 4 and frames[0] == b"ABORT":
            return f"decode at {frames[2].decode('ascii', 'replace')[:64]}:{frames[3].decode('ascii', 'replace')[:8]}"
    except Exception:  # noqa: BLE001 - naming the peer must never fail
        pass
    return "an unidentified peer"


class HardenedBootstrap:
    """Serves one prefill ``NixlKVManager``'s bootstrap socket; one instance per manager."""

    def __init__(self, mgr, rejects: RejectLog | None = None, tombstones: Tombstones | None = None):
        self.mgr = mgr
        self.rejects = rejects or RejectLog()
        self.tombstones = tombstones or Tombstones()
        self.last_beat = time.monotonic()
        self.busy_since: float | None = None
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.exit_reason: str | None = None
        # Room -> the prefill's live sender for it (set by the sender hook). A room no sender
        # holds has nobody to clear it from the manager's tables: see ``_abort``.
        self.senders: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        # Room -> when a sweep first found it in the tables with no sender holding it.
        self.unheld_since: dict[int, float] = {}
        # A room the decode announced but no prefill request claimed is given up once both sides' timeouts
        # are over: by then the decode has failed the request (and a live one has sent its ABORT).
        self.unclaimed_after_s = float(mgr.bootstrap_timeout) + _waiting_timeout_s()
        # How often the loop sweeps, on the real clock (a test that drives the sweeps with its own clock sets inf).
        self.sweep_every_s = SWEEP_EVERY_S

    # -- thread -----------------------------------------------------------------------------
    def start(self) -> threading.Thread:
        rank = getattr(self.mgr.kv_args, "engine_rank", "?")
        self.thread = threading.Thread(target=self._run, name=f"dsv4-nixl-bootstrap-rank{rank}", daemon=True)
        self.thread.start()
        return self.thread

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the loop to return (tests and the harness; a server never stops it)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self) -> None:
        import zmq

        sock = self.mgr.server_socket
        last_sweep = time.monotonic()
        try:
            while not self.stopping.is_set():
                self.last_beat = time.monotonic()
                if self.last_beat - last_sweep > self.sweep_every_s:
                    last_sweep = self.last_beat
                    self.sweep_unheld_rooms()
                ledger = write_ledger.ledger_of(self.mgr)
                if ledger is not None:
                    ledger.poll_parked()
                if not sock.poll(POLL_MS, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                self.busy_since = time.monotonic()
                try:
                    self.serve(frames)
                finally:
                    self.busy_since = None
        except BaseException as exc:  # the thread is ending: say why, liveness reports it
            self.exit_reason = f"{type(exc).__name__}: {exc}"
            logger.exception(
                "dsv4-sm120: NIXL prefill bootstrap thread on engine_rank=%s stopped; health now fails",
                getattr(self.mgr.kv_args, "engine_rank", "?"),
            )
            raise
        self.exit_reason = "stopped"

    # -- one frame ----------------------------------------------------------------------------
    def serve(self, frames: list) -> None:
        """Handle one multipart frame; never raises for a bad frame."""
        try:
            self._dispatch(frames)
            self.rejects.count("frames_served")
        except FrameRejected as exc:
            self.rejects.reject(describe_peer(frames), exc)
        except Exception as exc:  # an upstream handler failed on this frame
            self.rejects.reject(describe_peer(frames), FrameRejected("handler error", f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, frames: list) -> None:
        from sglang.srt.disaggregation.common.conn import ABORT_TAG
        from sglang.srt.disaggregation.common.staging_handler import handle_staging_rsp, handle_watermark_msg
        from sglang.srt.disaggregation.nixl.conn import GUARD

        if not frames:
            raise FrameRejected("too few parts", "empty multipart message")
        tag = frames[0]
        if tag == b"WATERMARK":
            if self.mgr.enable_staging:
                handle_watermark_msg(self.mgr._staging_ctx, frames)
            return
        if tag == b"STAGING_RSP":
            if self.mgr.enable_staging:
                handle_staging_rsp(frames, self.mgr.transfer_infos)
            return
        if tag == ABORT_TAG:
            self._abort(frames)
            return
        if tag != GUARD:
            raise FrameRejected("unknown tag", f"first part {tag[:32]!r} is none of {GUARD!r}, ABORT, WATERMARK, STAGING_RSP")
        body = frames[1:]
        if len(body) < _MIN_PARTS:
            raise FrameRejected("too few parts", f"{len(body)} parts after the guard, need at least {_MIN_PARTS}")
        room_text = _ascii(body[0], "room")
        agent = _ascii(body[3], "agent name")
        if room_text == "None":
            self._register(body, agent)
        else:
            self._transfer_info(_int(room_text, "room"), agent, body)

    def _abort(self, frames: list) -> None:
        from sglang.srt.disaggregation.common.conn import AbortNotification

        # Checked here first: upstream's parser logs every malformed ABORT unthrottled.
        if len(frames) < 2:
            raise FrameRejected("bad abort", "ABORT without a room")
        _int(_ascii(frames[1], "ABORT room"), "ABORT room")
        if len(frames) >= 4:
            _ascii(frames[2], "ABORT return host")
            _int(_ascii(frames[3], "ABORT return port"), "ABORT return port")
        if len(frames) >= 5:
            _int(_ascii(frames[4], "ABORT generation"), "ABORT generation")
        notification = AbortNotification.from_zmq(frames)
        if notification is None:
            raise FrameRejected("bad abort", f"ABORT with {len(frames)} parts carries no integer room")
        # Bury first: a transfer-info frame racing this ABORT must find the tombstone.
        self.tombstones.bury(notification.room)
        self.mgr._handle_abort_notification(frames)
        self.rejects.count("aborts_handled")
        self._forget_if_unheld(notification.room)

    def sweep_unheld_rooms(self, now: float | None = None) -> None:
        """Release the rooms of the manager's tables that no prefill sender holds and nothing else will clear.

        Upstream clears a room only through its sender. A room is left behind when (seen on a PD pair on a Hopper GPU:
        two rooms for good after its decode was killed mid-storm):

        * the decode aborted it: tombstoned, released as soon as no sender holds it (``_forget_if_unheld``);
        * upstream aborted its request on the prefill (waiting queue, or a retired forward) with
          ``sender.abort()`` and dropped the request without ``clear()``: the room stays Failed. The decode's
          ABORT normally rescues it; a killed decode sends none. Released once two sweeps found it unheld;
        * the decode announced it (transfer info) but no prefill request ever claimed it, e.g. a retracted
          request's rebootstrap cut off by the decode's death: released after ``unclaimed_after_s``.

        A released room is tombstoned, so a request that shows up for it late opens Failed at once.
        """
        from sglang.srt.disaggregation.base.conn import KVPoll

        now = time.monotonic() if now is None else now
        mgr = self.mgr
        rooms = set(mgr.request_status) | set(mgr.transfer_infos)
        for gone in set(self.unheld_since) - rooms:
            self.unheld_since.pop(gone, None)
        for room in rooms:
            if room in self.tombstones:
                self._forget_if_unheld(room)
            elif room in self.senders or self._writing(room):
                self.unheld_since.pop(room, None)
            else:
                since = self.unheld_since.setdefault(room, now)
                failed = mgr.request_status.get(room) == KVPoll.Failed
                if now - since >= (SWEEP_EVERY_S if failed else self.unclaimed_after_s):
                    self._release_orphan(room, "failed" if failed else "unclaimed")

    def _writing(self, room: int) -> bool:
        """Whether a write of ``room`` may still be queued or in flight: upstream's chunk count, or the ledger's."""
        if getattr(self.mgr, "_staging_outstanding", {}).get(room, 0) > 0:
            return True
        ledger = write_ledger.ledger_of(self.mgr)
        return ledger is not None and ledger.live(room)

    def _release_orphan(self, room: int, reason: str) -> None:
        mgr = self.mgr
        # A request that shows up for the room later fails with the room's own failure, when it had one.
        failure = mgr.failure_records.get(room) or f"the prefill released this room ({reason}): no prefill request held it"
        self.tombstones.bury(room, reason=str(failure))
        self.unheld_since.pop(room, None)
        self._drop(room)
        metrics.inc("nixl_orphan_rooms_released_total", reason=reason)
        logger.info("dsv4-sm120: released NIXL room %s (%s): no prefill request held it", room, reason)

    def _forget_if_unheld(self, room: int) -> None:
        """Drop an aborted room from the manager's tables when no prefill sender holds it.

        Upstream marks an aborted room Failed and leaves the clearing to the room's
        sender. When the decode's transfer info arrived but the prefill request never
        reached (or already left) the scheduler, there is no sender: the room sat in
        ``request_status`` and ``transfer_infos`` for good (seen on a real PD pair: 30
        rooms after three 80-session storms). The tombstone keeps the room dead: a
        sender opened for it later starts Failed. A room with a write still queued or
        in flight is left to a later sweep: its tables are what the transfer worker
        and the abort acknowledgement read.
        """
        if room in self.senders or self._writing(room):
            return
        if self._drop(room):
            metrics.inc("nixl_aborted_rooms_released_total")

    def _drop(self, room: int) -> bool:
        """Remove ``room`` from every table of the manager that keys on it; whether it held a room or its info."""
        mgr = self.mgr
        held = room in mgr.request_status or room in mgr.transfer_infos
        for table in (mgr.request_status, mgr.transfer_infos, mgr.req_to_decode_prefix_len, mgr.failure_records):
            table.pop(room, None)
        return held

    def _register(self, body: list, agent: str) -> None:
        from sglang.srt.disaggregation.nixl.conn import KVArgsRegisterInfo

        try:
            info = KVArgsRegisterInfo.from_zmq(body)
        except Exception as exc:
            raise FrameRejected("bad registration payload", f"{type(exc).__name__}: {exc}") from None
        known = agent in self.mgr.decode_kv_args_table
        try:
            self.mgr._add_remote_peer(info)
        except Exception as exc:
            if not known:
                self._roll_back_peer(agent)
            raise FrameRejected("peer registration failed", f"{type(exc).__name__}: {exc}; peer rolled back") from None

    def _roll_back_peer(self, agent: str) -> None:
        """Undo what ``_add_remote_peer`` did before it failed, so the peer can register again."""
        mgr = self.mgr
        mgr.decode_kv_args_table.pop(agent, None)
        for table in ("prep_handles", "prep_handles_slice_dst", "_prepared_state_plans", "_state_layout_rejections"):
            getattr(mgr, table, {}).pop(agent, None)
        try:
            if mgr.agent.check_remote_metadata(agent):
                mgr.agent.remove_remote_agent(agent)
        except Exception:  # noqa: BLE001 - nothing was loaded for this agent
            pass

    def _fail_room(self, room: int, why: FrameRejected) -> FrameRejected:
        """Fail ``room`` now with ``why`` instead of leaving it to the bootstrap timeout; return ``why``.

        Its transfer info was refused, so this prefill can never send its KV: the
        request fails at once, with the reason, on the prefill (and so at the
        router and the client). A room the prefill has not opened yet is buried with
        the reason; when the request arrives, it opens Failed (``keep_aborted_rooms_dead``).
        Decode ranks whose transfer infos for the room did arrive are told (:mod:`tell_decode`).
        """
        reason = (f"dsv4-sm120: the NIXL prefill bootstrap thread refused this request's transfer info "
                  f"({why.reason}: {why.detail}); the request cannot be served and was failed at once")
        metrics.inc("nixl_rooms_failed_fast_total", reason=why.reason)
        tell_decode.room_failed(self.mgr, room, reason, self.tombstones)
        self.mgr.transfer_infos.pop(room, None)
        return why

    def _transfer_info(self, room: int, agent: str, body: list) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.nixl.conn import TransferInfo

        mgr = self.mgr
        if room in self.tombstones:
            self.rejects.count("late_frames_dropped")
            logger.debug("dsv4-sm120: dropped transfer info for aborted room %s from %s", room, agent)
            failed = self.tombstones.reason(room)
            if failed is not None and agent in mgr.decode_kv_args_table:  # failed here: that decode must know
                try:
                    info = TransferInfo.from_zmq(body)
                except Exception:  # noqa: BLE001 - an unparsable late frame is only dropped
                    return
                tell_decode.answer_late_transfer_info(mgr, room, info, failed)
            return
        if agent not in mgr.decode_kv_args_table:
            # A decode registers on the same ordered socket before it sends any metadata.
            raise self._fail_room(room, FrameRejected(
                "unregistered peer", f"transfer info for room {room} from decode agent {agent!r}, which never registered"))
        try:
            info = TransferInfo.from_zmq(body)
        except Exception as exc:
            raise self._fail_room(room, FrameRejected(
                "bad transfer info", f"room {room}: {type(exc).__name__}: {exc}")) from None
        if info.required_dst_info_num < 1:
            raise self._fail_room(room, FrameRejected(
                "bad transfer info", f"room {room}: required_dst_info_num={info.required_dst_info_num}"))
        room_infos = mgr.transfer_infos.setdefault(room, {})
        room_infos[agent] = info
        if len(room_infos) != info.required_dst_info_num:
            return
        try:
            mgr.resolve_kv_replica_factor(room_infos)
            mgr.req_to_decode_prefix_len[room] = next(
                (i.decode_prefix_len for i in room_infos.values() if i.decode_prefix_len is not None), 0
            )
            mgr.update_status(room, KVPoll.WaitingForInput)
        except Exception as exc:
            mgr.record_failure(room, f"dsv4-sm120: bootstrap of room {room} failed: {exc}")
            if room in mgr.request_status:
                mgr.update_status(room, KVPoll.Failed)
            else:  # nobody would ever clear it
                mgr.transfer_infos.pop(room, None)
            raise FrameRejected("bootstrap failed", f"room {room}: {type(exc).__name__}: {exc}; room marked Failed") from None

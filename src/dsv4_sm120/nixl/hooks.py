"""Hooks of the NIXL bootstrap hardening (switch: ``DSV4_SM120_NIXL_HARDENING``, default 1).

Registered only when the switch is 1, and each body checks the switch again when
upstream calls it, so a process (a test, ``dsv4-sm120 abort-storm --baseline``)
can build a pin-behaviour manager next to a hardened one. Nothing here imports
sglang until upstream calls a hook.

* ``NixlKVManager._start_bootstrap_thread`` (AROUND): start
  :class:`~dsv4_sm120.nixl.bootstrap.HardenedBootstrap` instead of the closure.
* ``NixlKVManager.transfer_worker`` (AROUND): hand the worker a
  :class:`~dsv4_sm120.nixl.liveness.ProgressQueue` so a stuck worker is seen
  (observation only: it changes nothing a worker does).
* ``NixlKVManager._await_handles``, ``_send_abort_ack`` (AROUND), ``register_deferred_ack_target``,
  ``poison_deferred_ack_room`` (AFTER): an abort is acknowledged only once no write of the room can still
  land (:mod:`dsv4_sm120.nixl.write_ledger`).
* ``DecodeTransferQueue.resolve_deferred_releases`` (AROUND), ``CommonKVManager._handle_node_failure``
  (AFTER): a decode keeps an aborted room's pages quarantined past the release timeout until the prefill
  acknowledges or is lost (:mod:`dsv4_sm120.nixl.decode_hold`).
* ``NixlKVManager.update_status`` (AROUND): a sender opened for a room the decode
  already aborted starts Failed instead of waiting 300 s in Bootstrapping.
* ``NixlKVSender.__init__`` (AFTER): the hardened thread knows which rooms a live
  sender holds, so an aborted room nobody holds is dropped instead of leaking.
* ``Scheduler.handle_generate_request`` and ``Scheduler.maybe_send_health_check_signal``
  (AROUND): while :func:`~dsv4_sm120.nixl.liveness.problems` is non-empty,
  health-check requests get no answer, so ``/health`` fails.
"""

from __future__ import annotations

import logging
import time

from dsv4_sm120 import metrics
from dsv4_sm120.nixl import decode_hold, write_ledger
from dsv4_sm120.hooks import hook
from dsv4_sm120.settings import Settings, load

logger = logging.getLogger("dsv4_sm120.nixl")

NIXL_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
NIXL_SENDER_INIT = "sglang.srt.disaggregation.nixl.conn.NixlKVSender.__init__"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_HEALTH_LOG_EVERY_S = 10.0
_last_health_log = [0.0]


def hardening_on() -> bool:
    """The switch as the environment sets it now: read at each call, not kept from ``register``, because one
    process may run both (``dsv4-sm120 abort-storm`` builds the pin's thread and the hardened one in turn)."""
    return load().nixl_hardening


def start_bootstrap_thread(original, mgr):
    """AROUND ``_start_bootstrap_thread``: serve the socket with the hardened loop."""
    if not hardening_on():
        return original(mgr)
    from dsv4_sm120.nixl import liveness
    from dsv4_sm120.nixl.bootstrap import HardenedBootstrap

    boot = HardenedBootstrap(mgr)
    mgr._dsv4_bootstrap = boot
    liveness.watch_for(mgr).bootstrap = boot
    boot.start()
    logger.info("dsv4-sm120: NIXL prefill bootstrap thread hardened on engine_rank=%s", mgr.kv_args.engine_rank)
    return None


def watch_transfer_worker(original, mgr, queue, staging_buffer=None, worker_index=0):
    """AROUND ``transfer_worker``: let liveness and the write ledger see each dequeue of this worker.

    The workers start before the bootstrap thread, so whether the manager is
    hardened is not known yet; watching is pure observation, and liveness only
    judges managers whose bootstrap thread is the hardened one. The ledger
    (:mod:`.write_ledger`) follows the switch as the manager is built.
    """
    from dsv4_sm120.nixl import liveness

    progress = liveness.ProgressQueue(queue)
    liveness.watch_for(mgr).add_worker(worker_index, progress)
    if hardening_on():  # a pin-behaviour manager built beside a hardened one keeps upstream's acknowledgements
        progress = write_ledger.LedgerQueue(progress, write_ledger.ensure(mgr))
    return original(mgr, progress, staging_buffer, worker_index)


def keep_aborted_rooms_dead(original, mgr, bootstrap_room, status):
    """AROUND ``update_status``: opening a room the decode already aborted opens it as Failed."""
    boot = getattr(mgr, "_dsv4_bootstrap", None)
    if boot is None or bootstrap_room in mgr.request_status or bootstrap_room not in boot.tombstones:
        return original(mgr, bootstrap_room, status)
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
        return original(mgr, bootstrap_room, status)
    mgr.record_failure(bootstrap_room, boot.tombstones.reason(bootstrap_room)
                       or "Aborted by decode-side abort notification before the prefill opened the room.")
    original(mgr, bootstrap_room, status)
    return original(mgr, bootstrap_room, KVPoll.Failed)


def track_sender(result, sender, *args, **kwargs):
    """AFTER ``NixlKVSender.__init__``: the hardened thread learns which rooms a live sender holds."""
    boot = getattr(sender.kv_mgr, "_dsv4_bootstrap", None)
    if boot is not None:
        boot.senders[sender.bootstrap_room] = sender
    return result


def _unhealthy() -> list[str]:
    if not hardening_on():
        return []
    from dsv4_sm120.nixl import liveness

    found = liveness.problems()
    now = time.monotonic()
    if found and now - _last_health_log[0] > _HEALTH_LOG_EVERY_S:
        _last_health_log[0] = now
        logger.error("dsv4-sm120: health check fails: %s", "; ".join(found))
    return found


def gate_health_request(original, scheduler, recv_req, *args, **kwargs):
    """AROUND ``Scheduler.handle_generate_request``: leave a health check unanswered while NIXL is broken."""
    from sglang.srt.managers.utils import is_health_check_generate_req

    if is_health_check_generate_req(recv_req) and _unhealthy():
        return None
    return original(scheduler, recv_req, *args, **kwargs)


def gate_health_signal(original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler.maybe_send_health_check_signal``: a busy scheduler must not vouch for a broken NIXL side."""
    if scheduler.return_health_check_ipcs and _unhealthy():
        scheduler.return_health_check_ipcs.clear()
        return None
    return original(scheduler, *args, **kwargs)


def register(cfg: Settings) -> None:
    """Register this area's hooks when ``DSV4_SM120_NIXL_HARDENING=1``."""
    if not cfg.nixl_hardening:
        return
    hook(f"{NIXL_MANAGER}._start_bootstrap_thread", start_bootstrap_thread)
    hook(f"{NIXL_MANAGER}.transfer_worker", watch_transfer_worker)
    hook(f"{NIXL_MANAGER}.update_status", keep_aborted_rooms_dead)
    hook(f"{NIXL_MANAGER}._await_handles", write_ledger.await_handles)
    hook(f"{NIXL_MANAGER}._send_abort_ack", write_ledger.send_abort_ack)
    hook(f"{NIXL_MANAGER}.register_deferred_ack_target", write_ledger.register_ack_target)
    hook(f"{NIXL_MANAGER}.poison_deferred_ack_room", write_ledger.poison_room)
    hook(decode_hold.RESOLVE, decode_hold.hold_until_drained)
    hook(decode_hold.NODE_FAILURE, decode_hold.prefill_lost)
    metrics.add_sampler(decode_hold.sample_gauges)
    hook(NIXL_SENDER_INIT, track_sender)
    hook(f"{SCHEDULER}.handle_generate_request", gate_health_request)
    hook(f"{SCHEDULER}.maybe_send_health_check_signal", gate_health_signal)

"""When the prefill fails a room on its own, tell the room's decode at once.

Why: the PD router hands the prefill its copy of a request without waiting for
the answer and answers the client from the decode. Upstream's prefill-side
failure paths (``NixlKVSender.abort``, ``handle_bootstrap_failure``) mark the
room Failed in the prefill's own table only; nothing reaches the decode, which
keeps the request waiting for KV until ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``
(300 s by default). On a real TP=2 PD pair (tests/e2e) the collective guard
aborted a request on the prefill with a clear "safe to retry" message, and the
client still had no answer after 90 s. Client aborts do not need this: the
router aborts the decode's copy itself.

A room this package fails on the prefill (the guard's reconcile, a refused
transfer info) is therefore concluded Failed with upstream's own status message
(``conclude_failure``) to every decode endpoint the room's transfer infos name;
the decode then fails the request with the reason. When no transfer info has
arrived yet, the hardened bootstrap thread keeps the room buried with its reason
and answers the transfer info that arrives for it with the same failure
(:meth:`dsv4_sm120.nixl.bootstrap.HardenedBootstrap._transfer_info`).
"""

from __future__ import annotations

import logging

from dsv4_sm120 import metrics

logger = logging.getLogger("dsv4_sm120.nixl")


def room_failed(mgr, room: int, reason: str, tombstones=None) -> None:
    """Fail ``room`` on this prefill with ``reason`` and tell its decode (now, or when its transfer info comes).

    Call it before upstream's own release of the room (``sender.abort()``), so the
    decode gets this reason and not upstream's generic one. ``tombstones``: the
    hardened bootstrap thread's (default: the one serving ``mgr``, if any).
    """
    from sglang.srt.disaggregation.base.conn import KVPoll

    if tombstones is None:
        tombstones = getattr(getattr(mgr, "_dsv4_bootstrap", None), "tombstones", None)
    if tombstones is not None:  # transfer infos still on their way get the failure too
        tombstones.bury(room, reason)
    targets = mgr._room_notify_targets(room)
    if room in mgr.request_status and targets:
        mgr.conclude_failure(bootstrap_room=room, failure_reason=reason, targets=targets)
        metrics.inc("nixl_decode_told_failed_total", when="at once")
        logger.info("dsv4-sm120: room %s failed on the prefill; told %d decode endpoint(s)", room, len(targets))
    elif room in mgr.request_status:
        mgr.record_failure(room, reason)
        mgr.update_status(room, KVPoll.Failed)


def answer_late_transfer_info(mgr, room: int, info, reason: str) -> None:
    """Tell the decode that sent ``info`` (a registered peer) that ``room`` already failed here, and why."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr.send_kv_status_message(targets=[(info.endpoint, info.dst_port)], bootstrap_room=room,
                               status=KVPoll.Failed, failure_reason=reason)
    metrics.inc("nixl_decode_told_failed_total", when="on its transfer info")

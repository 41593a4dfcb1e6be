"""Agreement on a queue right before upstream reduces its polls, wherever the queue can have changed.

Why: upstream skips a queue's poll all-reduce when the rank's queue is empty and pairs the reduced
states by position, so the ranks must hold the same queue, in the same order, at the moment they
reduce. The top-of-iteration check agrees on every queue once; but rank-local code runs between it
and some polls (``process_pending_chunked_abort`` and HiCache events before the waiting queue's
poll; batch-result processing before the in-flight poll; decode's deferred releases, retraction
resume and preallocation before the prealloc and transfer polls). A rank that dropped or moved a
request there would reach gloo/NCCL with a list of another length, or none: a hang.

AROUND hooks on the methods holding those polls agree on the queue first (through the guard's
shared-memory channel where it set one up) and reconcile it as the top check does; the original
then polls a queue every rank holds alike. The bootstrap queue needs no hook: its poll
(``pop_bootstrapped``) directly follows the top check in every patched loop.

Each hook acts only on a scheduler whose patched loop set up the guard (``loop_guard.active``);
anywhere else (PP loops, guard off, TP=1, an unpatched sglang) it is upstream's call, untouched.
"""

from __future__ import annotations

from dsv4_sm120.guard import loop_guard, snapshot

PREFILL = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
DECODE_PREALLOC = "sglang.srt.disaggregation.decode.DecodePreallocQueue"
DECODE_TRANSFER = "sglang.srt.disaggregation.decode.DecodeTransferQueue"
# target -> (queue it polls, whether the method belongs to a decode queue object rather than the scheduler)
TARGETS = {
    f"{PREFILL}.resolve_waiting_queue_bootstrap": ("waiting", False),
    f"{PREFILL}.process_disagg_prefill_inflight_queue": ("inflight", False),
    f"{DECODE_PREALLOC}._update_handshake_waiters": ("prealloc", True),
    f"{DECODE_TRANSFER}.pop_transferred": ("transfer", True),
}


def agree_on_queue(scheduler, name: str) -> None:
    """Reconcile queue ``name`` across the TP ranks now, when this scheduler is guarded."""
    state = loop_guard.active(scheduler)
    if state is not None:
        loop_guard.agree(scheduler, state, lambda: snapshot.take_queue(scheduler, state.loop, name), name,
                         f"before the {name} queue's poll",
                         lambda: snapshot.queue_vector(scheduler, state.loop, name, state.digests))


def hook_for(name: str, on_queue_object: bool):
    """The AROUND hook for the method that polls queue ``name``."""

    def before_poll(original, owner, *args, **kwargs):
        agree_on_queue(owner.scheduler if on_queue_object else owner, name)
        return original(owner, *args, **kwargs)

    before_poll.__name__ = f"agree_before_{name}_poll"
    return before_poll

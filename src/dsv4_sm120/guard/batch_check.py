"""The second agreement: on the batch each rank formed, before the forward's collectives depend on it.

Why: the top-of-iteration check agrees on the queues a batch is formed from, but forming it reads
rank-local state (prefill: upstream's ``get_new_batch_prefill`` and its memory checks; decode: the
prebuilt merge and ``update_running_batch``, which may retract), and a chunked or pending abort
can land in between. Two ranks can then leave ``get_next_disagg_*_batch_to_run`` with different
batches: one enters the forward's TP collectives, the other ``on_idle`` or a forward of another
shape, and both wait forever. The call is the last one before the loop's ``if batch:``, so an
AROUND hook on it sees the batch before anything depends on it, in every loop the patch guards.

The ranks agree on: batch present, forward mode, request count and ordered id digest, extend token
count, sum of sequence lengths. On disagreement no rank runs a batch this iteration (the hook
returns none) and:

- prefill: every rank puts its batch's requests back at the head of its waiting queue, in batch
  order, giving back KV the formation allocated (upstream's ``release_kv_cache`` without
  checkpoint: the forward never wrote those pages) and resetting their prefix state
  (``Req.reset_for_retract``). A chunked request the rank formed is aborted instead (its earlier
  chunks' KV exists only through that request) and ``chunked_req`` cleared. Then the waiting queue
  is agreed and reconciled as at the top: requests every rank put back are formed again next
  iteration; the others are aborted with the guard's "safe to retry" error.
- decode: the batch is the running batch, already prepared for this step (sequence lengths
  advanced, a KV slot allocated per request), and upstream has no way to take one step back; every
  request of the disagreeing batch is aborted, on every rank holding it, with the same error.
"""

from __future__ import annotations

import logging

from dsv4_sm120.guard import consensus, loop_guard, reconcile, snapshot

logger = logging.getLogger("dsv4_sm120.guard")

PREFILL_TARGET = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run"
DECODE_TARGET = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run"


def check_prefill_batch(original, scheduler, *args, **kwargs):
    """AROUND ``get_next_disagg_prefill_batch_to_run``: run the formed batch only if every rank formed it."""
    return _checked(scheduler, original(scheduler, *args, **kwargs), _undo_prefill)


def check_decode_batch(original, scheduler, *args, **kwargs):
    """AROUND ``get_next_disagg_decode_batch_to_run``: run the formed batch only if every rank formed it."""
    return _checked(scheduler, original(scheduler, *args, **kwargs), _undo_decode)


def _checked(scheduler, plan, undo):
    state = loop_guard.active(scheduler)
    if state is None:
        return plan
    vector = snapshot.batch_vector(plan.batch_to_run, state.digests)
    for agreement in state.groups:
        try:
            bad = loop_guard.exchange_at(agreement, "batch", vector, state.loop, state.rank)
        except consensus.PeerLost as e:
            loop_guard._fail_fast(state.loop, state.rank, [], [], str(e))
        if bad:
            loop_guard.counters.add("divergences_seen")
            logger.warning("dsv4-sm120 guard: %s rank %d: ranks formed different batches (%s); none runs",
                           state.loop, state.rank, ", ".join(snapshot.BATCH_FIELDS[i] for i in bad))
            scheduler.running_batch = plan.running_batch  # what the loop assigns next; the undo edits it
            undo(scheduler, state, agreement, plan.batch_to_run)
            loop_guard.counters.add("divergences_reconciled")
            return type(plan)(batch_to_run=None, running_batch=scheduler.running_batch)
    return plan


def _undo_prefill(scheduler, state, agreement, batch) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    back = []
    for req in [] if not batch else batch.reqs:
        if req is scheduler.chunked_req:
            loop_guard.counters.add("requests_aborted")
            reconcile.retire_and_tell(scheduler, "prefill", "waiting", req, agreement.me, agreement.world)
            continue
        if req.kv.holds_kv:
            release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
            req.reset_for_retract()
        back.append(req)
    if batch and scheduler.chunked_req in batch.reqs:
        scheduler.chunked_req = None
    scheduler.waiting_queue = back + scheduler.waiting_queue
    loop_guard.agree(scheduler, state, lambda: snapshot.take_queue(scheduler, "prefill", "waiting"), "waiting",
                     "after the disagreeing batch went back to the waiting queue",
                     lambda: snapshot.queue_vector(scheduler, "prefill", "waiting", state.digests))


def _undo_decode(scheduler, state, agreement, batch) -> None:
    snap = snapshot.take_queue(scheduler, "decode", "running")
    gathered = agreement.gather(loop_guard._exchange(scheduler, "decode", snap))
    retired = reconcile.apply(scheduler, "decode", reconcile.plan(gathered, keep_common=False), agreement.world)
    loop_guard.counters.add("requests_aborted", retired)

"""Fail only the requests that read a bf16 index-K page that integrity mode found corrupt.

The C4 indexer checks the pages HiCache loaded for a forward as it reads them, and the verdicts
reach the host with that forward's result (:mod:`.integrity`). The pages are known to the host
pool and the indexer, not the requests, so a bad page is *reported* to :data:`QUARANTINE` and
attributed here, at two points, by each request's prefix row in ``req_to_token`` (exactly the
device slots its forward reads):

- when the scheduler processes the result of the forward that read the page (an AROUND hook on
  upstream's prefill result processing, plain and PD), before upstream commits that forward's
  output: the requests that read it are failed with upstream's own "KV never landed" mechanism,
  ``discard_output_reason`` (a ``FINISH_ABORT`` with HTTP 500 the result processor finishes them
  with, dropping that forward's output) and ``skip_radix_cache_insert`` (their KV never enters
  the tree). Other requests of the batch run on;
- when a later prefill batch is complete (an AROUND hook on ``Scheduler.get_new_batch_prefill``):
  a request whose prefix still matches the tree node that holds a quarantined page is failed the
  same way, before its forward, until the page is handed out again by the allocator (it then
  appears among a batch's freshly allocated slots, ``out_cache_loc``) or a new load-back is
  written into it. The host copy needs no bookkeeping: the ledger keeps the checksum it expects,
  so every later load of that host page mismatches again, until a new backup rewrites the page.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from dsv4_sm120.index_k import integrity, layout
from dsv4_sm120.index_k.integrity import QUARANTINE, CorruptPage

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
RESULT_TARGETS = (  # upstream's processing of a prefill batch's result: plain, and a PD prefill's
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
    ".process_batch_result_prefill",
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
)
# The copy of a batch that upstream's overlap loop keeps for its result processing
COPY_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.copy"
COMPRESS_RATIO = 4  # C4: one compressed index slot per 4 tokens
TOKENS_PER_INDEX_PAGE = layout.SLOTS_PER_PAGE * COMPRESS_RATIO  # 256: one tree page

logger = logging.getLogger("dsv4_sm120.index_k.request_fail")


def _pages(slots) -> set[int]:
    """Device index-K pages of a tensor of FULL token slots."""
    return set((slots.long() // TOKENS_PER_INDEX_PAGE).unique().tolist())


def abort_message(rid: str, bad: list[CorruptPage]) -> str:
    where = ", ".join(f"device page {p.device_page} " + ("(a key write lost to a load)" if p.host_page == integrity.WRITES
                                                         else f"(host page {p.host_page})") + f" layer {p.layer}"
                      for p in bad[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    return (
        f"Request {rid} failed: bf16 index-K checksum mismatch: {where}{more} "
        f"read by the C4 indexer different from its HiCache backup ({bad[0].pool}). "
        f"Caught by DSV4_SM120_INDEX_K_CHECKSUM=1; nothing computed from the corrupt page was returned. "
        f"Retry it: the page is quarantined and will be recomputed."
    )


def _local_findings(batch) -> list[list[CorruptPage]]:
    """Per request of the batch, the quarantined pages its prefix row covers on this rank.

    With nothing quarantined (every batch but those after a mismatch) no tensor is read: a batch's freshly
    allocated slots (``out_cache_loc``) sit on the GPU, and reading them in the admission hook made the host
    wait, at every prefill batch, for the forward the overlap scheduler had in flight."""
    if QUARANTINE.pages and batch.out_cache_loc is not None:
        QUARANTINE.clear(_pages(batch.out_cache_loc))
    if not QUARANTINE.pages:
        return [[] for _ in batch.reqs]
    rows = batch.req_to_token_pool.req_to_token
    row_of = batch.req_pool_indices_cpu if batch.req_pool_indices_cpu is not None else batch.req_pool_indices
    findings = []
    for i in range(len(batch.reqs)):
        prefix = rows[int(row_of[i]), : int(batch.prefix_lens[i])]
        findings.append([QUARANTINE.pages[p] for p in sorted(_pages(prefix) & QUARANTINE.pages.keys())])
        QUARANTINE.unattributed.difference_update(p.device_page for p in findings[-1])
    if QUARANTINE.unattributed:
        logger.error("index-K checksum mismatch on device page(s) %s that no request of this prefill batch "
                     "reads; they stay quarantined", sorted(QUARANTINE.unattributed))
        QUARANTINE.unattributed.clear()
    return findings


def _agree(tree_cache, findings: list[list[CorruptPage]]) -> list[list[CorruptPage]]:
    """Make every TP rank fail the same requests.

    Each rank verifies only its own copy of the pages; a request failed on one
    rank and run on the others would desynchronise the ranks' collectives. The
    ranks MAX-reduce one row per request (failed, layer, host page, device page)
    over the groups HiCache itself reduces its load counts on, so a rank that
    found nothing fails the request too, naming the page another rank found.
    """
    import torch

    if not findings:
        return findings
    reduce = getattr(tree_cache, "_all_reduce_attn_groups", None)
    if reduce is None:  # a cache of no TP groups (one rank); doctor fails where the pin's reducer is gone
        return findings
    rows = torch.full((len(findings), 4), -1, dtype=torch.int64)
    for i, bad in enumerate(findings):
        if bad:
            rows[i] = torch.tensor([1, bad[0].layer, bad[0].host_page, bad[0].device_page])
    reduce(rows, torch.distributed.ReduceOp.MAX)
    agreed = []
    for bad, (flag, layer, host_page, device_page) in zip(findings, rows.tolist()):
        if bad or flag < 1:
            agreed.append(bad)
        else:
            agreed.append([CorruptPage("index_k mirror of another TP rank", layer, host_page, device_page)])
    return agreed


def fail_affected_requests(batch, tree_cache=None) -> list:
    """Fail every request of a prepared prefill batch whose prefix covers a quarantined page.

    Returns the failed requests; the caller (the hook) hands a chunked one to the
    scheduler's deferred chunked abort, as upstream does for a failed KV load.
    """
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    failed = []
    for req, bad in zip(batch.reqs, _agree(tree_cache, _local_findings(batch))):
        if not bad:
            continue
        req.discard_output_reason = FINISH_ABORT(abort_message(req.rid, bad), HTTPStatus.INTERNAL_SERVER_ERROR)
        req.skip_radix_cache_insert = True
        integrity.count("requests_failed", 1)
        for p in bad:
            logger.error("index-K checksum mismatch fails request rid=%s: pool=%s layer=%d host_page=%d "
                         "device_page=%d", req.rid, p.pool, p.layer, p.host_page, p.device_page)
        failed.append(req)
    return failed


def get_new_batch_prefill(original, scheduler, *args, **kwargs):
    """AROUND hook: fail the requests of a new prefill batch whose prefix still reads a quarantined page."""
    plan = original(scheduler, *args, **kwargs)
    batch = plan.batch_to_run
    if batch is None or not QUARANTINE.active:
        return plan
    for req in fail_affected_requests(batch, scheduler.tree_cache):
        if req is scheduler.chunked_req:
            # Upstream's path for a chunked request whose KV load failed: stop its next chunk.
            scheduler._pending_chunked_abort_req = req
    return plan


def keep_load_slot(original, batch, *args, **kwargs):
    """AROUND hook: the copy of a batch kept for its result processing carries the batch's HiCache load slot.

    Why: ``ScheduleBatch.copy`` keeps only the fields upstream's result processing reads, and the load slot
    is not one of them; under the overlap scheduler (sglang's default on a GPU) every batch reaches
    :func:`process_prefill_result` as such a copy, so without this the verdicts of every forward stayed
    uncollected (a Hopper run counted no check at all).
    """
    copied = original(batch, *args, **kwargs)
    copied.hicache_consumer_index = batch.hicache_consumer_index
    return copied


def process_prefill_result(original, processor, batch, result, *args, **kwargs):
    """AROUND hook: before upstream commits a prefill forward's output, fail the requests whose pages the
    C4 indexer found unlike their backups in that forward (integrity mode).

    Upstream's first step here is to wait for the forward's outputs (``copy_done``); it is taken a
    few lines early so that the verdicts, copied to the host behind the indexer's checks on the same
    stream, have landed: nothing waits that upstream would not have waited for.
    """
    slot = getattr(batch, "hicache_consumer_index", -1)
    if integrity.LEDGER is not None and slot >= 0:
        if getattr(result, "copy_done", None) is not None:
            result.copy_done.synchronize()
        integrity.LEDGER.collect(slot)
        fail_affected_requests(batch, processor.tree_cache)  # on every TP rank: they agree on the failures
    return original(processor, batch, result, *args, **kwargs)

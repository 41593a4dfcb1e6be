"""Fail only the requests that loaded a corrupt bf16 index-K page (integrity mode).

HiCache merges the load-backs of every request admitted in one scheduling step
into one host-to-device operation, and the host pool that verifies the pages
(``BF16IndexKHostPool.load_to_device_per_layer``) knows pages, not requests. A
mismatch raised from there would leave the scheduler's load path (taking the
scheduler down, or being swallowed somewhere above it) and would name no
request. So the ledger only *reports* a bad page here (:data:`QUARANTINE`), and
this module attributes it when the step's prefill batch is complete: the AROUND
hook on ``Scheduler.get_new_batch_prefill`` looks at each request's prefix row
in ``req_to_token`` — exactly the device slots the forward will read — and a
request whose prefix covers a quarantined page is failed with upstream's own
"KV never landed" mechanism: ``discard_output_reason`` (a ``FINISH_ABORT`` the
result processor finishes it with, dropping that forward's output) and
``skip_radix_cache_insert`` (its KV never enters the tree). Other requests of
the batch run on.

A quarantined device page stays quarantined, so a later request whose prefix
still matches the tree node that holds it is failed too, until the page is
handed out again by the allocator (it then appears among a batch's freshly
allocated slots, ``out_cache_loc``) or a new load-back is written into it. The
host copy needs no bookkeeping: the ledger keeps the checksum it expects, so
every later load of that host page mismatches again, until a new backup
rewrites the page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus

from dsv4_sm120.index_k import layout

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
COMPRESS_RATIO = 4  # C4: one compressed index slot per 4 tokens
TOKENS_PER_INDEX_PAGE = layout.SLOTS_PER_PAGE * COMPRESS_RATIO  # 256: one tree page

logger = logging.getLogger("dsv4_sm120.index_k.request_fail")


@dataclass(frozen=True)
class CorruptPage:
    """One bf16 index-K page row that came back from host unlike its backup."""

    pool: str
    layer: int
    host_page: int
    device_page: int


class Quarantine:
    """Device pages whose index-K rows are known bad, with the first bad record of each."""

    def __init__(self):
        self.active = False  # set when an integrity-mode host mirror is built in this process
        self.pages: dict[int, CorruptPage] = {}
        self.unattributed: set[int] = set()

    def report(self, page: CorruptPage) -> None:
        self.pages.setdefault(page.device_page, page)
        self.unattributed.add(page.device_page)

    def clear(self, device_pages) -> None:
        """These device pages now hold new bytes (reallocated, or a clean load landed)."""
        for page in device_pages:
            self.pages.pop(int(page), None)
            self.unattributed.discard(int(page))


QUARANTINE = Quarantine()


def sample_gauges() -> dict:
    """``sglang:dsv4_index_k_pages_quarantined``: device pages no request may read now."""
    return {"index_k_pages_quarantined": len(QUARANTINE.pages)}


def _pages(slots) -> set[int]:
    """Device index-K pages of a tensor of FULL token slots."""
    return set((slots.long() // TOKENS_PER_INDEX_PAGE).unique().tolist())


def abort_message(rid: str, bad: list[CorruptPage]) -> str:
    where = ", ".join(f"device page {p.device_page} (host page {p.host_page}) layer {p.layer}" for p in bad[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    return (
        f"Request {rid} failed: bf16 index-K checksum mismatch on HiCache load-back: {where}{more} "
        f"came back from the host mirror ({bad[0].pool}) different from what was backed up. "
        f"Caught by DSV4_SM120_INDEX_K_CHECKSUM=1; the request was not allowed to run on the corrupt "
        f"page. Retry it: the page is quarantined and will be recomputed."
    )


def _local_findings(batch) -> list[list[CorruptPage]]:
    """Per request of the batch, the quarantined pages its prefix row covers on this rank."""
    if batch.out_cache_loc is not None:
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

    reduce = getattr(tree_cache, "_all_reduce_attn_groups", None)
    if reduce is None or not findings:
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

    from dsv4_sm120.index_k.integrity import count

    failed = []
    for req, bad in zip(batch.reqs, _agree(tree_cache, _local_findings(batch))):
        if not bad:
            continue
        req.discard_output_reason = FINISH_ABORT(abort_message(req.rid, bad), HTTPStatus.INTERNAL_SERVER_ERROR)
        req.skip_radix_cache_insert = True
        count("requests_failed", 1)
        for p in bad:
            logger.error("index-K checksum mismatch fails request rid=%s: pool=%s layer=%d host_page=%d "
                         "device_page=%d", req.rid, p.pool, p.layer, p.host_page, p.device_page)
        failed.append(req)
    return failed


def get_new_batch_prefill(original, scheduler, *args, **kwargs):
    """AROUND hook: after the step's load-backs were issued and verified, fail the requests they corrupted."""
    plan = original(scheduler, *args, **kwargs)
    batch = plan.batch_to_run
    if batch is None or not QUARANTINE.active:
        return plan
    for req in fail_affected_requests(batch, scheduler.tree_cache):
        if req is scheduler.chunked_req:
            # Upstream's path for a chunked request whose KV load failed: stop its next chunk.
            scheduler._pending_chunked_abort_req = req
    return plan

"""Integrity mode fails only the requests that read a page the C4 indexer found corrupt.

The real bf16 HiCache stack (``stacks``), the CPU page movers of test_hicache
(the CUDA copy kernels do not exist on CPU), the real ``req_to_token`` pool from
``configure()``, real ``Req``/``ScheduleBatch`` objects, and the real
``Scheduler.get_new_batch_prefill`` with the hooks applied by upstream's
HookRegistry. Replaced: the scheduler's admission (``_get_new_batch_prefill_raw``:
it needs a model runner and a radix tree) returns a prepared batch whose rows
hold the prefixes, as ``prepare_for_extend`` writes them; upstream's own body of
the prefill result processing (it needs a model worker's outputs), which the
result hook wraps; and the forward, of which only the C4 indexer's reads run
(test_integrity.py's ``load`` and ``read``).
"""

from __future__ import annotations

import logging
import multiprocessing
from array import array

import pytest
import torch

from harness.servers import free_port
from tests.index_k import cpu_page_mover, test_integrity
from tests.index_k.host_sync import NoHostSync
from tests.index_k.pool_harness import SLOTS_PER_FULL_PAGE
from tests.index_k.test_hicache import index_host

HOST_PAGES = [6, 7, 8]
BACKED_UP_FROM = [10, 11, 12]
CORRUPT_HOST_PAGE, CORRUPT_LAYER = 7, 1


def _slots(pages):
    return cpu_page_mover.pages_to_slots(torch.as_tensor(pages), SLOTS_PER_FULL_PAGE)


@pytest.fixture
def stack(stacks, monkeypatch, request):
    """The bf16 stack (checksummed or not), its pages backed up, one host byte flipped; the process's integrity
    state that of a server built with it (the stacks are cached: another test's build may have left its own)."""
    from dsv4_sm120.index_k import integrity
    from dsv4_sm120.index_k.integrity import QUARANTINE

    result, built, _ = stacks("layer_first", checksum=request.param)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    monkeypatch.setattr(integrity, "LEDGER", host.index_k_ledger)
    monkeypatch.setattr(QUARANTINE, "active", host.index_k_ledger is not None)
    cpu_page_mover.install(monkeypatch, host)
    QUARANTINE.pages.clear()
    gen = torch.Generator().manual_seed(11)
    for buf in host.device_buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    host.backup_from_device_all_layer(device_pool, _slots(HOST_PAGES), _slots(BACKED_UP_FROM), "kernel")
    host.kv_buffer[CORRUPT_LAYER][CORRUPT_HOST_PAGE][1000] ^= 0x01
    yield result, host, device_pool
    QUARANTINE.pages.clear()


def _load(host, device_pool, host_pages, device_pages):
    """One HiCache load-back, layer by layer, as the L2 transfer engine issues it, then the forward's reads;
    returns the load's slot (the batch's ``hicache_consumer_index``)."""
    if host.index_k_ledger is None:
        for layer in range(host.layer_num):
            host.load_to_device_per_layer(device_pool, _slots(host_pages), _slots(device_pages), layer, "kernel")
        return -1
    slot = test_integrity.load(host, device_pool, host_pages, device_pages)
    ledger = host.index_k_ledger
    ledger.counter.set_consumer(slot)
    for layer in range(host.layer_num):
        ledger.check_reads(layer, host.device_buffers[layer])
    ledger.counter.set_consumer(-1)
    return slot


def _batch(result, prefixes: dict[str, list[int]], fresh_pages=()):
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = result.req_to_token_pool
    reqs, rows, lens = [], [], []
    for row, (rid, pages) in enumerate(prefixes.items()):
        req = Req(rid, "", array("q", [1] * (len(pages) + 1) * SLOTS_PER_FULL_PAGE), SamplingParams())
        pool.req_to_token[row, : len(pages) * SLOTS_PER_FULL_PAGE] = _slots(pages).to(pool.req_to_token.dtype)
        reqs.append(req)
        rows.append(row)
        lens.append(len(pages) * SLOTS_PER_FULL_PAGE)
    batch = ScheduleBatch(reqs=reqs, req_to_token_pool=pool, device="cpu")
    batch.req_pool_indices_cpu = torch.tensor(rows)
    batch.prefix_lens = lens
    batch.out_cache_loc = _slots(list(fresh_pages)) if fresh_pages else torch.empty(0, dtype=torch.int64)
    return batch


def _result(result, slot, prefixes: dict[str, list[int]], tree_cache=None):
    """The scheduler processes the result of the forward that consumed load ``slot`` (batch ``prefixes``)."""
    from types import SimpleNamespace

    from dsv4_sm120.index_k import request_fail

    batch = _batch(result, prefixes)
    batch.hicache_consumer_index = slot
    batch = batch.copy()  # what upstream's overlap loop (sglang's default on a GPU) hands to result processing
    processor = SimpleNamespace(tree_cache=tree_cache)
    upstream = []  # Replaced: upstream's body, which commits the batch's outputs (see the module docstring)
    request_fail.process_prefill_result(lambda *a, **k: upstream.append(a), processor, batch,
                                        SimpleNamespace(copy_done=None))
    assert len(upstream) == 1, "the result hook must always hand the batch on to upstream"
    return {req.rid: req for req in batch.reqs}


def _step(result, prefixes: dict[str, list[int]], fresh_pages=(), tree_cache=None):
    """One scheduling step through the hooked Scheduler.get_new_batch_prefill.

    ``prefixes``: rid -> device pages its prefix reads; ``fresh_pages``: pages the
    step allocates (its ``out_cache_loc``). Returns the requests by rid.
    """
    from sglang.srt.managers.schedule_batch import NextBatchPlan, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    batch = _batch(result, prefixes, fresh_pages)
    reqs = batch.reqs
    scheduler = object.__new__(Scheduler)
    scheduler.prefill_delayer = None
    scheduler.chunked_req = None
    scheduler.tree_cache = tree_cache
    scheduler._pending_chunked_abort_req = None
    running = ScheduleBatch(reqs=[], device="cpu")
    # Replaced: admission (see the module docstring); the hook wraps the real method around it.
    scheduler._get_new_batch_prefill_raw = lambda **kwargs: (batch, kwargs["running_batch"])
    plan = Scheduler.get_new_batch_prefill(scheduler, running)
    assert isinstance(plan, NextBatchPlan) and plan.batch_to_run is batch
    return {req.rid: req for req in reqs}


@pytest.mark.parametrize("stack", [True], indirect=True)
def test_corrupt_load_back_fails_only_the_request_that_reads_it(stack, caplog):
    from dsv4_sm120.index_k.integrity import COUNTERS

    result, host, device_pool = stack
    before = dict(COUNTERS)
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        slot = _load(host, device_pool, HOST_PAGES, [20, 21, 22])  # no exception out of the load or the read
        assert COUNTERS["requests_failed"] == before["requests_failed"]
        reqs = _result(result, slot, {"hit": [20, 21], "same-load-other-page": [20], "other": [30, 31], "none": []})

    assert COUNTERS["mismatches"] - before["mismatches"] == 1
    assert COUNTERS["requests_failed"] - before["requests_failed"] == 1
    reason = reqs["hit"].discard_output_reason
    assert reason is not None and reason.status_code == 500 and reqs["hit"].skip_radix_cache_insert
    for needle in ("Request hit failed", "index-K checksum mismatch", "device page 21 (host page 7) layer 1",
                   "DSV4_SM120_INDEX_K_CHECKSUM=1"):
        assert needle in reason.to_json()["message"]
    for rid in ("same-load-other-page", "other", "none"):
        assert reqs[rid].discard_output_reason is None and not reqs[rid].skip_radix_cache_insert
    assert "fails request rid=hit: pool=" in caplog.text and "layer=1 host_page=7 device_page=21" in caplog.text


@pytest.mark.parametrize("stack", [True], indirect=True)
def test_the_corrupt_page_is_not_served_again(stack):
    """Neither its device copy (still in the tree) nor its host copy reaches a request unnoticed."""
    from dsv4_sm120.index_k.integrity import COUNTERS

    result, host, device_pool = stack
    slot = _load(host, device_pool, HOST_PAGES, [20, 21, 22])
    assert _result(result, slot, {"first": [21]})["first"].discard_output_reason is not None
    # a later request matching the same device copy
    assert _step(result, {"later-device-hit": [20, 21, 22]})["later-device-hit"].discard_output_reason is not None
    # the host copy loaded again, into other device pages
    mismatches = COUNTERS["mismatches"]
    slot = _load(host, device_pool, HOST_PAGES, [40, 41, 42])
    reqs = _result(result, slot, {"later-host-hit": [41], "clean": [40, 42]})
    assert COUNTERS["mismatches"] == mismatches + 1
    assert reqs["later-host-hit"].discard_output_reason is not None and reqs["clean"].discard_output_reason is None
    # once page 21 is handed out again (it shows up among a step's new slots) it is no longer suspect
    assert _step(result, {"reuse": [21]}, fresh_pages=[21])["reuse"].discard_output_reason is None
    # a new backup into the host page replaces the bytes the ledger expects
    host.backup_from_device_all_layer(device_pool, _slots([CORRUPT_HOST_PAGE]), _slots([50]), "kernel")
    slot = _load(host, device_pool, [CORRUPT_HOST_PAGE], [41])
    assert _result(result, slot, {"after-rebackup": [41]})["after-rebackup"].discard_output_reason is None
    assert COUNTERS["mismatches"] == mismatches + 1


def _tp_rank(rank, port, result, host, device_pool, conn):
    """One TP rank: rank 0 loads the corrupt host page into device page 21, rank 1 an intact one."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # (the host buffer is shared memory, so rank 1 loads another, intact host page into page 21)
        slot = _load(host, device_pool, HOST_PAGES if rank == 0 else [6, 8, 8], [20, 21, 22])
        # The real tree class, built without its constructor: only its HiCache groups are used.
        tree = object.__new__(UnifiedRadixCache)
        tree.attn_cp_group, tree.attn_tp_group = None, torch.distributed.group.WORLD
        tree.tp_world_size, tree.tp_group = 2, torch.distributed.group.WORLD
        reqs = _result(result, slot, {"hit": [21], "other": [30]}, tree_cache=tree)
        conn.send({rid: r.discard_output_reason and r.discard_output_reason.message for rid, r in reqs.items()})
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stack", [True], indirect=True)
def test_tp_ranks_fail_the_same_requests(stack):
    """A request failed on one rank only would desynchronise the ranks: all fail it, all run the rest."""
    result, host, device_pool = stack
    port = free_port()
    ctx = multiprocessing.get_context("fork")  # the children reuse this process's sglang import and pools
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_tp_rank, args=(rank, port, result, host, device_pool, pipes[rank][1]))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    answers = [pipes[rank][0].recv() if pipes[rank][0].poll(60) else None for rank in range(2)]
    for proc in procs:
        proc.join(10)
    assert None not in answers, "a TP rank did not answer"
    assert answers[0]["other"] is None and answers[1]["other"] is None
    assert answers[0]["hit"] is not None, "rank 0 ran on the corrupt page"
    assert answers[1]["hit"] is not None, "rank 1 ran the request rank 0 failed: the ranks disagree"
    assert "device page 21 (host page 7) layer 1" in answers[0]["hit"]
    assert "device page 21 (host page 7) layer 1" in answers[1]["hit"] and "another TP rank" in answers[1]["hit"]


@pytest.mark.parametrize("stack", [False], indirect=True)
def test_without_the_mode_the_corruption_reaches_the_request_silently(stack):
    """The control: checksum off, the same planted byte is served to the request and nothing fails."""
    from dsv4_sm120.index_k.integrity import COUNTERS

    result, host, device_pool = stack
    before = dict(COUNTERS)
    backed_up = host.device_buffers[CORRUPT_LAYER][BACKED_UP_FROM[1]].clone()
    _load(host, device_pool, HOST_PAGES, [20, 21, 22])
    reqs = _step(result, {"hit": [20, 21], "other": [30]})
    assert int((host.device_buffers[CORRUPT_LAYER][21] != backed_up).sum()) == 1
    assert all(req.discard_output_reason is None for req in reqs.values())
    assert COUNTERS == before


@pytest.mark.parametrize("stack", [True], indirect=True)
def test_with_nothing_quarantined_the_scheduler_hooks_read_no_tensor(stack):
    """Integrity mode on, no page quarantined (every batch but those after a mismatch): the admission hook and
    the request check of the result hook look at no tensor's values. A batch's fresh slots live on the GPU;
    reading them here makes the scheduler wait for the forward in flight at every prefill batch."""
    from types import SimpleNamespace

    from dsv4_sm120.index_k import request_fail

    result, _, _ = stack
    batch = _batch(result, {"a": [20, 21], "b": [22]}, fresh_pages=[30, 31])
    plan = SimpleNamespace(batch_to_run=batch)
    scheduler = SimpleNamespace(tree_cache=None, chunked_req=None, _pending_chunked_abort_req=None)
    with NoHostSync():
        assert request_fail.get_new_batch_prefill(lambda *a, **k: plan, scheduler) is plan
        assert request_fail.fail_affected_requests(batch) == []
    assert all(req.discard_output_reason is None for req in batch.reqs)

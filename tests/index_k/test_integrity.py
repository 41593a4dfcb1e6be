"""Integrity mode (DSV4_SM120_INDEX_K_CHECKSUM=1): loaded pages are checked where the C4 indexer reads them.

Same real stack and CPU page movers as test_hicache.py; the checksum is the kernels area's
``page_checksum`` (its torch reference on CPU). A HiCache load is driven layer by layer as
``L2TransferEngine.submit_host_to_device`` does, under a producer slot of the stack's real
``LayerDoneCounter``; the forward that reads it sets that slot as its consumer, as the TP worker
does, and "reads" a layer where the model's C4 indexer does (``integrity.check_reads``). A load
that has not landed yet is one whose copies the test holds back (:class:`HeldCopies`).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.index_k import cpu_page_mover
from tests.index_k.host_sync import NoHostSync
from tests.index_k.pool_harness import SLOTS_PER_FULL_PAGE
from tests.index_k.test_hicache import index_host, round_trip

COPY_OPS = ("transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf")


def _slots(pages):
    return cpu_page_mover.pages_to_slots(torch.as_tensor(pages), SLOTS_PER_FULL_PAGE)


def _ledger(host):
    """The stack's ledger, its device pool holding a counter as upstream's ``_apply_stack_result`` registers one."""
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    from dsv4_sm120.index_k import integrity

    ledger = host.index_k_ledger
    assert ledger is not None
    integrity.LEDGER = ledger  # this test's stack is the process's (the fixture caches several)
    if ledger.kvcache.layer_transfer_counter is None:
        ledger.kvcache.register_layer_transfer_counter(LayerDoneCounter(host.layer_num))
    return ledger


def load(host, device_pool, host_pages, device_pages, layers=None):
    """One HiCache load under a new producer slot; returns the slot its forward consumes."""
    ledger = _ledger(host)
    slot = ledger.counter.update_producer()
    for layer in range(host.layer_num) if layers is None else layers:
        host.load_to_device_per_layer(device_pool, _slots(host_pages), _slots(device_pages), layer, "kernel")
    return slot


def read(host, slot, layers=None):
    """The forward that consumes ``slot`` reads each layer at its C4 indexer; then its result is processed."""
    ledger = _ledger(host)
    ledger.counter.set_consumer(slot)
    for layer in range(host.layer_num) if layers is None else layers:
        ledger.check_reads(layer, host.device_buffers[layer])
    ledger.counter.set_consumer(-1)
    return ledger.collect(slot)


class HeldCopies:
    """The per-layer load copies queued instead of run: a load that has not landed until :meth:`land`."""

    def __init__(self, monkeypatch):
        from sglang.srt.mem_cache import memory_pool_host

        self.queued = []
        for name in COPY_OPS:
            real = getattr(memory_pool_host, name)
            monkeypatch.setattr(memory_pool_host, name,
                                lambda *a, _real=real, **k: self.queued.append(lambda: _real(*a, **k)))

    def land(self):
        for copy in self.queued:
            copy()
        self.queued.clear()


def _backed_up(stacks, monkeypatch, layout="layer_first", seed=7, pages=(10, 11, 12), hosts=(6, 7, 8)):
    from dsv4_sm120.index_k.integrity import QUARANTINE

    result, built, _ = stacks(layout, checksum=True)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    cpu_page_mover.install(monkeypatch, host)
    QUARANTINE.pages.clear()
    gen = torch.Generator().manual_seed(seed)
    for buf in host.device_buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    host.backup_from_device_all_layer(device_pool, _slots(list(hosts)), _slots(list(pages)), "kernel")
    return host, device_pool


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_clean_loads_pass_at_the_read_and_count_distinct_pages_once(stacks, monkeypatch, layout):
    from dsv4_sm120.index_k.integrity import COUNTERS

    result, built, _ = stacks(layout, checksum=True)
    host = index_host(built)
    cpu_page_mover.install(monkeypatch, host)
    before = dict(COUNTERS)
    gen = torch.Generator().manual_seed(5)
    pages = torch.randperm(host.device_buffers[0].shape[0], generator=gen)[:40]
    hosts = torch.randperm(host.num_host_pages, generator=gen)[:40]
    ledger = _ledger(host)
    ledger.counter.update_producer()  # round_trip's loads (3 per layer) go to this slot
    round_trip(host, result.token_to_kv_pool.c4_indexer_kv_pool, [(pages[:13], hosts[:13]), (pages[13:], hosts[13:])], 3, gen)
    assert read(host, ledger.counter.producer_index) == []
    layers = len(host.device_buffers)
    delta = {k: COUNTERS[k] - before[k] for k in COUNTERS}
    assert delta["pages_recorded"] == delta["page_checks"] == delta["pages_verified"] == 40 * layers
    assert delta["page_rechecks"] == delta["mismatches"] == delta["pages_unrecorded"] == 0
    # the same backed-up pages loaded again, elsewhere: re-checks, not new distinct pages
    targets = torch.randperm(host.device_buffers[0].shape[0], generator=gen)[:40]
    assert read(host, load(host, result.token_to_kv_pool.c4_indexer_kv_pool, hosts, targets)) == []
    assert COUNTERS["page_rechecks"] - before["page_rechecks"] == 40 * layers
    assert COUNTERS["pages_verified"] - before["pages_verified"] == 40 * layers


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_planted_corruption_is_caught_at_the_read_counted_and_logged(stacks, monkeypatch, caplog, layout):
    from dsv4_sm120.index_k.integrity import COUNTERS, QUARANTINE, CorruptPage

    host, device_pool = _backed_up(stacks, monkeypatch, layout)
    host_row = host.kv_buffer[1][7] if layout == "layer_first" else host.kv_buffer[7, 1]
    host_row[1000] ^= 0x01
    mismatches = COUNTERS["mismatches"]
    slot = load(host, device_pool, [6, 7, 8], [20, 21, 22])
    assert COUNTERS["mismatches"] == mismatches  # nothing is checked in the load path
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120.index_k.integrity"):
        found = read(host, slot)
    assert COUNTERS["mismatches"] == mismatches + 1
    assert found == [CorruptPage(host.pool_name, 1, 7, 21)]
    assert "at read: pool=" in caplog.text and "layer=1 host_page=7 device_page=21" in caplog.text
    # quarantined for the scheduler hooks (tests/index_k/test_integrity_request_fail.py), not raised
    assert QUARANTINE.pages == {21: CorruptPage(host.pool_name, 1, 7, 21)}
    QUARANTINE.pages.clear()


def test_a_read_before_the_load_lands_mismatches_on_every_page(stacks, monkeypatch):
    """The race the fence exists for: the indexer reads a layer whose load is still in flight."""
    from dsv4_sm120.index_k.integrity import COUNTERS, QUARANTINE

    host, device_pool = _backed_up(stacks, monkeypatch)
    for buf in host.device_buffers:
        buf[[20, 21, 22]] = 0  # what the target pages held before the load: another request's keys
    held = HeldCopies(monkeypatch)
    mismatches = COUNTERS["mismatches"]
    slot = load(host, device_pool, [6, 7, 8], [20, 21, 22])
    assert len(held.queued) == host.layer_num
    found = read(host, slot, layers=[0])  # layer 0 read before its copy ran
    held.land()
    assert sorted(p.device_page for p in found) == [20, 21, 22]
    assert COUNTERS["mismatches"] == mismatches + 3
    # once landed, the same load read afterwards is clean
    assert read(host, slot, layers=range(1, host.layer_num)) == []
    QUARANTINE.pages.clear()


def test_a_late_write_over_a_landed_page_mismatches(stacks, monkeypatch):
    """A forward still writing into a reclaimed page after the load into it landed: the reader sees it."""
    host, device_pool = _backed_up(stacks, monkeypatch)
    slot = load(host, device_pool, [6, 7, 8], [20, 21, 22])
    last = host.layer_num - 1
    host.device_buffers[last][22, 512:768] = 0xAB  # one late key store into the last layer of device page 22
    found = read(host, slot)
    assert [(p.layer, p.device_page) for p in found] == [(last, 22)]


def test_a_key_write_lost_to_a_later_load_is_found_at_the_read(stacks, monkeypatch, caplog):
    """The writer side: keys a loading forward stored, overwritten by a load landing before the layer's read."""
    from dsv4_sm120.index_k.integrity import COUNTERS, QUARANTINE, WRITES

    host, device_pool = _backed_up(stacks, monkeypatch)
    ledger = _ledger(host)
    held = HeldCopies(monkeypatch)
    slot = load(host, device_pool, [6, 7, 8], [20, 21, 22], layers=[1])  # its copy held back
    ledger.counter.set_consumer(slot)
    # the forward's key store into two slots of device page 21 (a page the load also targets)
    keys = host.device_buffers[1].view(-1, 256)
    stored = torch.tensor([21 * 64 + 3, 21 * 64 + 4, -1])
    keys[stored[:2]] = 0x5A
    ledger.note_writes(1, host.device_buffers[1], stored)
    held.land()  # the late load lands on them
    before = dict(COUNTERS)
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120.index_k.integrity"):
        found = read(host, slot, layers=[1])
    assert COUNTERS["key_writes_checked"] - before["key_writes_checked"] == 2
    assert COUNTERS["key_writes_lost"] - before["key_writes_lost"] == 2
    assert (1, WRITES, 21) in [(p.layer, p.host_page, p.device_page) for p in found]
    assert "index-K key write lost: layer=1 device_page=21" in caplog.text
    assert 21 in QUARANTINE.pages
    QUARANTINE.pages.clear()


def test_the_ledger_follows_the_counter_registered_on_the_pool_and_only_the_loading_forward_checks(
        stacks, monkeypatch):
    """Upstream registers (and its hybrid controller replaces) the load counter after the stack is built; the
    ledger reads the one the fence waits on at every call. A forward that consumes no load checks nothing."""
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    from dsv4_sm120.index_k.integrity import COUNTERS

    host, device_pool = _backed_up(stacks, monkeypatch)
    ledger = _ledger(host)
    first = ledger.counter  # the counter the stack was built with, as a ledger sees it before serving
    replaced = LayerDoneCounter(host.layer_num)
    assert first is not None and first is not replaced
    ledger.kvcache.register_layer_transfer_counter(replaced)
    replaced.update_producer()
    slot = load(host, device_pool, [6, 7, 8], [20, 21, 22])  # the second slot of the replacing counter
    assert slot == 1 and replaced.producer_index == 1
    before = COUNTERS["page_checks"]
    replaced.set_consumer(-1)  # a forward without loads (a decode step) reads every layer first
    for layer in range(host.layer_num):
        ledger.check_reads(layer, host.device_buffers[layer])
    assert COUNTERS["page_checks"] == before
    assert read(host, slot) == [] and COUNTERS["page_checks"] - before == 3 * host.layer_num


def test_pages_with_no_checksum_on_record_are_not_counted_as_checked(stacks, monkeypatch):
    from dsv4_sm120.index_k.integrity import COUNTERS

    host, device_pool = _backed_up(stacks, monkeypatch)
    before = dict(COUNTERS)
    found = read(host, load(host, device_pool, [6, 90, 91], [30, 31, 32]))  # host pages 90, 91: never backed up
    assert found == []
    assert COUNTERS["page_checks"] - before["page_checks"] == host.layer_num
    assert COUNTERS["pages_unrecorded"] - before["pages_unrecorded"] == 2 * host.layer_num


def test_no_host_synchronization_in_the_copy_path_or_the_indexer_read(stacks, monkeypatch):
    """Backup, load and the indexer-side check only queue GPU work: any call that makes the host wait fails
    here (a torch-function mode watching every tensor call of the package and of upstream's host pool)."""
    from sglang.srt.mem_cache import memory_pool_host

    host, device_pool = _backed_up(stacks, monkeypatch)
    ledger = _ledger(host)
    for name in ("transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla"):  # the CPU stand-ins of CUDA copies
        real = getattr(memory_pool_host, name)

        def unwatched(*a, _real=real, **k):
            with torch._C.DisableTorchFunction():
                return _real(*a, **k)

        monkeypatch.setattr(memory_pool_host, name, unwatched)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("torch.cuda.synchronize called"))
    with NoHostSync():
        host.backup_from_device_all_layer(device_pool, _slots([40]), _slots([13]), "kernel")
        slot = ledger.counter.update_producer()
        for layer in range(host.layer_num):
            host.load_to_device_per_layer(device_pool, _slots([6, 7, 40]), _slots([20, 21, 22]), layer, "kernel")
        ledger.counter.set_consumer(slot)
        ledger.note_writes(0, host.device_buffers[0], torch.tensor([23 * 64, 23 * 64 + 1]))
        for layer in range(host.layer_num):
            ledger.check_reads(layer, host.device_buffers[layer])
    assert read(host, slot) == []  # the verdicts, read where the scheduler processes the result


def test_a_load_is_checked_with_one_launch_a_layer_and_its_indices_moved_once(stacks, monkeypatch):
    """The read's host work: upstream hands every layer's copy the same index tensors, so they are moved to
    the reader's device once per load, each layer's check is one ledger call (one launch on a GPU), and the
    verdicts of every layer, read and key-write checks alike, go to the host in one copy behind the last layer."""
    from dsv4_sm120.index_k import integrity
    from dsv4_sm120.kernels import page_ledger

    host, device_pool = _backed_up(stacks, monkeypatch)
    ledger = _ledger(host)
    moved, checks, sent = [], [], []
    real_move, real_check, real_send = integrity.on_device, page_ledger.check_pages, ledger._send
    monkeypatch.setattr(integrity, "on_device", lambda *a: moved.append(a) or real_move(*a))
    monkeypatch.setattr(page_ledger, "check_pages", lambda *a, **k: checks.append(a) or real_check(*a, **k))
    monkeypatch.setattr(ledger, "_send", lambda slot: sent.append(len(ledger.verdicts.get(slot, []))) or real_send(slot))
    slot = ledger.counter.update_producer()
    host_slots, device_slots = _slots([6, 7, 8]), _slots([20, 21, 22])
    for layer in range(host.layer_num):
        host.load_to_device_per_layer(device_pool, host_slots, device_slots, layer, "kernel")
    ledger.counter.set_consumer(slot)
    for layer in range(host.layer_num):
        ledger.note_writes(layer, host.device_buffers[layer], torch.tensor([23 * 64, 23 * 64 + 1]))
    assert read(host, slot) == []
    assert len(checks) == host.layer_num
    assert len(moved) == 2  # the device and the host indices, once
    assert [n for n in sent if n] == [2 * host.layer_num]  # one copy: each layer's read and key-write verdicts
    assert integrity.COUNTERS["key_writes_checked"] >= 2 * host.layer_num


def test_without_the_mode_the_same_corruption_passes_silently(stacks, monkeypatch):
    """The control: checksum off, the planted byte lands in the device page unnoticed."""
    result, built, _ = stacks("layer_first", checksum=False)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    assert host.index_k_ledger is None
    cpu_page_mover.install(monkeypatch, host)
    gen = torch.Generator().manual_seed(7)
    for buf in host.device_buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    host.backup_from_device_all_layer(device_pool, _slots([6, 7, 8]), _slots([10, 11, 12]), "kernel")
    host.kv_buffer[1][7][1000] ^= 0x01
    original = host.device_buffers[1][11].clone()
    host.load_to_device_per_layer(device_pool, _slots([6, 7, 8]), _slots([20, 21, 22]), 1, "kernel")
    assert int((host.device_buffers[1][21] != original).sum()) == 1

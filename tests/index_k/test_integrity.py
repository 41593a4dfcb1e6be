"""Integrity mode (DSV4_SM120_INDEX_K_CHECKSUM=1): a page that comes back wrong is caught, counted, logged.

Same real stack and CPU page movers as test_hicache.py; the checksum is the
kernels area's ``page_checksum`` (its torch reference on CPU).
"""

from __future__ import annotations

import logging

import pytest
import torch

import cpu_page_mover
from pool_harness import SLOTS_PER_FULL_PAGE
from test_hicache import index_host, round_trip


def _slots(pages):
    return cpu_page_mover.pages_to_slots(torch.as_tensor(pages), SLOTS_PER_FULL_PAGE)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_clean_round_trips_pass_the_check(stacks, monkeypatch, layout):
    from dsv4_sm120.index_k.integrity import COUNTERS

    result, built, _ = stacks(layout, checksum=True)
    host = index_host(built)
    assert host.index_k_ledger is not None
    cpu_page_mover.install(monkeypatch, host)
    before = dict(COUNTERS)
    gen = torch.Generator().manual_seed(5)
    pages = torch.randperm(host.device_buffers[0].shape[0], generator=gen)[:40]
    hosts = torch.randperm(host.num_host_pages, generator=gen)[:40]
    round_trip(host, result.token_to_kv_pool.c4_indexer_kv_pool, [(pages[:13], hosts[:13]), (pages[13:], hosts[13:])], 3, gen)
    layers = len(host.device_buffers)
    assert COUNTERS["pages_recorded"] - before["pages_recorded"] == 40 * layers
    assert COUNTERS["pages_checked"] - before["pages_checked"] == 40 * layers
    assert COUNTERS["mismatches"] == before["mismatches"]


def _back_up_and_corrupt(host, device_pool, layout, gen):
    """Back up 3 pages, then flip one byte of host page 7 on layer 1 (the planted corruption)."""
    for buf in host.device_buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    host.backup_from_device_all_layer(device_pool, _slots([6, 7, 8]), _slots([10, 11, 12]), "kernel")
    host_row = host.kv_buffer[1][7] if layout == "layer_first" else host.kv_buffer[7, 1]
    host_row[1000] ^= 0x01


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_planted_corruption_is_caught_counted_and_logged(stacks, monkeypatch, caplog, layout):
    from dsv4_sm120.index_k.request_fail import QUARANTINE, CorruptPage
    from dsv4_sm120.index_k.integrity import COUNTERS

    result, built, _ = stacks(layout, checksum=True)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    cpu_page_mover.install(monkeypatch, host)
    QUARANTINE.pages.clear()
    _back_up_and_corrupt(host, device_pool, layout, torch.Generator().manual_seed(7))
    mismatches = COUNTERS["mismatches"]
    host.load_to_device_per_layer(device_pool, _slots([6, 7, 8]), _slots([20, 21, 22]), 0, "kernel")  # clean layer
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120.index_k.integrity"):
        host.load_to_device_per_layer(device_pool, _slots([6, 7, 8]), _slots([20, 21, 22]), 1, "kernel")
    assert COUNTERS["mismatches"] == mismatches + 1
    assert "layer=1 host_page=7 device_page=21" in caplog.text
    # quarantined for the scheduler hook (tests/index_k/test_integrity_request_fail.py), not raised
    assert QUARANTINE.pages == {21: CorruptPage(host.pool_name, 1, 7, 21)}
    QUARANTINE.pages.clear()


def test_without_the_mode_the_same_corruption_passes_silently(stacks, monkeypatch):
    """The control: checksum off, the planted byte lands in the device page unnoticed."""
    result, built, _ = stacks("layer_first", checksum=False)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    assert host.index_k_ledger is None
    cpu_page_mover.install(monkeypatch, host)
    _back_up_and_corrupt(host, device_pool, "layer_first", torch.Generator().manual_seed(7))
    original = host.device_buffers[1][11].clone()
    host.load_to_device_per_layer(device_pool, _slots([6, 7, 8]), _slots([20, 21, 22]), 1, "kernel")
    assert int((host.device_buffers[1][21] != original).sum()) == 1

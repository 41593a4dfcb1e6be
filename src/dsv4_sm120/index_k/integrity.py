"""Integrity mode for bf16 index-K pages moved by HiCache (``DSV4_SM120_INDEX_K_CHECKSUM=1``).

A page that comes back from host with a few wrong bytes does not crash
anything: it silently changes the indexer's discrete top-512 selection and the
output degrades into "token salad". In integrity mode every index-K page row is
checksummed when it is backed up (before the copy is issued, on the same
stream, so the sum is of what the device held when the backup started) and
checked again right after it is loaded back. A mismatch increments
:data:`COUNTERS` ``["mismatches"]``, logs layer, host page and device page, and
quarantines the device page (:mod:`.request_fail`), which fails the requests
whose prefix reads it instead of letting them run on it. Nothing is raised from
the load: it runs inside the scheduler's step, for all admitted requests at once.

The checksum is the kernels area's ``page_checksum`` (Triton on CUDA, its torch
reference elsewhere). The check needs the comparison on the host, so it
synchronizes the load stream once per loaded layer: this is a diagnostic mode.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("dsv4_sm120.index_k.integrity")

# Process-wide counters, read by tests and by whoever exports metrics. The ``pd_`` ones count
# the PD (NIXL) send/receive check of :mod:`.pd_integrity`: pages checksummed on send and on
# receive, mismatching pages, rooms failed, rooms received without a checksum frame.
COUNTERS = {"pages_recorded": 0, "pages_checked": 0, "mismatches": 0, "requests_failed": 0,
            "pd_pages_recorded": 0, "pd_pages_checked": 0, "pd_mismatches": 0, "pd_rooms_failed": 0,
            "pd_rooms_unchecked": 0}


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to ``COUNTERS[name]`` and to its ``sglang:dsv4_index_k_<name>_total`` counter."""
    from dsv4_sm120 import metrics

    COUNTERS[name] += n
    metrics.inc(f"index_k_{name}_total", n)


def _checksum(rows: torch.Tensor) -> torch.Tensor:
    from dsv4_sm120.kernels.page_checksum import page_checksum

    return page_checksum(rows)


class PageLedger:
    """Expected checksum of every (layer, host page) of one index-K host mirror."""

    def __init__(self, num_layers: int, num_host_pages: int, device):
        from dsv4_sm120 import metrics
        from dsv4_sm120.index_k.request_fail import QUARANTINE, sample_gauges

        QUARANTINE.active = True  # the scheduler hook now agrees on failed requests every prefill step
        metrics.add_sampler(sample_gauges)
        self.expected = torch.zeros(num_layers, num_host_pages, dtype=torch.int64, device=device)
        self.recorded = torch.zeros(num_layers, num_host_pages, dtype=torch.bool, device=device)

    def record(self, layer: int, host_pages: torch.Tensor, device_rows: torch.Tensor) -> None:
        """Checksum the device page rows about to be backed up into ``host_pages``."""
        host_pages = host_pages.to(self.expected.device)
        self.expected[layer, host_pages] = _checksum(device_rows)
        self.recorded[layer, host_pages] = True
        count("pages_recorded", int(host_pages.numel()))

    def verify(self, layer: int, host_pages: torch.Tensor, device_pages: torch.Tensor,
               loaded_rows: torch.Tensor, pool_name: str = "index_k") -> list:
        """Compare the loaded rows with the checksums taken at backup; quarantine and return the bad pages."""
        from dsv4_sm120.index_k.request_fail import QUARANTINE, CorruptPage

        if layer == 0 and QUARANTINE.pages:
            # A load writes every layer of its device pages, first layer first: whatever was
            # quarantined there is overwritten; this load's own mismatches quarantine them again.
            QUARANTINE.clear(device_pages.cpu().tolist())
        host_pages = host_pages.to(self.expected.device)
        bad = (_checksum(loaded_rows) != self.expected[layer, host_pages]) & self.recorded[layer, host_pages]
        count("pages_checked", int(host_pages.numel()))
        bad = bad.cpu()
        if not bool(bad.any()):
            return []
        where = bad.nonzero().flatten()
        count("mismatches", int(where.numel()))
        found = [CorruptPage(pool_name, layer, int(host_pages[i]), int(device_pages[i])) for i in where]
        for page in found:
            logger.error("index-K checksum mismatch: pool=%s layer=%d host_page=%d device_page=%d",
                         page.pool, page.layer, page.host_page, page.device_page)
            QUARANTINE.report(page)
        return found

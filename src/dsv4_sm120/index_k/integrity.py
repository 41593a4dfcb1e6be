"""Integrity mode for bf16 index-K pages moved by HiCache (``DSV4_SM120_INDEX_K_CHECKSUM=1``).

A page that comes back from host with a few wrong bytes, or that is read before its load has
landed, does not crash anything: it silently changes the indexer's discrete top-512 selection
and the output degrades into "token salad". Integrity mode checks each loaded page where that
happens, at its reader:

- **Backup** (:meth:`PageLedger.record`, on HiCache's device-to-host stream, before the copy
  is issued): the checksum of every page row of every layer is kept per (layer, host page).
- **Load** (:meth:`PageLedger.note_load`, inside upstream's per-layer load): the load's host
  and device indices are noted under the load's producer slot of upstream's
  ``LayerDoneCounter``, the slot the batch that reads them consumes. No GPU work, no wait.
- **Read** (:meth:`PageLedger.check_reads`, called by the C4 indexer of a prefill forward (the only kind
  that consumes a load; ``model.deepseek_v4.reads_checked``) just before its logits
  kernel, on the indexer's stream and in its order): the loaded pages of that layer are
  checksummed as they are at that moment and compared with their backups on the GPU. A page
  whose load has not landed when the indexer reads it, or that a late write overwrote after
  it landed, holds other bytes than its backup and mismatches. The verdicts of all the
  forward's layers go to pinned host memory in one non-blocking copy, queued behind the last
  layer's comparison (one copy a forward, not two a layer: on a Hopper GPU the per-layer copies were
  about half of the check's host time, ``bench/results/gpu_serving/gpu_serving_h100_2026-12-06_checksum_54feba8.json``).
- **Verdict** (:meth:`PageLedger.collect`, in the scheduler's processing of that batch's
  result, after upstream's own wait for the batch's outputs): mismatches are counted, logged
  with layer, host page and device page, and quarantined (:mod:`.request_fail`), which fails
  the requests that read them with HTTP 500 and later requests whose prefix still matches them.

So the check adds no host synchronization to the copy path or to the forward, and it cannot
close the window it watches: the pages are compared as the indexer finds them. A loaded page
is a whole tree page (64 compressed keys of 256 complete tokens; the bf16 mirror refuses
partial pages), and a forward writes new keys only into its freshly allocated pages, so a
loaded page's backup checksum is still what it must hold when the indexer reads it.

What is counted: ``page_checks`` (one per loaded page and layer, at its first read after the
load), of them ``pages_verified`` (a backed-up page content checked for the first time: the
distinct pages) and ``page_rechecks`` (the same content loaded and checked again); pages
loaded with no checksum on record (backed up before integrity mode recorded them) are
``pages_unrecorded`` and never counted as checked.

The checksum is the kernels area's ``page_checksum``; record, check and the key-write check are one
launch each (``kernels.page_ledger``: Triton on CUDA, its torch references elsewhere).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dsv4_sm120 import metrics
from dsv4_sm120.kernels import page_ledger

logger = logging.getLogger("dsv4_sm120.index_k.integrity")

# Process-wide counters, read by tests and exported as ``sglang:dsv4_index_k_<name>_total``. The ``pd_``
# ones count the PD (NIXL) send/receive check of :mod:`.pd_integrity`.
COUNTERS = {"pages_recorded": 0, "page_checks": 0, "pages_verified": 0, "page_rechecks": 0,
            "pages_unrecorded": 0, "mismatches": 0, "key_writes_checked": 0, "key_writes_lost": 0,
            "requests_failed": 0,
            "pd_pages_recorded": 0, "pd_pages_checked": 0, "pd_mismatches": 0, "pd_rooms_failed": 0,
            "pd_rooms_unchecked": 0}

LEDGER = None  # the process's PageLedger once an integrity-mode index-K host mirror is built

OK, MISMATCH, UNRECORDED = 0, 1, page_ledger.NO_RECORD  # a read row's verdict, as kernels.page_ledger writes it
WRITES = -1  # the host page of a lost key write's CorruptPage
SLOT_BYTES = 256  # one compressed bf16 key: a row of the page-row buffer seen as [num_pages * 64, 256]


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to ``COUNTERS[name]`` and to its ``sglang:dsv4_index_k_<name>_total`` counter."""
    COUNTERS[name] += n
    metrics.inc(f"index_k_{name}_total", n)


@dataclass(frozen=True)
class CorruptPage:
    """One bf16 index-K page row that the indexer found unlike its backup."""

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


class _Load:
    """One HiCache load's token indices as upstream passes them to every layer's copy, and their copies on the
    GPU, made at the load's first read and reused by its other layers' reads on the same stream."""

    def __init__(self, host_indices: torch.Tensor, device_indices: torch.Tensor, slots_per_page: int):
        self.host_indices, self.device_indices, self.slots_per_page = host_indices, device_indices, slots_per_page
        self.on_gpu: dict = {}  # (device, stream) -> (device indices, host indices) there

    def indices_on(self, device: torch.device, host_device: torch.device) -> tuple:
        """(device indices, host indices) where the reader's stream reads them, copied without a host wait."""
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        key = (device, stream)
        if key not in self.on_gpu:
            pair = on_device(device, self.device_indices), on_device(host_device, self.host_indices)
            for indices in pair:
                if indices.device.type == "cuda":  # upstream may free its index tensors before this stream reads
                    indices.record_stream(torch.cuda.current_stream(indices.device))
            self.on_gpu[key] = pair
        return self.on_gpu[key]


@dataclass
class _Writes:
    """One layer's key stores in a forward that loads: their slots and checksums right after the store."""

    slots: torch.Tensor
    sums: torch.Tensor


@dataclass
class _Report:
    """A forward's verdicts on their way to the host, every layer's flattened into ``values`` one after the other:
    per ``parts`` entry (layer, writes, count) either a load's read verdicts, ``count`` rows of 4 (host page, device
    page, verdict, first check), or for ``writes`` one value per stored key
    (:func:`~dsv4_sm120.kernels.page_ledger.lost_keys`)."""

    parts: list
    values: torch.Tensor
    landed: object  # a CUDA event recorded behind the copy, None off CUDA

    def each(self):
        """(layer, writes, verdicts) per part, the verdicts as a numpy array ([count, 4] for reads)."""
        values, at = self.values.numpy(), 0
        for layer, writes, n in self.parts:
            size = n if writes else 4 * n
            yield layer, writes, values[at:at + size] if writes else values[at:at + size].reshape(n, 4)
            at += size


def on_device(device: torch.device, indices: torch.Tensor) -> torch.Tensor:
    """``indices`` on ``device`` without a host wait (pinned staging for a CPU tensor going to a GPU)."""
    if indices.device == device:
        return indices
    if device.type == "cuda" and indices.device.type == "cpu":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


def pinned_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A CUDA ``tensor`` copied to pinned host memory behind the current stream's work, without a host wait, and
    the event recorded behind the copy: read the copy once the event has completed."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record()
    return host, landed


class PageLedger:
    """Backup checksums of one index-K host mirror, the loads in flight and the reader's verdicts."""

    def __init__(self, num_layers: int, num_host_pages: int, device, pool_name: str = "index_k",
                 kvcache=None):
        QUARANTINE.active = True  # the scheduler hooks now fail requests that read a corrupt page
        metrics.add_sampler(sample_gauges)
        self.device = torch.device(device)
        self.pool_name = pool_name
        self.kvcache = kvcache  # the device KV pool whose load fence the readers take
        self.expected = torch.zeros(num_layers, num_host_pages, dtype=torch.int64, device=self.device)
        self.recorded = torch.zeros(num_layers, num_host_pages, dtype=torch.uint8, device=self.device)
        self.verified = torch.zeros(num_layers, num_host_pages, dtype=torch.uint8, device=self.device)
        self.loads: dict[int, dict[int, list[_Load]]] = {}  # producer slot -> layer -> loads
        self.latest: dict[int, _Load] = {}  # producer slot -> its latest load (the one its next layers share)
        self.writes: dict[int, dict[int, list[_Writes]]] = {}  # consumer slot -> layer -> key stores
        self.verdicts: dict[int, list] = {}  # consumer slot -> (layer, writes, verdicts on the GPU) not yet copied
        self.reports: dict[int, list[_Report]] = {}  # consumer slot -> verdicts in flight
        self.last_layer = num_layers - 1  # the forward's last C4 read: its verdicts go to the host behind it

    @property
    def counter(self):
        """Upstream's ``LayerDoneCounter`` as registered on the device pool now: a load's producer slot, a
        forward's consumer slot. Read at every call, never kept: upstream registers the cache controller's
        counter on the pool after the stack is built, and its hybrid controller replaces the counter it
        started with (on a Hopper GPU a ledger holding the first one saw every forward consume slot -1 and
        checked nothing)."""
        return getattr(self.kvcache, "layer_transfer_counter", None)

    # --- backup (HiCache's device-to-host stream) ---------------------------------------------
    def record(self, layer: int, host_pages: torch.Tensor, rows: torch.Tensor, device_pages: torch.Tensor) -> None:
        """Checksum the page rows ``rows[device_pages]`` about to be backed up into ``host_pages`` (both page
        numbers on the ledger's device)."""
        page_ledger.record_pages(rows, device_pages, host_pages, self.expected, self.recorded, self.verified, layer)
        count("pages_recorded", int(host_pages.numel()))

    # --- load (inside upstream's per-layer load) ----------------------------------------------
    def note_load(self, layer: int, host_indices: torch.Tensor, device_indices: torch.Tensor,
                  slots_per_page: int) -> None:
        """Note one layer's load for the forward that consumes it; issues no GPU work. Upstream passes one
        load's index tensors to every layer's copy: the layers share one :class:`_Load`."""
        counter = self.counter
        slot = counter.producer_index if counter is not None else 0
        load = self.latest.get(slot)
        if load is None or load.host_indices is not host_indices or load.device_indices is not device_indices:
            load = self.latest[slot] = _Load(host_indices, device_indices, slots_per_page)
        self.loads.setdefault(slot, {}).setdefault(layer, []).append(load)

    # --- read (the C4 indexer's stream, just before its logits kernel) ------------------------
    def check_reads(self, layer: int, rows: torch.Tensor) -> None:
        """Compare this layer's pages loaded for the running forward with their backups, as they are now.

        ``rows`` is the layer's uint8 page-row buffer [num_pages, 16384]. Queues one launch per load (and
        one per key store), and at the forward's last C4 layer one copy of all its verdicts; never waits.
        """
        slot = self._consumer(rows)
        if slot < 0:
            return
        verdicts = self.verdicts.setdefault(slot, [])
        for writes in self.writes.get(slot, {}).pop(layer, []):
            keys = rows.view(-1, SLOT_BYTES)
            lost = page_ledger.lost_keys(keys, writes.slots, writes.sums, keys.shape[0] // rows.shape[0])
            verdicts.append((layer, True, lost))
        for load in self.loads.get(slot, {}).pop(layer, []):
            device_indices, host_indices = load.indices_on(rows.device, self.device)
            report = page_ledger.check_pages(rows, device_indices, host_indices, load.slots_per_page, self.expected,
                                             self.recorded, self.verified, layer)
            verdicts.append((layer, False, report))
        if layer == self.last_layer:
            self._send(slot)

    def _consumer(self, rows: torch.Tensor) -> int:
        """The load slot of the running forward, -1 without one (decode graphs never load, nor check)."""
        if rows.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return -1
        counter = self.counter
        return counter.consumer_index if counter is not None else 0

    # --- the writer side: a key a forward stored must still be there when it reads the layer -----
    def note_writes(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Checksum the keys a forward that loads just stored at compressed ``slots`` (-1: none), right after
        the store on its stream; :meth:`check_reads` checks them again at the layer's read. A load landing on
        those slots in between (a key write lost to a later load) shows as a lost write."""
        slot = self._consumer(rows)
        if slot < 0 or not slots.numel():
            return
        sums = page_ledger.key_sums(rows.view(-1, SLOT_BYTES), slots)
        self.writes.setdefault(slot, {}).setdefault(layer, []).append(_Writes(slots, sums))

    def _send(self, slot: int) -> None:
        """The verdicts of the forward that consumes ``slot`` so far, to the host in one non-blocking copy."""
        verdicts = self.verdicts.pop(slot, [])
        if not verdicts:
            return
        parts = [(layer, writes, int(v.shape[0])) for layer, writes, v in verdicts]
        values = torch.cat([v.reshape(-1) for _, _, v in verdicts])
        if values.device.type != "cuda":
            self.reports.setdefault(slot, []).append(_Report(parts, values, None))
            return
        self.reports.setdefault(slot, []).append(_Report(parts, *pinned_copy(values)))

    # --- verdict (the scheduler, processing the result of the forward that read the pages) ----
    def collect(self, slot: int) -> list[CorruptPage]:
        """Count the verdicts of the forward that consumed load ``slot``; quarantine and return the bad pages.

        Called after upstream waited for that forward's outputs, which come after every verdict on
        its stream, so each copy has landed; one that has not (a forward on another stream) is waited
        for here, in the result processing, never in the copy path or the forward. The reports are read
        as arrays (a forward that loads checks thousands of page rows).
        """
        found: list[CorruptPage] = []
        self.loads.pop(slot, None)  # the forward is done: what it did not read (no C4 layer ran) is dropped
        self.latest.pop(slot, None)
        self.writes.pop(slot, None)
        self._send(slot)  # a forward that did not reach its last C4 layer (its copy is waited for just below)
        totals = dict.fromkeys(("key_writes_checked", "key_writes_lost", "page_checks", "pages_verified",
                                "page_rechecks", "pages_unrecorded"), 0)
        for report in self.reports.pop(slot, []):
            if report.landed is not None and not report.landed.query():
                report.landed.synchronize()
            for layer, writes, rows in report.each():
                if writes:
                    lost = rows[rows >= 0]
                    totals["key_writes_checked"] += int((rows != page_ledger.NO_SLOT).sum())
                    if lost.size:
                        totals["key_writes_lost"] += int(lost.size)
                        logger.error("index-K key write lost: layer=%d device_page=%d and %d key(s) in all changed "
                                     "between their store and the C4 indexer's read (a load landed on them)",
                                     layer, int(lost.min()), lost.size)
                        found.append(CorruptPage(self.pool_name, layer, WRITES, int(lost.min())))
                    continue
                # A load writes every layer of its device pages: whatever was quarantined there is gone now;
                # this load's own mismatches quarantine them again.
                if QUARANTINE.pages:
                    QUARANTINE.clear(rows[:, 1].tolist())
                checked = rows[rows[:, 2] != UNRECORDED]
                first = int(checked[:, 3].sum())
                totals["page_checks"] += len(checked)
                totals["pages_verified"] += first
                totals["page_rechecks"] += len(checked) - first
                totals["pages_unrecorded"] += len(rows) - len(checked)
                for host_page, device_page in rows[rows[:, 2] == MISMATCH][:, :2].tolist():
                    found.append(CorruptPage(self.pool_name, layer, host_page, device_page))
        for name, n in totals.items():
            if n:
                count(name, n)
        if any(page.host_page != WRITES for page in found):
            count("mismatches", sum(page.host_page != WRITES for page in found))
        for page in found:
            if page.host_page == WRITES:
                QUARANTINE.report(page)
                continue
            logger.error("index-K checksum mismatch at read: pool=%s layer=%d host_page=%d device_page=%d "
                         "(the page the C4 indexer read differs from its HiCache backup)",
                         page.pool, page.layer, page.host_page, page.device_page)
            QUARANTINE.report(page)
        return found


def check_reads(pool, layer_id: int, rows: torch.Tensor) -> None:
    """The C4 indexer's read of layer ``layer_id`` (a model layer id of ``pool``'s stage): check its loaded pages."""
    if LEDGER is not None:
        LEDGER.check_reads(pool.layer_mapping[layer_id].compress_layer_id, rows)


def note_writes(pool, layer_id: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """The C4 indexer's key store into layer ``layer_id``: keep what it wrote, to be found again at the read."""
    if LEDGER is not None:
        LEDGER.note_writes(pool.layer_mapping[layer_id].compress_layer_id, rows, slots)

"""The fixes' counters and gauges on sglang's ``/metrics``, named like upstream's (``sglang:dsv4_*``).

Upstream's scheduler metrics are ``prometheus_client`` collectors in multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher), created in each
scheduler process when ``--enable-metrics`` is on; the HTTP server's ``/metrics``
merges every process's files. The same holds here: an AFTER hook on
``Scheduler.init_metrics_collector`` calls :func:`enable` in each scheduler
process with metrics on, and from then on :func:`inc` and the gauge samplers
write to those files. Without ``--enable-metrics`` (and in every other process:
the CLI, the loopback harness) every call is a no-op, so the fixes count the
same way whether or not anyone scrapes.

Gauges that describe a thread's state (is the NIXL bootstrap thread alive?) are
sampled by one daemon thread every :data:`SAMPLE_EVERY_S`: a dead thread cannot
report its own death. The same thread publishes counters kept as plain totals
where they grow on every call (:mod:`dsv4_sm120.hook_time`): a sampler gives a
counter's total so far, and the counter is increased by what it gained since.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("dsv4_sm120.metrics")

SAMPLE_EVERY_S = 1.0

# name (without the ``sglang:dsv4_`` prefix) -> (kind, help, label names[, multiprocess mode for gauges])
SPECS: dict[str, tuple] = {
    # NIXL bootstrap hardening
    "nixl_frames_served_total": ("counter", "Bootstrap frames the hardened NIXL prefill thread handled", ()),
    "nixl_frames_rejected_total": ("counter", "Bootstrap frames refused by the hardened NIXL prefill thread, by reason", ("reason",)),
    "nixl_late_frames_dropped_total": ("counter", "Transfer-info frames dropped because their room was already aborted", ()),
    "nixl_aborts_handled_total": ("counter", "ABORT frames from the decode side handled by the NIXL prefill thread", ()),
    "nixl_rooms_tombstoned_total": ("counter", "Rooms remembered as aborted so late frames cannot reopen them", ()),
    "nixl_aborted_rooms_released_total": ("counter", "Aborted rooms no prefill sender held, dropped from the NIXL manager's tables", ()),
    "nixl_orphan_rooms_released_total": ("counter", "Rooms no prefill request held or would clear (failed, or announced and never claimed), dropped from the NIXL manager's tables", ("reason",)),
    "nixl_rooms_failed_fast_total": ("counter", "Rooms failed at once with a reason instead of waiting for the bootstrap timeout", ("reason",)),
    "nixl_decode_told_failed_total": ("counter", "Rooms the prefill failed on its own, told to their decode (at once, or on its transfer info)", ("when",)),
    "nixl_bootstrap_threads_alive": ("gauge", "Hardened NIXL prefill bootstrap threads alive and polling", (), "livesum"),
    "nixl_transfer_workers_stuck": ("gauge", "NIXL transfer workers dead or holding one chunk past the stall limit", (), "livesum"),
    "nixl_health_problems": ("gauge", "Reasons the NIXL prefill side cannot serve; /health fails while > 0", (), "livesum"),
    "nixl_rooms_open": ("gauge", "Bootstrap rooms the NIXL manager tracks (request_status entries)", ("mode",), "livesum"),
    "nixl_transfer_infos_open": ("gauge", "Rooms with decode transfer info held by the NIXL prefill manager", (), "livesum"),
    # PD abort safety: no decode page back to the allocator while a NIXL write may still land on it
    "nixl_abort_acks_withheld_total": ("counter", "Abort acknowledgements the NIXL prefill held back while the room still had writes in flight", ()),
    "nixl_abort_acks_sent_after_drain_total": ("counter", "Abort acknowledgements sent once a held-back room drained", ()),
    "nixl_rooms_parked_total": ("counter", "Rooms whose NIXL handles were still running when the transfer worker gave up waiting", ()),
    "pd_quarantines_total": ("counter", "Aborted rooms whose decode pages were kept out of the allocator past the deferred-release timeout", ()),
    "pd_quarantine_released_total": ("counter", "Quarantined rooms released, by why (drained: the prefill acknowledged; prefill_lost)", ("why",)),
    "pd_rooms_quarantined": ("gauge", "Aborted rooms whose decode pages are quarantined now", (), "livesum"),
    "pd_tokens_quarantined": ("gauge", "KV tokens the quarantined rooms keep out of the allocator now", (), "livesum"),
    "pd_pages_watched_total": ("counter", "Decode pages received over NIXL whose checksum was taken when the receive completed (per watched buffer)", ()),
    "pd_page_rereads_total": ("counter", "Received page rows re-read and compared at their request's decode forwards", ()),
    "pd_late_writes_total": ("counter", "Received pages found changed while their request decoded (a late NIXL write), once per request and page", ()),
    "pd_late_write_requests_failed_total": ("counter", "Requests failed because a late NIXL write changed their received KV", ()),
    "pd_late_write_holds_released_total": ("counter", "Requests failed for a late write whose held KV went back to the allocator, by why (waited: the hold time passed and the aborted rooms held at the verdict were released; prefill_lost)", ("why",)),
    "pd_late_write_tokens_held": ("gauge", "KV tokens of requests failed for a late write, kept out of the allocator now", (), "livesum"),
    # index-K integrity (HiCache and PD)
    "index_k_pages_recorded_total": ("counter", "bf16 index-K page rows checksummed at HiCache backup", ()),
    "index_k_page_checks_total": ("counter", "bf16 index-K page rows HiCache loaded, checked where the C4 indexer read them", ()),
    "index_k_pages_verified_total": ("counter", "Of those, distinct backed-up page contents checked for the first time", ()),
    "index_k_page_rechecks_total": ("counter", "Of those, page contents already checked once, loaded and checked again", ()),
    "index_k_pages_unrecorded_total": ("counter", "bf16 index-K page rows loaded with no backup checksum on record (not checked)", ()),
    "index_k_mismatches_total": ("counter", "bf16 index-K page rows the C4 indexer read unlike their HiCache backup", ()),
    "index_k_key_writes_checked_total": ("counter", "bf16 index keys a loading forward stored, found again at the C4 indexer's read", ()),
    "index_k_key_writes_lost_total": ("counter", "bf16 index keys stored and changed before the C4 indexer's read (a load landed on them)", ()),
    "index_k_requests_failed_total": ("counter", "Requests failed because they read a corrupt index-K page", ()),
    "index_k_pages_quarantined": ("gauge", "Device index-K pages quarantined after a checksum mismatch", (), "livesum"),
    "index_k_pd_pages_recorded_total": ("counter", "bf16 index-K pages checksummed when queued for a NIXL send", ()),
    "index_k_pd_pages_checked_total": ("counter", "bf16 index-K pages verified when the decode's receive reported Success", ()),
    "index_k_pd_mismatches_total": ("counter", "bf16 index-K pages that arrived over NIXL different from what was sent", ()),
    "index_k_pd_rooms_failed_total": ("counter", "PD rooms failed because an index-K page arrived corrupt", ()),
    "index_k_pd_rooms_unchecked_total": ("counter", "PD rooms received without a checksum frame (peer without the switch)", ()),
    # collective guard (labelled with the overlap loop it watches)
    "guard_divergences_seen_total": ("counter", "Overlap-loop iterations whose TP ranks disagreed on queues or batch state", ("loop",)),
    "guard_divergences_reconciled_total": ("counter", "Divergences the guard reconciled by aborting requests not held by every rank", ("loop",)),
    "guard_requests_aborted_total": ("counter", "Requests aborted by the guard because not every TP rank held them", ("loop",)),
    "guard_fail_fasts_total": ("counter", "Times the guard stopped the scheduler because reconciliation failed", ("loop",)),
    # what each fix costs where it runs (hook_time)
    "hook_seconds_total": ("counter", "Seconds the package's hooks and loop call ran, the upstream calls they wrap left out, by fix and thread (main: a scheduler's loop)", ("fix", "thread")),
    "hook_calls_total": ("counter", "Calls of the package's hooks and loop call, by fix and thread (main: a scheduler's loop)", ("fix", "thread")),
}

_lock = threading.Lock()
_metrics: dict = {}
_labels: dict[str, str] = {}
_samplers: list[Callable[[], dict]] = []
_published: dict[tuple, float] = {}  # (counter name, label values) -> the total a sampler gave last
_sampler_thread: threading.Thread | None = None


def exposed_names() -> set[str]:
    """Every sample name the package's collectors can put on /metrics (counters carry ``_total``)."""
    return {f"sglang:dsv4_{name}" for name in SPECS}


def enable(tp_rank: int) -> None:
    """Create every ``sglang:dsv4_*`` collector in this process (once) and start the gauge sampler."""
    global _sampler_thread
    from prometheus_client import Counter, Gauge

    with _lock:
        if _metrics:
            return
        _labels["tp_rank"] = str(tp_rank)
        for name, spec in SPECS.items():
            kind, doc, labels = spec[:3]
            full = f"sglang:dsv4_{name.removesuffix('_total')}" if kind == "counter" else f"sglang:dsv4_{name}"
            names = ("tp_rank", *labels)
            if kind == "counter":
                _metrics[name] = Counter(full, doc, names)
            else:
                _metrics[name] = Gauge(full, doc, names, multiprocess_mode=spec[3])
            if not labels:  # shown as 0 from the start, so a dashboard's query has a series before the first event
                _metrics[name].labels(**_labels)
        _sampler_thread = threading.Thread(target=_sample_forever, name="dsv4-metrics-sampler", daemon=True)
        _sampler_thread.start()
    logger.info("dsv4-sm120: %d sglang:dsv4_* metrics enabled on tp_rank=%s", len(SPECS), tp_rank)


def inc(name: str, n: float = 1, **labels: str) -> None:
    """Add ``n`` to counter ``name`` (a key of :data:`SPECS`); nothing when metrics are off."""
    metric = _metrics.get(name)
    if metric is not None and n:
        metric.labels(**_labels, **labels).inc(n)


def add_sampler(fn: Callable[[], dict]) -> None:
    """Register ``fn() -> {gauge or counter name: value or {label tuple: value}}``, called every
    :data:`SAMPLE_EVERY_S`; a counter's value is its total so far."""
    with _lock:
        if fn not in _samplers:
            _samplers.append(fn)


def sample_once() -> None:
    """Set every gauge, and bring every counter up to its total, from the registered samplers (the sampler
    thread's body; tests call it directly)."""
    with _lock:
        samplers = list(_samplers)
    for fn in samplers:
        try:
            values = fn()
        except Exception:  # noqa: BLE001 - a sampler must never take the thread down
            logger.exception("dsv4-sm120: metrics sampler %s failed", getattr(fn, "__name__", fn))
            continue
        for name, value in values.items():
            metric = _metrics.get(name)
            if metric is None:
                continue
            for label_values, v in (value.items() if isinstance(value, dict) else [((), value)]):
                series = metric.labels(**_labels, **dict(zip(SPECS[name][2], label_values)))
                if SPECS[name][0] == "counter":
                    gained = v - _published.get((name, label_values), 0.0)
                    _published[(name, label_values)] = v
                    if gained > 0:
                        series.inc(gained)
                else:
                    series.set(v)


def _sample_forever() -> None:
    import time

    while True:
        sample_once()
        time.sleep(SAMPLE_EVERY_S)


def enable_for_scheduler(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.init_metrics_collector``: metrics on in this scheduler process when sglang's are."""
    if getattr(scheduler.server_args, "enable_metrics", False):
        from sglang.srt.runtime_context import get_parallel  # the pin's schedulers keep no tp_rank attribute

        enable(get_parallel().tp_rank)
    return result


# Where ``plugin.register`` hooks :func:`enable_for_scheduler` (every fix's counters go through this module).
SCHEDULER_HOOK = "sglang.srt.managers.scheduler.Scheduler.init_metrics_collector"

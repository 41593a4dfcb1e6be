"""What a scenario checks on a real PD set after the fact: health everywhere, nothing left behind.

"Nothing left" is read from the servers themselves, through ``/metrics``:
upstream's scheduler gauges (running and queued requests, the PD queues, KV
tokens in use) and the package's NIXL gauges (rooms and transfer infos the
prefill manager still holds). A storm's aborted requests take a moment to be
released, so :func:`settle` waits (bounded) until every figure is back to idle.
"""

from __future__ import annotations

import time

from harness import scrape
from harness.servers import http

# Upstream gauges that must be 0 on an idle PD server (sglang 0.5.23 scheduler metrics).
IDLE_ZERO = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:num_used_tokens",
    "sglang:dsv4_nixl_rooms_open",
    "sglang:dsv4_nixl_transfer_infos_open",
)


def health(cluster) -> dict[str, int]:
    """HTTP status of /health on each process of the set, by role (0: no answer)."""
    roles = {"prefill": cluster.prefill, "decode": cluster.decode, "router": cluster.router, "single": cluster.single}
    return {role: http("GET", p.url + "/health", timeout=30)[0] for role, p in roles.items() if p is not None}


def leftovers(cluster, only=None) -> dict[str, float]:
    """Every IDLE_ZERO figure that is not 0 now, per server (``name@server``); ``only``: those servers."""
    out = {}
    for proc in only or (cluster.prefill, cluster.decode):
        samples = scrape.metrics(proc.url)
        present = scrape.names(samples)
        for name in IDLE_ZERO:
            if name in present and scrape.total(samples, name) != 0:
                out[f"{name}@{proc.name}"] = scrape.total(samples, name)
    return out


def released(cluster, since: float, timeout: float, only=None) -> tuple[dict[str, float], float | None]:
    """:func:`settle`, and the seconds from ``since`` (a ``time.monotonic()``) to the poll that first found nothing
    left: None when something was still held at ``timeout`` (the wait gave up; what is left says what)."""
    left = settle(cluster, timeout, only)
    return left, None if left else round(time.monotonic() - since, 1)


def settle(cluster, timeout: float = 90.0, only=None) -> dict[str, float]:
    """Wait until nothing is left (or ``timeout``); what is still left then (empty: clean)."""
    deadline = time.monotonic() + timeout
    left = leftovers(cluster, only)
    while left and time.monotonic() < deadline:
        time.sleep(2.0)
        left = leftovers(cluster, only)
    return left


def dsv4_counters(cluster) -> dict[str, float]:
    """Every sglang:dsv4_* sample on prefill and decode, summed over labels but reason (``name{reason}``)."""
    out: dict[str, float] = {}
    for proc in (cluster.prefill, cluster.decode):
        for name, labels, value in scrape.metrics(proc.url):
            if name.startswith("sglang:dsv4_"):
                key = f"{name}{{{labels['reason']}}}" if "reason" in labels else name
                out[key] = out.get(key, 0.0) + value
    return out


def delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))
            if after.get(k, 0.0) != before.get(k, 0.0)}

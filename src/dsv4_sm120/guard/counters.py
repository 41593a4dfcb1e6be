"""Counters of the collective guard: in the log line of every event, and in sglang's metrics.

Upstream's scheduler metrics are Prometheus collectors (multiprocess mode, the
``sglang:`` prefix) created only when ``--enable-metrics`` is on; the guard adds
its own three counters beside them under the same condition.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    divergences_seen: int = 0
    divergences_reconciled: int = 0
    requests_aborted: int = 0
    fail_fasts: int = 0
    _prom: dict = field(default_factory=dict, repr=False)

    def enable_metrics(self, loop: str) -> None:
        """Create the Prometheus counters (call once, only when upstream's metrics are on)."""
        from prometheus_client import Counter

        doc = {
            "divergences_seen": "Overlap-loop iterations whose TP ranks disagreed on queues or batch state",
            "divergences_reconciled": "Divergences the guard reconciled by aborting requests not held by every rank",
            "requests_aborted": "Requests aborted by the guard because not every TP rank held them",
            "fail_fasts": "Times the guard stopped the scheduler because reconciliation failed",
        }
        for name, text in doc.items():
            self._prom[name] = Counter(f"sglang:dsv4_guard_{name}_total", text, ["loop"]).labels(loop=loop)

    def add(self, name: str, n: int = 1) -> None:
        setattr(self, name, getattr(self, name) + n)
        prom = self._prom.get(name)
        if prom is not None:
            prom.inc(n)

    def line(self) -> str:
        return (
            f"seen={self.divergences_seen} reconciled={self.divergences_reconciled} "
            f"aborted={self.requests_aborted} fail_fasts={self.fail_fasts}"
        )

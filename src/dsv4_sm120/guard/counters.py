"""Counters of the collective guard: in the log line of every event, and on sglang's ``/metrics``.

The values are kept here for the log lines; each addition also goes to its ``sglang:dsv4_guard_<name>_total``
counter through :func:`dsv4_sm120.metrics.inc` (declared in ``metrics.SPECS`` like every other), labelled with
the overlap loop the guard watches; without ``--enable-metrics`` that is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_sm120 import metrics


@dataclass
class Counters:
    divergences_seen: int = 0
    divergences_reconciled: int = 0
    requests_aborted: int = 0
    fail_fasts: int = 0
    loop: str = ""  # the ``loop`` label: the overlap loop of this process's scheduler, once the guard runs

    def add(self, name: str, n: int = 1) -> None:
        setattr(self, name, getattr(self, name) + n)
        metrics.inc(f"guard_{name}_total", n, loop=self.loop)

    def line(self) -> str:
        return (
            f"seen={self.divergences_seen} reconciled={self.divergences_reconciled} "
            f"aborted={self.requests_aborted} fail_fasts={self.fail_fasts}"
        )

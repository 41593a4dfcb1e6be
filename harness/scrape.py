"""Reading a real server's ``/metrics`` (Prometheus text) and sglang's own queue and memory figures."""

from __future__ import annotations

import re

from harness.servers import http

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metrics(url: str) -> list[tuple[str, dict, float]]:
    """Every sample of ``url/metrics`` as (name, labels, value); empty when the server does not answer."""
    status, body = http("GET", url + "/metrics", timeout=20)
    if status != 200:
        return []
    out = []
    for line in body.decode(errors="replace").splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def total(samples, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items()))


def by_label(samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name:
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def names(samples) -> set[str]:
    return {n for n, _, _ in samples}

"""CPU time of each server's process tree per level: whether a server burns cores while another one is driven.

Why: the agents set's two PD pairs, alike but for switches that do nothing per step at one TP rank, ran their
prefill batches 12% apart on a GPU host of 16 CPUs, in every round, the whole distribution shifted. Every
server stays up while the others are driven, and sglang's scheduler loops, its tokenizer and detokenizer and
NIXL's progress threads may poll while idle; a server that spins takes cores from the one being driven, and
which cores each process lands on is the operating system's choice at every start. So each level's record
says how many CPU-seconds every server spent during it, driven or idle, and :func:`cores` sums them up.

A process tree's time is read from ``/proc``: the user and system time of the process and of every
descendant (each process's figure covers all its threads). Time of descendants that exited during the level
is not counted (sglang's processes live as long as their server).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces): state, ppid, ..., utime, stime."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _fields(int(entry.name))
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def tree_seconds(pid: int, kids: dict[int, list[int]] | None = None) -> float:
    """User plus system CPU-seconds of ``pid`` and its living descendants."""
    kids = _children() if kids is None else kids
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        fields = _fields(p)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / TICK
        stack.extend(kids.get(p, []))
    return total


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """Each named process tree's CPU-seconds so far (one scan of ``/proc`` for all)."""
    kids = _children()
    return {name: tree_seconds(pid, kids) for name, pid in pids.items()}


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 2) for name in after}


def cores(runs: list[dict]) -> dict:
    """Per process tree (``target`` or ``target:role``), the median cores it kept busy over the levels of its
    own target (``driven``) and over the other targets' levels (``idle``), from each level's ``cpu_s`` and
    ``wall_s``."""
    rates: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        wall = run.get("wall_s") or 0
        for name, seconds in (run.get("cpu_s") or {}).items():
            if wall > 0:
                side = "driven" if name.split(":")[0] == run["target"] else "idle"
                rates.setdefault(name, {"driven": [], "idle": []})[side].append(seconds / wall)
    return {name: {side: round(statistics.median(v), 2) if v else None for side, v in by.items()}
            for name, by in rates.items()}

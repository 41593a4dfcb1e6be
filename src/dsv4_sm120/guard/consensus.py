"""Agreement across the scheduler's attention-TP (and CP) CPU groups.

Each iteration every rank contributes a snapshot vector (a few int64) and every rank must learn
the same answer: which fields differ between ranks. Two channels give that answer:

- Shared memory, when every rank of the group runs on one host (the usual TP layout): each rank
  writes its vector into its own slot of a small mapped file and waits until every slot carries
  this iteration's sequence number; every rank then reads the same rows and computes the same
  answer locally. One memory round trip instead of network hops: any gloo collective costs
  ~0.9 ms at TP=8 even on an idle 16-core host (bench/results/guard_quiet_h200host_2026-11-29.json),
  which alone misses the guard's 100 us budget.
- Gloo, across hosts or when the mapped file cannot be shared: the vectors are gathered to the
  group's first rank, which broadcasts one disagreement flag per field (two collective phases
  whatever the group size; a MIN/MAX all-reduce takes 2(N-1) sequential ring hops).

Only on disagreement are the request-id lists exchanged (``gather``, gloo), which is rare.

Slots are double-buffered by sequence parity: a rank can write iteration k+2 (same parity as k)
only after every rank has written k+1, i.e. after every rank has finished reading iteration k.
A slot is [sequence, payload..., check word over both]; the sequence is stored last and a reader
accepts a slot only when its check word matches, so a slot whose payload stores are not yet
visible (weakly ordered CPUs) is read again instead of trusted.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("dsv4_sm120.guard")

SPIN_S = 0.002  # look again at once (yielding the core) this long, then sleep between looks
YIELD_SLEEP_S = 50e-6
PEER_CHECK_S = 0.5  # while waiting longer, check this often that every peer process still lives
REPORT_EVERY_S = 30.0  # while waiting longer, name the ranks not arrived this often
STALL_LIMIT_S = 600.0  # a live peer that never arrives: fail fast rather than wait forever
MAX_FIELDS = 62
# Odd multipliers for a slot's check word: a wrapping dot product over (sequence, payload).
_MIX = np.array([0x9E3779B97F4A7C15 - 2**64 + 2 * i for i in range(MAX_FIELDS + 1)], dtype=np.int64)


class PeerLost(RuntimeError):
    """A rank of the group died or stopped arriving while the others waited for it."""


def groups_of(scheduler) -> list:
    """The CPU groups whose ranks share queues: attention-TP, then attention-CP when > 1 rank."""
    out = []
    for name in ("attn_tp_cpu_group", "attn_cp_cpu_group"):
        group = getattr(scheduler, name, None)
        if group is not None and dist.get_world_size(group) > 1 and group not in out:
            out.append(group)
    return out


def host_key() -> str:
    """What two processes must share to share a mapped file and see each other's pids."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid", "/proc/self/ns/ipc", "/proc/self/ns/mnt"):
        try:
            parts.append(os.readlink(path) if path.startswith("/proc/self/ns") else open(path).read().strip())
        except OSError:
            parts.append("?")
    return "|".join(parts)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (OSError, IndexError):
        return False


class Agreement:
    """One group's per-iteration agreement channel; built lazily at the first call (a point all ranks reach)."""

    def __init__(self, group, *, shared_memory: bool = True):
        self.group = group
        self.world = dist.get_world_size(group)
        self.me = dist.get_group_rank(group, dist.get_rank())
        self.root = dist.get_process_group_ranks(group)[0]
        self.transport = None  # "shm" or "gloo" after setup
        self._allow_shm = shared_memory
        self._seq = 0

    def disagreeing_fields(self, vector: list[int]) -> list[int]:
        """Indices of ``vector`` whose value is not the same on every rank of the group."""
        if self.transport is None:
            self._setup(len(vector))
        if self.transport == "shm":
            return self._via_shared_memory(vector)
        return self._via_gloo(vector)

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in group rank order (gloo; the rare disagreement path)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- setup ------------------------------------------------------------------------------------

    def _setup(self, width: int) -> None:
        self.transport = "gloo"
        if not self._allow_shm or len(set(self.gather(host_key()))) != 1 or width > MAX_FIELDS:
            return
        path = [None]
        if self.me == 0:
            path[0] = self._create_file(2 * self.world * (width + 2) * 8)
        dist.broadcast_object_list(path, src=self.root, group=self.group)
        view = self._map(path[0], width) if path[0] else None
        pids = self.gather(os.getpid() if view is not None else None)
        if self.me == 0 and path[0]:
            os.unlink(path[0])  # every rank has mapped it (or failed to): nothing left in /dev/shm
        if all(p is not None for p in pids):
            self.transport, self._slots, self._pids = "shm", view, pids
            self._mine = np.empty(width + 2, dtype=np.int64)
            self._mix = _MIX[: width + 1]
        elif self.me == 0:
            logger.warning("dsv4-sm120 guard: the group's ranks could not share a mapped file (%s); "
                           "agreeing over gloo instead", path[0] or "none could be created")

    @staticmethod
    def _create_file(size: int) -> str | None:
        for folder in ("/dev/shm", None):
            try:
                fd, path = tempfile.mkstemp(prefix="dsv4-guard-", dir=folder)
                os.ftruncate(fd, size)
                os.close(fd)
                return path
            except OSError:
                continue
        return None

    def _map(self, path: str, width: int) -> np.ndarray | None:
        try:
            with open(path, "r+b") as f:
                self._mm = mmap.mmap(f.fileno(), 0)
        except OSError:
            return None
        return np.frombuffer(self._mm, dtype=np.int64).reshape(2, self.world, width + 2)

    # -- the two channels ---------------------------------------------------------------------------

    def _via_shared_memory(self, vector: list[int]) -> list[int]:
        seq = self._seq = self._seq + 1
        slots = self._slots[seq & 1]
        mine = self._mine
        mine[0], mine[1:-1] = seq, vector
        mine[-1] = mine[:-1] @ self._mix  # wraps modulo 2**64, as intended
        slot = slots[self.me]
        slot[1:] = mine[1:]
        slot[0] = seq  # published last: readers wait for it, then validate the check word
        payload = self._wait_all(slots, seq)[:, 1:-1]
        if (payload == payload[0]).all():
            return []
        return np.flatnonzero((payload != payload[0]).any(axis=0)).tolist()

    def _wait_all(self, slots: np.ndarray, seq: int) -> np.ndarray:
        """A consistent copy of every rank's slot for iteration ``seq``; raises PeerLost instead of hanging."""
        start = time.perf_counter()
        next_peer_check, next_report = start + PEER_CHECK_S, start + REPORT_EVERY_S
        while True:
            block = slots.copy()
            if (block[:, 0] == seq).all() and (block[:, :-1] @ self._mix == block[:, -1]).all():
                return block
            now = time.perf_counter()
            if now - start < SPIN_S:
                os.sched_yield()  # let a peer's gloo or main thread on this core run first
                continue
            time.sleep(YIELD_SLEEP_S)
            if now < next_peer_check:
                continue
            next_peer_check = now + PEER_CHECK_S
            missing = [r for r in range(self.world) if block[r, 0] != seq]
            dead = [r for r in missing if not _alive(self._pids[r])]
            if dead:
                raise PeerLost(f"group rank(s) {dead} (pid {[self._pids[r] for r in dead]}) died while this "
                               f"rank waited for them at guard iteration {seq}")
            if now - start > STALL_LIMIT_S:
                raise PeerLost(f"group rank(s) {missing} alive but absent from guard iteration {seq} "
                               f"for {now - start:.0f} s")
            if now >= next_report:
                next_report = now + REPORT_EVERY_S
                logger.warning("dsv4-sm120 guard: rank %d waiting %.0f s for group rank(s) %s at iteration %d",
                               self.me, now - start, missing, seq)

    def _via_gloo(self, vector: list[int]) -> list[int]:
        t = torch.tensor(vector, dtype=torch.int64)
        rows = [torch.empty_like(t) for _ in range(self.world)] if self.me == 0 else None
        dist.gather(t, rows, dst=self.root, group=self.group)
        flags = (torch.stack(rows) != t).any(0).to(torch.int64) if self.me == 0 else torch.empty_like(t)
        dist.broadcast(flags, src=self.root, group=self.group)
        return flags.nonzero().flatten().tolist()

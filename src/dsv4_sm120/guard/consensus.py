"""Agreement across the scheduler's attention-TP (and CP) CPU groups.

Each iteration every rank contributes a snapshot vector (a few int64) and every rank must learn
the same answer: which fields differ between ranks. Two channels give that answer:

- Shared memory, when every rank of the group runs on one host (the usual TP layout): each rank
  writes its vector into its own slot of a small mapped file and waits until every slot carries
  this operation's sequence number; every rank then reads the same rows and computes the same
  answer locally. One memory round trip instead of network hops: over gloo the same agreement
  (two collectives) added 0.37-0.60 ms per iteration at TP=2-8 on an idle 16-core host
  (bench/results/guard_cpu_2026-11-30.json), far over the guard's 100 us budget.
- Gloo, across hosts or when the mapped file cannot be shared: the vectors are gathered to the
  group's first rank, which broadcasts one disagreement flag per field (two collective phases
  whatever the group size; a MIN/MAX all-reduce takes 2(N-1) sequential ring hops).

Only on disagreement are the request-id lists exchanged (``gather``, gloo), which is rare.

The same mapped file also carries the MIN-reduction of the transfer polls (``min_reduce``; see
``poll_reduce``), the collective the guard makes safe: once the guard holds the queue lengths
equal, every rank issues the same sequence of poll reductions, so they can share the agreement's
sequence numbers.

Slots are double-buffered by sequence parity: a rank can write operation k+2 (same parity as k)
only after every rank has written k+1, i.e. after every rank has finished reading operation k.
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
MAX_FIELDS = 62  # snapshot vector width the shared-memory channel takes
POLL_CAPACITY = 256  # poll states per reduction through shared memory; longer lists go over gloo
# Odd multipliers for a slot's check word: a wrapping dot product over (sequence, payload).
_MIX = np.array([0x9E3779B97F4A7C15 - 2**64 + 2 * i for i in range(POLL_CAPACITY + 2)], dtype=np.int64)

_shared_by_group: dict = {}  # group -> its newest shared-memory Agreement (what poll_reduce uses)


class PeerLost(RuntimeError):
    """The group's ranks no longer move in step: one died, stopped arriving, or brought a poll list
    of another length than the others."""


def groups_of(scheduler) -> list:
    """The CPU groups whose ranks share queues: attention-TP, then attention-CP when > 1 rank."""
    out = []
    for name in ("attn_tp_cpu_group", "attn_cp_cpu_group"):
        group = getattr(scheduler, name, None)
        if group is not None and dist.get_world_size(group) > 1 and group not in out:
            out.append(group)
    return out


def shared_channel(group) -> Agreement | None:
    """The shared-memory Agreement the guard set up on ``group``, if any."""
    return _shared_by_group.get(group)


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


class _Slots:
    """One region of the mapped file: a row per rank, [seq, payload (width), check], two parities."""

    def __init__(self, array: np.ndarray, me: int, pids: list[int]):
        self.array, self.me, self.pids = array, me, pids
        self.width = array.shape[2] - 2
        self.mine = np.zeros(self.width + 2, dtype=np.int64)
        self.mix = _MIX[: self.width + 1]

    def exchange(self, seq: int, payload) -> np.ndarray:
        """Publish ``payload`` (at most ``width`` int64, zero-padded) and return every rank's, in rank order."""
        slots = self.array[seq & 1]
        mine = self.mine
        n = len(payload)
        mine[0], mine[1 : 1 + n] = seq, payload
        mine[1 + n : -1] = 0
        mine[-1] = mine[:-1] @ self.mix  # wraps modulo 2**64, as intended
        slot = slots[self.me]
        slot[1:] = mine[1:]
        slot[0] = seq  # published last: readers wait for it, then validate the check word
        return self._wait_all(slots, seq)[:, 1:-1]

    def _wait_all(self, slots: np.ndarray, seq: int) -> np.ndarray:
        """A consistent copy of every rank's slot for operation ``seq``; raises PeerLost instead of hanging."""
        start = time.perf_counter()
        next_peer_check, next_report = start + PEER_CHECK_S, start + REPORT_EVERY_S
        while True:
            if (slots[:, 0] == seq).all():
                block = slots.copy()
                if (block[:, 0] == seq).all() and (block[:, :-1] @ self.mix == block[:, -1]).all():
                    return block
            now = time.perf_counter()
            if now - start < SPIN_S:
                os.sched_yield()  # let a peer's gloo or main thread on this core run first
                continue
            time.sleep(YIELD_SLEEP_S)
            if now < next_peer_check:
                continue
            next_peer_check = now + PEER_CHECK_S
            missing = [r for r in range(len(self.pids)) if slots[r, 0] != seq]
            dead = [r for r in missing if not _alive(self.pids[r])]
            if dead:
                raise PeerLost(f"group rank(s) {dead} (pid {[self.pids[r] for r in dead]}) died while this "
                               f"rank waited for them at guard operation {seq}")
            if now - start > STALL_LIMIT_S:
                raise PeerLost(f"group rank(s) {missing} alive but absent from guard operation {seq} "
                               f"for {now - start:.0f} s")
            if now >= next_report:
                next_report = now + REPORT_EVERY_S
                logger.warning("dsv4-sm120 guard: rank %d waiting %.0f s for group rank(s) %s at operation %d",
                               self.me, now - start, missing, seq)


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
        """Indices of ``vector`` whose value is not the same on every rank of the group.

        Every exchange of a group has the width of its first (the widest, the top-of-iteration
        snapshot), shorter vectors zero-padded: ranks that reach different guard points still pair
        messages of one size, and see the guard point code they lead with differ.
        """
        if self.transport is None:
            self._width = len(vector)
            self._setup(self._width)
        if len(vector) > self._width:
            raise ValueError(f"a guard vector of {len(vector)} fields is wider than this group's first ({self._width})")
        if self.transport == "shm":
            self._seq += 1
            payload = self._vectors.exchange(self._seq, vector)
            if (payload == payload[0]).all():
                return []
            return np.flatnonzero((payload != payload[0]).any(axis=0)).tolist()
        return self._via_gloo(list(vector) + [0] * (self._width - len(vector)))

    def min_reduce(self, values: list[int]) -> list[int] | None:
        """Element-wise MIN over the group through shared memory; None when it does not fit (use gloo).

        Every rank must call it at the same point with a list of the same length (what the guard's
        agreement on queue lengths ensures); a length that differs between ranks raises.
        """
        if len(values) > POLL_CAPACITY:
            return None
        self._seq += 1
        rows = self._polls.exchange(self._seq, [len(values), *values])
        if (rows[:, 0] != len(values)).any():
            raise PeerLost(f"poll reduction {self._seq}: ranks reduce lists of different lengths "
                           f"{rows[:, 0].tolist()}; the guard should have held their queues equal")
        return rows[:, 1 : 1 + len(values)].min(axis=0).tolist()

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
        shapes = ((2, self.world, width + 2), (2, self.world, POLL_CAPACITY + 3))
        path = [None]
        if self.me == 0:
            path[0] = _create_file(8 * sum(int(np.prod(s)) for s in shapes))
        dist.broadcast_object_list(path, src=self.root, group=self.group)
        words = self._map(path[0]) if path[0] else None
        pids = self.gather(os.getpid() if words is not None else None)
        if self.me == 0 and path[0]:
            os.unlink(path[0])  # every rank has mapped it (or failed to): nothing left in /dev/shm
        if any(p is None for p in pids):
            if self.me == 0:
                logger.warning("dsv4-sm120 guard: the group's ranks could not share a mapped file (%s); "
                               "agreeing over gloo instead", path[0] or "none could be created")
            return
        split = int(np.prod(shapes[0]))
        self._vectors = _Slots(words[:split].reshape(shapes[0]), self.me, pids)
        self._polls = _Slots(words[split:].reshape(shapes[1]), self.me, pids)
        self.transport = "shm"
        _shared_by_group[self.group] = self

    def _map(self, path: str) -> np.ndarray | None:
        try:
            with open(path, "r+b") as f:
                self._mm = mmap.mmap(f.fileno(), 0)
        except OSError:
            return None
        return np.frombuffer(self._mm, dtype=np.int64)

    def _via_gloo(self, vector: list[int]) -> list[int]:
        t = torch.tensor(vector, dtype=torch.int64)
        rows = [torch.empty_like(t) for _ in range(self.world)] if self.me == 0 else None
        dist.gather(t, rows, dst=self.root, group=self.group)
        flags = (torch.stack(rows) != t).any(0).to(torch.int64) if self.me == 0 else torch.empty_like(t)
        dist.broadcast(flags, src=self.root, group=self.group)
        return flags.nonzero().flatten().tolist()


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

"""Agreement across the scheduler's attention-TP (and CP) CPU groups.

Each iteration every rank contributes a snapshot vector (a few int64) and every rank must learn
the same answer: which fields differ between ranks. Two channels give that answer:

- Shared memory, when every rank of the group runs on one host (the usual TP layout): each rank
  writes its vector into its own slot of a small mapped file and waits until every slot carries
  this operation's sequence number; every rank then reads the same rows and computes the same
  answer locally. One memory round trip instead of network hops: over gloo the same agreement
  (two collectives) added 0.37-0.60 ms per iteration at TP=2-8 on an idle 16-core host
  (bench/results/guard/guard_cpu_2026-11-30.json), far over the guard's 100 us budget.
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
A slot is [sequence, check word, payload...]; the check word (CRC-32 and Adler-32 over sequence and
payload) and the payload are stored first, the sequence last, and a reader accepts a slot only when
its check word matches, so a slot copied while its writer was still storing (a copy need not load
in address order; on weakly ordered CPUs, Arm hosts such as Grace, stores may also become visible
out of order) is read again instead of trusted. When the ranks agree every row is
byte-equal to the reader's own (valid) row, and that one comparison settles the agreement without
computing a check word.

A waiting rank looks again at once for ``SPIN_S`` (no system call: the peers of an agreeing
iteration arrive within microseconds), then yields its core between looks until ``YIELD_S``, then
sleeps between looks; with fewer usable cores than ranks it skips the first phase.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import tempfile
import time
import zlib
from itertools import repeat

import torch
import torch.distributed as dist

logger = logging.getLogger("dsv4_sm120.guard")

SPIN_S = 100e-6  # look again at once, no system call, this long (when the host has a core per rank)
YIELD_S = 0.002  # then look again yielding the core (sched_yield) until this long, then sleep between looks
YIELD_SLEEP_S = 50e-6
PEER_CHECK_S = 0.5  # while waiting longer, check this often that every peer process still lives
REPORT_EVERY_S = 30.0  # while waiting longer, name the ranks not arrived this often
STALL_LIMIT_S = 600.0  # a live peer that never arrives: fail fast rather than wait forever
MAX_FIELDS = 62  # snapshot vector width the shared-memory channel takes
POLL_CAPACITY = 256  # poll states per reduction through shared memory; longer lists go over gloo

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
    """One region of the mapped file: a row per rank, two parities; a row is [seq, check, payload (width)].

    An exchange costs a few C-level calls whatever the group size, and no system call while the
    peers are close behind: the payload is packed with one ``struct`` call, written as bytes, then
    the sequence word; a reader copies the rows as bytes (the agreement block in one slice, poll
    rows at their used prefix) and, in the common case where every rank brought the same payload,
    finds them all byte-equal to its own row at once and is done. No numpy and no per-field Python
    work on the agreeing path.
    """

    def __init__(self, mm: mmap.mmap, offset: int, world: int, width: int, me: int, pids: list[int],
                 counted: bool = False):
        self.mm, self.me, self.pids, self.world, self.width = mm, me, pids, world, width
        self.counted = counted  # payload[0] says how many words follow: each row has its own length
        self.row = 8 * (width + 2)
        self.offsets = [[offset + (parity * world + r) * self.row for r in range(world)] for parity in (0, 1)]
        self._body = [struct.Struct(f"<q{n}q") for n in range(width + 1)]  # seq + n payload words
        self._zeros = (0,) * width
        self.spin_s = SPIN_S if _cores() >= world else 0.0  # more ranks than cores: yield at once

    def exchange(self, seq: int, payload, used: int | None = None) -> list[bytes]:
        """Publish ``payload`` (at most ``width`` int64; zero-padded to ``used``, default ``width``)
        and return every rank's row as bytes, in rank order: ``[seq, check, payload[:used]]``.

        Every rank of one exchange must pass the same ``used``.
        """
        n = self.width if used is None else used
        if not self.counted and n != self.width:
            raise ValueError("agreement vectors always fill the region's width")
        return self._wait_all(seq, 16 + 8 * n, self.publish(seq, payload, n))

    def publish(self, seq: int, payload, n: int, rank: int | None = None) -> bytes:
        """Write this rank's row (``rank``: another's, for tests) of operation ``seq``, sequence last;
        returns the row's bytes."""
        body = self._body[n].pack(seq, *payload, *self._zeros[: n - len(payload)])
        off = self.offsets[seq & 1][self.me if rank is None else rank]
        row = body[:8] + _check(body).to_bytes(8, "little") + body[8:]
        mm = self.mm
        mm[off + 8 : off + 16 + 8 * n] = row[8:]
        mm[off : off + 8] = body[:8]  # the sequence last: readers wait for it, then validate
        return row

    @staticmethod
    def words(row: bytes) -> tuple:
        """A row's payload as int64 values."""
        return struct.unpack_from(f"<{(len(row) - 16) // 8}q", row, 16)

    def _consistent(self, rows: list[bytes], seq_bytes: bytes) -> list[bytes] | None:
        """``rows`` if every one carries this operation's sequence and a check word over (sequence,
        payload); None to look again (a row whose stores are not all visible yet)."""
        if rows.count(rows[0]) == len(rows):  # byte-equal rows: one check stands for all
            return rows if _valid(rows[0], seq_bytes) else None
        if self.counted:  # rows of other lengths than this rank's: read each at its own
            rows = [self.mm[o : o + 24 + 8 * max(0, min(self.width - 1, _count(row)))]
                    for o, row in zip(self.offsets[int.from_bytes(seq_bytes, "little") & 1], rows)]
        return rows if all(_valid(row, seq_bytes) for row in rows) else None

    def _wait_all(self, seq: int, size: int, mine: bytes) -> list[bytes]:
        """A consistent copy of every rank's row for operation ``seq``; raises PeerLost instead of hanging.

        ``mine`` is this rank's own row as published (valid by construction). Fast path: every
        row is byte-equal to it, so every rank published this operation with the same payload and
        the same check word, and nothing needs checking: a row copied mid-store can equal a whole
        row only where its visible bytes are that row's (barring a check-word collision, as for any
        row). The agreement vectors fill whole rows, so their block is copied in one slice.
        """
        mm, offsets, world = self.mm, self.offsets[seq & 1], self.world
        seq_bytes = seq.to_bytes(8, "little")
        block = not self.counted  # full-width rows, contiguous in rank order
        first, span, row = offsets[0], world * self.row, self.row
        everyone = mine * world if block else None
        start = time.perf_counter()
        spin_until, yield_until = start + self.spin_s, start + YIELD_S
        next_peer_check, next_report = start + PEER_CHECK_S, start + REPORT_EVERY_S
        while True:
            if block:
                raw = mm[first : first + span]
                if raw == everyone:
                    return [mine] * world
                rows = [raw[i : i + row] for i in range(0, span, row)]
            else:
                rows = [mm[o : o + size] for o in offsets]
                if rows.count(mine) == world:
                    return rows
            if all(map(bytes.startswith, rows, repeat(seq_bytes))):
                rows = self._consistent(rows, seq_bytes)
                if rows is not None:
                    return rows
            now = time.perf_counter()
            if now < spin_until:
                continue  # the peers are usually microseconds behind: look again, no system call
            if now < yield_until:
                os.sched_yield()  # let a peer's gloo or main thread on this core run first
                continue
            time.sleep(YIELD_SLEEP_S)
            if now < next_peer_check:
                continue
            next_peer_check = now + PEER_CHECK_S
            missing = [r for r, o in enumerate(offsets) if mm[o : o + 8] != seq_bytes]
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


def _valid(row: bytes, seq_bytes: bytes) -> bool:
    return row[:8] == seq_bytes and _check(row[:8] + row[16:]).to_bytes(8, "little") == row[8:16]


def _count(row: bytes) -> int:
    return int.from_bytes(row[16:24], "little", signed=True) if len(row) >= 24 else 0


def _check(body: bytes) -> int:
    """63-bit check word over a row's (sequence, payload) bytes: CRC-32 and Adler-32, both C calls."""
    return ((zlib.crc32(body) << 31) ^ zlib.adler32(body)) & 0x7FFFFFFFFFFFFFFF


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
            rows = self._vectors.exchange(self._seq, vector)
            if rows.count(rows[0]) == len(rows):
                return []
            values = [_Slots.words(row) for row in rows]
            return [i for i, column in enumerate(zip(*values)) if column.count(column[0]) != len(column)]
        return self._via_gloo(list(vector) + [0] * (self._width - len(vector)))

    def min_reduce(self, values: list[int]) -> list[int] | None:
        """Element-wise MIN over the group through shared memory; None when it does not fit (use gloo).

        Every rank must call it at the same point with a list of the same length (what the guard's
        agreement on queue lengths ensures); a length that differs between ranks raises.
        """
        n = len(values)
        if n > POLL_CAPACITY:
            return None
        self._seq += 1
        rows = self._polls.exchange(self._seq, [n, *values], used=1 + n)
        if rows.count(rows[0]) == len(rows):  # every rank saw the same states: nothing to reduce
            return list(_Slots.words(rows[0])[1:])
        lengths = [_count(row) for row in rows]
        if lengths.count(n) != len(lengths):
            raise PeerLost(f"poll reduction {self._seq}: ranks reduce lists of different lengths "
                           f"{lengths}; the guard should have held their queues equal")
        return [min(column) for column in zip(*(_Slots.words(row)[1:] for row in rows))]

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
        widths = (width, POLL_CAPACITY + 1)  # agreement vectors; poll reductions (count + states)
        sizes = [2 * self.world * 8 * (w + 2) for w in widths]
        path = [None]
        if self.me == 0:
            path[0] = _create_file(sum(sizes))
        dist.broadcast_object_list(path, src=self.root, group=self.group)
        mm = self._map(path[0]) if path[0] else None
        pids = self.gather(os.getpid() if mm is not None else None)
        if self.me == 0 and path[0]:
            os.unlink(path[0])  # every rank has mapped it (or failed to): nothing left in /dev/shm
        if any(p is None for p in pids):
            if self.me == 0:
                logger.warning("dsv4-sm120 guard: the group's ranks could not share a mapped file (%s); "
                               "agreeing over gloo instead", path[0] or "none could be created")
            return
        self._vectors = _Slots(mm, 0, self.world, widths[0], self.me, pids)
        self._polls = _Slots(mm, sizes[0], self.world, widths[1], self.me, pids, counted=True)
        self.transport = "shm"
        _shared_by_group[self.group] = self

    def _map(self, path: str) -> mmap.mmap | None:
        try:
            with open(path, "r+b") as f:
                self._mm = mmap.mmap(f.fileno(), 0)
        except OSError:
            return None
        return self._mm

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

"""Transfer polls MIN-reduced through the guard's shared memory instead of a gloo all-reduce.

Every overlap PD iteration MIN-reduces the poll states of each non-empty bootstrap, in-flight,
pre-allocation and transfer queue over the TP (and CP) CPU group (upstream's
``disaggregation.utils._all_reduce_polls``, one gloo all-reduce each). On an idle 16-core host the
idle iteration's two gloo collectives (request broadcast and one poll all-reduce) took 0.3 ms at
TP=2 and 1.3 ms at TP=8 (bench/results/guard/guard_cpu_2026-11-30.json), and the guard's agreement, a
barrier placed just before the first poll, exposes that all-reduce's latency instead of letting it
overlap the request broadcast's skew. Once the guard holds the ranks' queues equal, every rank issues the same sequence of poll
reductions with lists of the same length, so they can go through the guard's shared-memory
channel: the same MIN, element for element, at memory speed.

The AROUND hook takes that path only on a group the guard has set up on shared memory (guard on,
every rank on one host) and for lists that fit ``consensus.POLL_CAPACITY``; everything else
(guard off, a group over hosts, a long list, a group the guard never saw) is upstream's gloo
all-reduce, untouched.
"""

from __future__ import annotations

from dsv4_sm120.guard import consensus

TARGET = "sglang.srt.disaggregation.utils._all_reduce_polls"


def all_reduce_polls(original, polls, group):
    """AROUND ``_all_reduce_polls``: MIN over the group's shared-memory channel when it has one."""
    channel = consensus.shared_channel(group)
    if channel is not None:
        reduced = channel.min_reduce(polls)
        if reduced is not None:
            return reduced
    return original(polls, group)

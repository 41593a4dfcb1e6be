"""Agreement across the scheduler's attention-TP (and CP) CPU groups.

The fast path per group: the snapshot vectors (a few int64) are gathered to the
group's first rank, which broadcasts one disagreement flag per field, so every
rank learns the same answer in two collective phases. Only on disagreement are
the request-id lists exchanged (``all_gather_object``), which is slower and rare.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def groups_of(scheduler) -> list:
    """The CPU groups whose ranks share queues: attention-TP, then attention-CP when > 1 rank."""
    out = []
    for name in ("attn_tp_cpu_group", "attn_cp_cpu_group"):
        group = getattr(scheduler, name, None)
        if group is not None and dist.get_world_size(group) > 1 and group not in out:
            out.append(group)
    return out


def disagreeing_fields(vector: list[int], group) -> list[int]:
    """Indices of ``vector`` whose value is not the same on every rank of ``group``.

    Gather to the group's first rank, which compares and broadcasts one flag per field: two
    collective phases whatever the group size. (A MIN/MAX all-reduce gives the same answer, but
    gloo's ring all-reduce takes 2(N-1) sequential hops and measured 3-5x slower at TP=8 here.)
    """
    t = torch.tensor(vector, dtype=torch.int64)
    root = dist.get_process_group_ranks(group)[0]
    is_root = dist.get_rank() == root
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size(group))] if is_root else None
    dist.gather(t, rows, dst=root, group=group)
    flags = (torch.stack(rows) != t).any(0).to(torch.int64) if is_root else torch.empty_like(t)
    dist.broadcast(flags, src=root, group=group)
    return flags.nonzero().flatten().tolist()


def gather(obj, group) -> list:
    """Every rank's ``obj``, in group rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out

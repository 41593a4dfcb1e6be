"""Agreement across the scheduler's attention-TP (and CP) CPU groups.

The fast path is ONE gloo all-reduce per group of a small int64 tensor holding
the snapshot vector and its negation: a MIN reduce yields every field's min and
max at once, so each rank learns locally whether all ranks hold the same value.
Only on disagreement are the request-id lists exchanged (``all_gather_object``),
which is slower and rare.
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
    """Indices of ``vector`` whose value is not the same on every rank of ``group``."""
    n = len(vector)
    t = torch.tensor(vector + [-v for v in vector], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    lo, neg_hi = t[:n].tolist(), t[n:].tolist()
    return [i for i in range(n) if lo[i] != -neg_hi[i]]


def gather(obj, group) -> list:
    """Every rank's ``obj``, in group rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out

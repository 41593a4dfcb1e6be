"""A torch-function mode that fails on every tensor call making the host wait for a GPU.

Used where the package must only queue GPU work: HiCache's copy path and the indexer's read
(test_integrity.py), the scheduler hooks with nothing quarantined (test_integrity_request_fail.py),
the PD send and the first received poll (test_pd_integrity.py). It watches the tensor calls of the
thread that enters it, on CPU tensors too, so a CPU test catches what would wait on a GPU.
"""

from __future__ import annotations

import torch


class NoHostSync(torch.overrides.TorchFunctionMode):
    """Fails on every tensor call that makes the host wait for a GPU (a value, a host copy, a sized result)."""

    WAITS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero,
             torch.nonzero, torch.Tensor.unique, torch.unique, torch.masked_select, torch.Tensor.masked_select}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.WAITS or (func is torch.Tensor.to and "cpu" in map(str, (*args[1:], *kwargs.values()))):
            raise AssertionError(f"host synchronization where GPU work is only queued: {func}")
        return func(*args, **kwargs)

"""The CUDA-only steps of integrity mode only queue work: run here with stand-ins that record how they are called.

On a CPU the checks take their torch-reference branches, so the no-host-sync tests (``host_sync.py``) never
run the two helpers every CUDA path goes through: the verdicts' copy to pinned host memory
(:func:`~dsv4_sm120.index_k.integrity.pinned_copy`) and the indices' copy to the GPU
(:func:`~dsv4_sm120.index_k.integrity.on_device`). A blocking copy or an event wait added there would pass
every CPU test. Here the CUDA calls they make are stand-ins that record their arguments; the helpers must
copy without blocking, record an event and never wait on one.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_sm120.index_k import integrity


class _Event:
    made: list = []

    def __init__(self, *args, **kwargs):
        self.recorded = self.waited = False
        _Event.made.append(self)

    def record(self, *args, **kwargs):
        self.recorded = True

    def synchronize(self):
        self.waited = True

    def query(self):
        return True


@pytest.fixture
def cuda_calls(monkeypatch):
    """Every copy's ``non_blocking``, ``pin_memory`` asked of ``torch.empty``, and the events made."""
    calls = {"copies": [], "pinned": [], "to": []}
    real_empty, real_copy = torch.empty, torch.Tensor.copy_

    def empty(*args, pin_memory=False, **kwargs):
        calls["pinned"].append(pin_memory)
        return real_empty(*args, **kwargs)

    def copy_(self, src, non_blocking=False):
        calls["copies"].append(non_blocking)
        return real_copy(self, src)

    def to(self, *args, non_blocking=False, **kwargs):
        calls["to"].append((args, non_blocking))
        return self

    _Event.made = []
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("torch.cuda.synchronize called"))
    return calls


def test_the_verdicts_copy_to_pinned_memory_without_blocking_behind_a_recorded_event(cuda_calls):
    verdicts = torch.arange(6, dtype=torch.int64).view(2, 3)
    host, landed = integrity.pinned_copy(verdicts)
    assert cuda_calls["pinned"] == [True], "the host copy is not pinned memory (a pageable copy blocks)"
    assert cuda_calls["copies"] == [True], "the copy to the host blocks the host"
    assert landed.recorded and not landed.waited
    assert torch.equal(host, verdicts)


def test_indices_go_to_the_gpu_from_pinned_memory_without_blocking(cuda_calls):
    indices = torch.tensor([3, 1, 2])
    integrity.on_device(torch.device("cuda", 0), indices)
    assert [non_blocking for _, non_blocking in cuda_calls["to"]] == [True], "the copy to the GPU blocks the host"
    assert all(not e.waited for e in _Event.made)

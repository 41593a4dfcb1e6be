"""No ``--dsa-topk-backend`` transform reads the logits past a row's length, so the kernel need not write there.

The bf16 logits kernel leaves every column at or past ``seq_lens[t]`` unwritten (decode runs at the
CUDA-graph capture width). Each test scores rows of several lengths at a wide width with the real
kernel, then runs the backend's real transform through the package's dispatch (``run_topk_transform``)
on the kernel's output with the unwritten region poisoned, and once with it set to -inf (what the old
kernel wrote and upstream's torch fp8 path writes). The selected pool slots must be identical. Two
poisons: NaN (what the kernel leaves there in these tests) and +inf (which any top-k that looked at the
region would select, whatever it makes of NaN).

The controls show the check has teeth: the same poisons placed inside the live length (the last
``LIVE_TAIL`` columns of each row longer than ``TOPK + LIVE_TAIL``), i.e. where every transform does
read, must change the selection of those rows for every backend.

What runs where:
- ``torch``: upstream's ``topk_transform_pytorch_vectorized``, on the CPU.
- ``flashinfer`` (unfused, upstream's default): upstream's ``topk_transform_flashinfer_unfused``; on the
  CPU its ``flashinfer.top_k`` (a CUDA kernel) is replaced by ``torch.topk`` with the same call
  contract, so what is tested there is upstream's masking around it.
- On a CUDA host (marker ``gpu``), the pin's real CUDA top-k kernels: ``sgl-kernel`` v1 / v2 (sglang's
  JIT kernels ``kernels/jit/csrc/deepseek_v4/topk_v1.cuh`` / ``topk_v2.cuh``, built through tvm-ffi and
  nvcc at first use; v2 with upstream's ``plan_topk_v2`` plan) and flashinfer's unfused ``top_k`` and
  fused ``top_k_page_table_transform`` (``SGLANG_DSA_FUSE_TOPK``). All 16 (4 backends x 2 poisons, and
  the controls) passed on an H200 host (sm_90, torch 2.11, python 3.12, no network):
  ``bench/results/kernels/topk_poison_h200_2026-12-01.txt``, run by ``bench/topk_poison_h200.sh`` (at commit
  b8292e6, removed since; git history keeps it). That image
  has no sglang or flashinfer, so the script carries the pinned sglang 0.5.23 and flashinfer-python
  0.7.2 there, trimmed to the import chain and the kernel sources; sglang's modules compile there, while
  flashinfer's top-k module (tens of CPU-minutes of nvcc) is built ahead of time on the CPU host by
  flashinfer's own JIT with the same nvcc 13.0 and loaded from flashinfer's ahead-of-time path. Two
  packages sglang imports at module level on a CUDA host cannot load there and are replaced by the
  stand-ins of ``topk_standins.py`` when missing (and only then): ``sgl_kernel`` (1.2 GB of prebuilt ops
  for torch 2.14; the image has 2.11) and ``deep_gemm`` (likewise a prebuilt extension for another
  torch). No top-k transform calls either; a stand-in raises if called.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import logits_case

LENS = [1, 200, 512, 513, 900, 2000]
WIDTH = 4096
TOPK = 512
LIVE_TAIL = 16
POISONS = {"nan": float("nan"), "+inf": float("inf")}
CUDA_KINDS = ["sgl-kernel:v1", "sgl-kernel:v2", "flashinfer", "flashinfer:fused"]


def _scored(bf16_paged_mqa_logits, device):
    """The kernel's logits for ``LENS`` at ``WIDTH`` (NaN where it wrote nothing), lengths, page table, past mask."""
    gen = torch.Generator().manual_seed(21)
    q, w, pages, sl, pt = (t.to(device) for t in logits_case(LENS, 16, gen))
    pt = torch.cat([pt, torch.zeros((len(LENS), WIDTH // 64 - pt.shape[1]), dtype=torch.int32, device=device)], 1)
    logits = torch.full((len(LENS), WIDTH), float("nan"), device=device)
    bf16_paged_mqa_logits(q, pages, w, sl, pt, WIDTH, out=logits)
    past = torch.arange(WIDTH, device=device)[None, :] >= sl[:, None]
    assert logits[past].isnan().all() and not logits[~past].isnan().any()
    return logits, sl, pt, past


def _select(kind: str, logits, seq_lens, page_table):
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4 import indexer as upstream_indexer

    from dsv4_sm120.model.deepseek_v4 import run_topk_transform

    backend = SimpleNamespace(dsa_topk_backend=DSATopKBackend(kind.split(":")[0]))
    if kind == "flashinfer":
        backend.flashinfer_topk_transform = upstream_indexer.topk_transform_flashinfer_unfused
    elif kind == "flashinfer:fused":
        backend.flashinfer_topk_transform = upstream_indexer.topk_transform_flashinfer_fused
    im = SimpleNamespace(compressed_page_size=64, topk_metadata=None)
    if kind == "sgl-kernel:v2":
        im.topk_metadata = upstream_indexer.plan_topk_v2(seq_lens)
    out = torch.full((logits.shape[0], TOPK), -7, dtype=torch.int32, device=logits.device)
    run_topk_transform(backend, im, logits.clone(), seq_lens, page_table, out, None, whole=True)
    return out.sort(dim=1).values


def _select_pair(kind, logits, seq_lens, page_table, region, poison):
    """Selections with ``region`` of ``logits`` set to ``poison`` and to -inf."""
    a = _select(kind, logits.masked_fill(region, poison), seq_lens, page_table)
    b = _select(kind, logits.masked_fill(region, float("-inf")), seq_lens, page_table)
    return a, b


def _torch_topk_as_flashinfer(x, k, sorted=False, **flashinfer_only):
    """flashinfer.top_k's contract (values, indices) on torch.topk, for hosts without CUDA."""
    return torch.topk(x, k, dim=-1, largest=True, sorted=sorted)


def _check_past_length(scores, kind, poison):
    logits, sl, pt, past = scores
    a, b = _select_pair(kind, logits, sl, pt, past, poison)
    assert torch.equal(a, b), f"{kind}: the selection depends on logits past the row's length"
    for r, n in enumerate(LENS):
        assert int((a[r] >= 0).sum()) == min(n, TOPK), f"{kind}: row {r} selects {min(n, TOPK)} live keys"


def _check_live_tail_matters(scores, kind, poison):
    logits, sl, pt, past = scores
    logits = logits.masked_fill(past, float("-inf"))
    cols = torch.arange(WIDTH, device=logits.device)[None, :]
    tail = (cols < sl[:, None]) & (cols >= sl[:, None] - LIVE_TAIL) & (sl[:, None] >= TOPK + LIVE_TAIL)
    a, b = _select_pair(kind, logits, sl, pt, tail, poison)
    for r, n in enumerate(LENS):
        if n >= TOPK + LIVE_TAIL:
            assert not torch.equal(a[r], b[r]), f"{kind}: poison inside row {r}'s length left its selection alone"


@pytest.fixture(scope="module")
def cpu_scores(kern):
    return _scored(kern.mqa_logits.bf16_paged_mqa_logits, "cpu")


@pytest.fixture(scope="module")
def cuda_scores():
    from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits

    return _scored(bf16_paged_mqa_logits, "cuda")


@pytest.fixture(params=["torch", "flashinfer"])
def cpu_kind(request, monkeypatch):
    """A backend on the CPU; flashinfer's CUDA-only ``top_k`` is replaced (see the module doc)."""
    if request.param == "flashinfer":
        import flashinfer

        monkeypatch.setattr(flashinfer, "top_k", _torch_topk_as_flashinfer)
    return request.param


@pytest.fixture
def cuda_kind(request, monkeypatch):
    """A backend with the pin's CUDA kernels; stand-ins only for what cannot load (see the module doc)."""
    from harness import topk_standins

    topk_standins.install_missing()
    from sglang.srt.environ import envs

    kind = request.param
    monkeypatch.setattr(envs.SGLANG_OPT_USE_TOPK_V2, "get", lambda: kind == "sgl-kernel:v2")
    return kind


@pytest.mark.parametrize("poison", POISONS)
def test_cpu_transforms_ignore_logits_past_the_length(cpu_scores, cpu_kind, poison):
    _check_past_length(cpu_scores, cpu_kind, POISONS[poison])


@pytest.mark.parametrize("poison", POISONS)
def test_cpu_check_catches_poison_inside_the_length(cpu_scores, cpu_kind, poison):
    _check_live_tail_matters(cpu_scores, cpu_kind, POISONS[poison])


def on_the_pins_cuda_kernels(test):
    """Every CUDA backend x poison, on a CUDA host with the pin's kernels only (marker ``gpu``)."""
    for mark in (pytest.mark.parametrize("cuda_kind", CUDA_KINDS, indirect=True),
                 pytest.mark.parametrize("poison", POISONS),
                 pytest.mark.usefixtures("cuda_device"),
                 pytest.mark.gpu):
        test = mark(test)
    return test


@on_the_pins_cuda_kernels
def test_cuda_transforms_ignore_logits_past_the_length(cuda_kind, cuda_scores, poison):
    _check_past_length(cuda_scores, cuda_kind, POISONS[poison])


@on_the_pins_cuda_kernels
def test_cuda_check_catches_poison_inside_the_length(cuda_kind, cuda_scores, poison):
    _check_live_tail_matters(cuda_scores, cuda_kind, POISONS[poison])

"""No ``--dsa-topk-backend`` transform reads the logits past a row's length, so the kernel need not write there.

The bf16 logits kernel leaves every column at or past ``seq_lens[t]`` unwritten (decode runs at the
CUDA-graph capture width). Each test scores rows of several lengths at a wide width with the real
kernel, then runs the backend's real transform through the package's dispatch (``run_topk_transform``)
twice: once with the unwritten region poisoned with NaN, once with it set to -inf (what the old kernel
wrote and upstream's torch fp8 path writes). The selected pool slots must be identical.

What runs where:
- ``torch``: upstream's ``topk_transform_pytorch_vectorized``, on the CPU.
- ``flashinfer`` (unfused, upstream's default): upstream's ``topk_transform_flashinfer_unfused``; on a
  host without CUDA its ``flashinfer.top_k`` (a CUDA kernel) is replaced by ``torch.topk`` with the
  same call contract, so what is tested is upstream's masking around it.
- ``flashinfer`` fused (``SGLANG_DSA_FUSE_TOPK``) and ``sgl-kernel`` v1 / v2: CUDA JIT kernels of the
  sglang pin, run only under ``-m gpu`` on a host with sglang and CUDA. They have not been run by this
  project (the lent H200 has no sglang); their sources loop only to ``seq_len`` (``topk_v1.cuh``
  ``topk_transform_kernel``, ``topk_v2.cuh``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import logits_case

LENS = [1, 200, 512, 513, 900, 2000]
WIDTH = 4096
TOPK = 512
HAS_CUDA = torch.cuda.is_available()


def _poisoned_logits(kern, gen, device):
    q, w, pages, sl, pt = (t.to(device) for t in logits_case(LENS, 16, gen))
    pt = torch.cat([pt, torch.zeros((len(LENS), WIDTH // 64 - pt.shape[1]), dtype=torch.int32, device=device)], 1)
    nan = torch.full((len(LENS), WIDTH), float("nan"), device=device)
    kern.bf16_paged_mqa_logits(q, pages, w, sl, pt, WIDTH, out=nan)
    past = torch.arange(WIDTH, device=device)[None, :] >= sl[:, None]
    assert nan[past].isnan().all() and not nan[~past].isnan().any()
    return nan, nan.masked_fill(past, float("-inf")), sl, pt


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


def _torch_topk_as_flashinfer(x, k, sorted=False, **flashinfer_only):
    """flashinfer.top_k's contract (values, indices) on torch.topk, for hosts without CUDA."""
    return torch.topk(x, k, dim=-1, largest=True, sorted=sorted)


def _check(kern, kind, device):
    gen = torch.Generator().manual_seed(21)
    nan, neg_inf, sl, pt = _poisoned_logits(kern, gen, device)
    a, b = _select(kind, nan, sl, pt), _select(kind, neg_inf, sl, pt)
    assert torch.equal(a, b), f"{kind}: the selection depends on logits past the row's length"
    for r, n in enumerate(LENS):
        assert int((a[r] >= 0).sum()) == min(n, TOPK), f"{kind}: row {r} selects {min(n, TOPK)} live keys"


@pytest.fixture
def logits_kernel(kern):
    return SimpleNamespace(bf16_paged_mqa_logits=kern.mqa_logits.bf16_paged_mqa_logits)


def test_torch_transform_ignores_logits_past_the_length(logits_kernel):
    _check(logits_kernel, "torch", "cpu")


def test_flashinfer_unfused_transform_ignores_logits_past_the_length(logits_kernel, monkeypatch):
    import flashinfer

    monkeypatch.setattr(flashinfer, "top_k", _torch_topk_as_flashinfer)  # CUDA-only op; see the module doc
    _check(logits_kernel, "flashinfer", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA JIT kernels of the pin (sglang + CUDA host)")
@pytest.mark.parametrize("kind", ["sgl-kernel:v1", "sgl-kernel:v2", "flashinfer", "flashinfer:fused"])
def test_cuda_transforms_ignore_logits_past_the_length(kind, monkeypatch):
    from sglang.srt.environ import envs

    from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits

    monkeypatch.setattr(envs.SGLANG_OPT_USE_TOPK_V2, "get", lambda: kind == "sgl-kernel:v2")
    _check(SimpleNamespace(bf16_paged_mqa_logits=bf16_paged_mqa_logits), kind, "cuda")

"""Upstream's kernels that ours is held against, and the fp8 inputs they read.

TileLang fp8 ``tilelang_fp8_paged_mqa_logits``, the kernel the pin runs by default on sm_120
(``SGLANG_OPT_USE_TILELANG_INDEXER=1`` from ``arg_groups/model_hook.py``), built here for sm_90, is loaded
from ``PATH/tilelang_kernel.py``: ``sglang/kernels/ops/attention/dsa/tilelang_kernel.py`` from the
sglang==0.5.23 wheel, run unmodified. The H200 image has no sglang, so the two sglang helpers that file
imports (``is_fp8_fnuz``, ``is_hip``, ``is_gfx95_supported``: platform probes, all False on an NVIDIA GPU) are
given as stand-in modules before it is loaded; nothing else of sglang is involved.

DeepGEMM, the pin's default on sm_90, is loaded from ``--deepgemm DEST``, a build as
``bench/build_deepgemm_device.sh build`` made it (that script is at commit 6f9738b, removed since; git history
keeps it): ``fp8_paged_mqa_logits`` for decode and target-verify, ``fp8_mqa_logits`` on the request's
gathered keys for prefill (``deepgemm_info`` says how each is called). ``--deepgemm-warm`` JIT-compiles its
kernel variants first.

The fp8 side reads fp8 pages made from the same keys (per-token e4m3 with an fp32 scale, upstream's 132-byte
layout). Without a peer its columns are None and the JSON says why.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import D, H, PAGE, SIZES, TOPK


def load_tilelang(path: str | None):
    """upstream's ``tilelang_fp8_paged_mqa_logits`` from the pinned wheel's file, or (None, why not)."""
    if not path:
        return None, "no --tilelang file given"
    probes = {"sglang.kernels.ops.quantization.fp8_kernel": {"is_fp8_fnuz": lambda: False},
              "sglang.srt.utils": {"is_hip": lambda: False, "is_gfx95_supported": lambda: False}}
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.quantization", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    for name, attrs in probes.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
    try:
        spec = importlib.util.spec_from_file_location("upstream_tilelang_kernel", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.tilelang_fp8_paged_mqa_logits, None
    except Exception as exc:  # reported in the JSON: the run goes on without the peer column
        return None, f"{type(exc).__name__}: {exc}"


def fp8_rows(x):
    """Per-row (last dim) e4m3 with an fp32 scale amax / 448, as upstream's fp8 index keys and queries."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def fp8_pool(pages_bf16):
    """upstream's fp8 index-K page layout: [64 x 128 e4m3 keys | 64 x fp32 scales] = 8448 bytes per page."""
    k8, ks = fp8_rows(pages_bf16)
    n = pages_bf16.shape[0]
    raw = torch.cat([k8.view(torch.uint8).reshape(n, -1), ks.contiguous().view(torch.uint8).reshape(n, -1)], 1)
    return raw.view(n, PAGE, 1, D + 4)


class Fp8Peer:
    """The same queries and keys in upstream's fp8 format, and a call of upstream's TileLang kernel on them."""

    name = "fp8"  # the JSON keys of this peer: fp8_ms, fp8_vs_bf16_*, and "ratio" (ours / fp8)

    def __init__(self, fn, pool8):
        self.fn, self.pool8 = fn, pool8

    def bind(self, q, w, sl, pt, width):
        """The kernel's call on these inputs as a no-argument function; quantising q is outside it."""
        q8, w8 = fp8_query(q, w)
        q8 = q8.unsqueeze(1).contiguous()
        return lambda: self.fn(q8, self.pool8, w8, sl, pt, None, width, False)

    def scored_lens(self, sl):
        return sl

    def setup_ms(self, sl):
        return {}


def fp8_query(q, w):
    """upstream's fp8 query: per-head e4m3 rows, the fp32 row scale folded into the head weights."""
    q8, qs = fp8_rows(q)
    return q8, (w * qs).contiguous()


def load_deepgemm(build: str | None):
    """DeepGEMM as built by bench/build_deepgemm_device.sh at commit 6f9738b (``build`` holds deep_gemm/), or (None, why not)."""
    if not build:
        return None, "no --deepgemm build given (bench/build_deepgemm_device.sh at commit 6f9738b built one on the GPU host)"
    # Imported from that folder by a spec for its package, not by adding the folder to the import path:
    # nothing else there (csrc/, fmt/, the host headers) becomes importable, and no other deep_gemm answers.
    package = Path(build).resolve() / "deep_gemm"
    spec = importlib.util.spec_from_file_location("deep_gemm", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    deep_gemm = importlib.util.module_from_spec(spec)
    sys.modules["deep_gemm"] = deep_gemm  # where its relative imports (``from . import _C``) look for it
    try:
        spec.loader.exec_module(deep_gemm)
        return deep_gemm, None
    except Exception as exc:  # reported in the JSON: the run goes on without the column
        sys.modules.pop("deep_gemm", None)
        return None, f"{type(exc).__name__}: {exc}"


def deepgemm_info(dg, build):
    """What was loaded and how the bench calls it, for the JSON."""
    manifest = Path(build) / "MANIFEST"
    return {"version": getattr(dg, "__version__", None), "num_sms": dg.get_num_sms(),
            "manifest": manifest.read_text().splitlines() if manifest.exists() else None,
            "decode_and_verify": "fp8_paged_mqa_logits(q [rows,1,64,128] e4m3, kv_cache [pages,64,1,132] uint8, "
                                 "weights [rows,64] fp32 (head weight x q scale), context_lens [rows,1] int32, "
                                 "block_table, schedule, width, clean_logits=False): the pin's c4 call on sm_90 "
                                 "(one row per request, target-verify rows too)",
            "schedule": "get_paged_mqa_logits_metadata(context_lens, 64, num_sms), built once per shape outside "
                        "the timed region and the CUDA graph: the pin builds it once per forward in "
                        "PagedIndexerMetadata, shared by every layer, before graph replay. The pin's default "
                        "planner is sglang's own JIT kernel (SGLANG_OPT_USE_JIT_INDEXER_METADATA), which needs "
                        "sglang, absent on the H200 image; this is DeepGEMM's planner; deepgemm_metadata_ms is its time",
            "prefill": "fp8_mqa_logits(q [rows,64,128] e4m3, (keys [n,128] e4m3, scales [n] fp32), weights, "
                       "ks=0, ke=length or 0 where length <= 512, clean_logits=False, max_seqlen_k=align(n, 64)): "
                       "the pin's non-paged path for one request of >= 8192 rows (SGLANG_OPT_DSV4_NONPAGED_INDEXER), "
                       "rows of <= 512 keys left to the SGL top-k as the pin does; the per-layer key gather "
                       "(sglang's kernel) is not timed"}


class DeepGemmPagedPeer:
    """DeepGEMM's paged fp8 kernel on the same fp8 pages and page tables, called as the pin calls it on sm_90."""

    name = "deepgemm"

    def __init__(self, dg, pool8):
        self.dg, self.pool8 = dg, pool8

    def schedule(self, sl):
        return self.dg.get_paged_mqa_logits_metadata(sl.view(-1, 1).contiguous(), PAGE, self.dg.get_num_sms())

    def bind(self, q, w, sl, pt, width):
        q8, w8 = fp8_query(q, w)
        q8 = q8.unsqueeze(1).contiguous()
        lens = sl.view(-1, 1).contiguous()
        meta = self.schedule(sl)
        return lambda: self.dg.fp8_paged_mqa_logits(q8, self.pool8, w8, lens, pt, meta, width, False)

    def scored_lens(self, sl):
        return sl

    def setup_ms(self, sl):
        """The schedule's own time: once per forward in serving, shared by the layers, so not in deepgemm_ms."""
        return {"deepgemm_metadata_ms": g.median_ms(lambda: self.schedule(sl), rep=20)}


class DeepGemmRaggedPeer(DeepGemmPagedPeer):
    """DeepGEMM's non-paged fp8 kernel: the pin's sm_90 prefill of one request (keys gathered once, contiguous)."""

    def bind(self, q, w, sl, pt, width):
        q8, w8 = fp8_query(q, w)
        n = int(sl.max())
        pages = self.pool8[pt[0, : math.ceil(n / PAGE)].long()].view(-1, PAGE * (D + 4))
        keys = pages[:, : PAGE * D].reshape(-1, D)[:n].view(torch.float8_e4m3fn).contiguous()
        scales = pages[:, PAGE * D:].reshape(-1, 4)[:n].contiguous().view(torch.float32).view(-1)
        ks = torch.zeros_like(sl)
        ke = self.scored_lens(sl)
        max_k = math.ceil(n / PAGE) * PAGE
        return lambda: self.dg.fp8_mqa_logits(q8, (keys, scales), w8, ks, ke, clean_logits=False, max_seqlen_k=max_k)

    def scored_lens(self, sl):
        return torch.where(sl > TOPK, sl, torch.zeros_like(sl)).to(torch.int32).contiguous()

    def setup_ms(self, sl):
        return {}


def warm_deepgemm(build):
    """JIT-compiles, one process each and all at once, the DeepGEMM kernel variants the run will call.

    nvcc takes tens of seconds a variant; the timed run then finds them in DeepGEMM's on-disk cache.
    The paged kernel and the prefill kernel have one variant for all shapes here; the schedule kernel
    has one per batch rounded up to 32 rows.
    """
    rows = sorted(set(SIZES["decode_b"]) | {2 * b for b, _ in SIZES["verify"]})
    by_aligned = {}
    for r in rows:
        by_aligned.setdefault(math.ceil(r / 32), r)
    specs = [f"paged:{rows[0]}"] + [f"schedule:{r}" for r in by_aligned.values() if r != rows[0]] + ["ragged:256"]
    t0 = datetime.datetime.now()
    procs = {spec: subprocess.Popen([sys.executable, "-m", "bench.indexer", "--deepgemm", build,
                                        "--deepgemm-warm-one", spec])
             for spec in specs}
    codes = {spec: proc.wait() for spec, proc in procs.items()}
    print(f"deepgemm warm-up {codes} in {(datetime.datetime.now() - t0).total_seconds():.0f} s", flush=True)


def warm_deepgemm_one(dg, spec):
    """One variant of warm_deepgemm, on tiny inputs with the run's template parameters (heads, dims, pages)."""
    kind, rows = spec.split(":")
    rows, keys = int(rows), 1024
    pool = torch.randn((keys // PAGE, PAGE, D), device=cases.DEV).to(torch.bfloat16)
    q = torch.randn((rows, H, D), device=cases.DEV).to(torch.bfloat16)
    w = torch.randn((rows, H), device=cases.DEV)
    sl = torch.full((rows,), keys, dtype=torch.int32, device=cases.DEV)
    pt = torch.arange(keys // PAGE, dtype=torch.int32, device=cases.DEV).expand(rows, -1).contiguous()
    peer = (DeepGemmRaggedPeer if kind == "ragged" else DeepGemmPagedPeer)(dg, fp8_pool(pool))
    if kind == "schedule":
        peer.schedule(sl)
    else:
        peer.bind(q, w, sl, pt, keys)()
    torch.cuda.synchronize()

"""Helpers shared by the H200 benches: ceilings, timing, run metadata. torch + triton only.

The benches import ``dsv4_sm120`` as Python finds it: the installed package, or this checkout's with
``PYTHONPATH=src`` (how bench/README.md runs them, from the repository root as ``python -m bench.NAME``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from harness import run_record

REPO = run_record.REPO


_DRY = {"on": False}


def dry_run_mode() -> None:
    """CPU check of a bench script: wall-clock timing, tiny ceilings, no CUDA calls."""
    _DRY["on"] = True


def median_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """Median of CUDA-event timings (triton.testing.do_bench), after warm-up."""
    if _DRY["on"]:
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def hbm_ceilings(gib: float = 4.0) -> dict:
    """Measured HBM read bandwidth (a streaming read kernel) and copy bandwidth (read + write), GB/s."""
    dev = "cpu" if _DRY["on"] else "cuda"
    n = int((1 / 1024 if _DRY["on"] else gib) * (1 << 30)) // 2
    x = torch.randn(n, dtype=torch.bfloat16, device=dev)
    block, iters = 4096, 16
    grid = triton.cdiv(n, block * iters)
    partial = torch.empty(grid, dtype=torch.float32, device=dev)
    read_ms = median_ms(lambda: _read_kernel[(grid,)](x, partial, n, BLOCK=block, ITERS=iters, num_warps=8))
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x))
    nbytes = x.numel() * 2
    del x, y
    if not _DRY["on"]:
        torch.cuda.empty_cache()
    return {"hbm_read_gbps": nbytes / read_ms / 1e6, "hbm_copy_gbps": 2 * nbytes / copy_ms / 1e6,
            "hbm_probe_bytes": nbytes}


def gemm_ceiling(size: int = 8192) -> dict:
    """Measured dense bf16 GEMM rate on random data (torch.matmul / cuBLAS), TFLOP/s."""
    dev = "cpu" if _DRY["on"] else "cuda"
    size = 256 if _DRY["on"] else size
    a = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    ms = median_ms(lambda: a @ b)
    return {"gemm_bf16_tflops": 2 * size**3 / ms / 1e9, "gemm_size": size}


def preheat(ms: float = 100.0) -> None:
    """Keep the GPU busy for about ``ms`` so the next timing does not start at idle clocks."""
    if _DRY["on"]:
        return
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t[0].record()
    while True:
        for _ in range(20):
            a @ a
        t[1].record()
        t[1].synchronize()
        if t[0].elapsed_time(t[1]) >= ms:
            return


def fp8_gemm_ceiling(size: int = 8192) -> dict:
    """Measured dense e4m3 GEMM rate on random data (torch._scaled_mm, fp32 scales, bf16 out), TFLOP/s."""
    if _DRY["on"]:
        return {"gemm_fp8_tflops": None}
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    try:
        ms = median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except Exception as exc:  # recorded: the fp8 ceiling is context, not a gate
        return {"gemm_fp8_tflops": None, "gemm_fp8_error": f"{type(exc).__name__}: {exc}"}
    return {"gemm_fp8_tflops": 2 * size**3 / ms / 1e9}


def run_meta() -> dict:
    return {
        "commit": run_record.commit(),
        "device": "cpu (dry run)" if _DRY["on"] else torch.cuda.get_device_name(),
        "capability": "" if _DRY["on"] else ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": run_record.now_utc(),
    }

"""The device run of the top-k poison tests: a header (device, versions, each JIT compile's time), then pytest.

Run from the repository root as ``python -m tests.kernels.topk_device_run`` (``bench/topk_poison_h200.sh device``,
at commit b8292e6 and removed since, ran it by path) on a fresh machine with empty JIT caches, so each time below
is a cold compile of one of sglang's top-k modules (nvcc through sglang's own ninja build), then the
``gpu`` tests of ``test_topk_poison.py`` in this same process (one import of the chain, not two; the
tests reuse the loaded modules). v1 builds beside the occupancy probe and v2 (which needs the probe's
answer first), so the compile times overlap. The private ``_jit_*`` loaders are upstream's own (sglang's
``kernels/ops/attention/dsv4/topk.py`` and ``kernels/jit/utils/occupancy.py``), called directly only to
time them one by one; flashinfer's ``get_topk_module`` loads the ahead-of-time build that came in the bundle.
"""

from __future__ import annotations

import importlib.metadata as metadata
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import topk_standins

TESTS = Path(__file__).with_name("test_topk_poison.py")


def timed(label: str, build) -> str:
    start = time.perf_counter()
    try:
        build()
        return f"{label}: {time.perf_counter() - start:.1f} s"
    except Exception as exc:  # reported, not raised: pytest still runs and shows the failing tests
        return f"{label}: FAILED after {time.perf_counter() - start:.1f} s: {exc!r}"


def header() -> None:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, capability sm_{props.major}{props.minor}, {props.multi_processor_count} SMs")
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}")
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("sglang", "flashinfer-python", "apache-tvm-ffi"))
    print(f"pin packages: {versions}")
    print(f"stand-ins (harness/topk_standins.py): {', '.join(topk_standins.install_missing()) or 'none'}")

    start = time.perf_counter()
    import flashinfer.topk
    from sglang.kernels.jit.utils import occupancy
    from sglang.kernels.ops.attention.dsv4 import topk

    from dsv4_sm120.model.deepseek_v4 import run_topk_transform  # noqa: F401  (the test's import chain)

    print(f"import chain: {time.perf_counter() - start:.1f} s")
    def probe_then_v2() -> list[str]:
        return [
            timed("jit sgl-kernel occupancy probe (occupancy/cluster_probe.cuh, for v2)", occupancy._jit_probe_module),
            timed("jit sgl-kernel topk_v2 (deepseek_v4/topk_v2.cuh)", topk._jit_topk_v2_module),
        ]

    with ThreadPoolExecutor(2) as pool:
        v1 = pool.submit(timed, "jit sgl-kernel topk_v1 (deepseek_v4/topk_v1.cuh)", topk._jit_topk_v1_module)
        v2 = pool.submit(probe_then_v2)
        for line in [v1.result(), *v2.result()]:
            print(line)
    print(timed("load flashinfer topk (ahead-of-time build, FLASHINFER_DISABLE_JIT=1)", flashinfer.topk.get_topk_module))


if __name__ == "__main__":
    header()
    print("--- pytest", flush=True)
    sys.exit(pytest.main(["-v", "-p", "no:cacheprovider", "-m", "gpu", str(TESTS)]))

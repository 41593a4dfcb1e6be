"""Launch lines of the real ``sglang.launch_server`` processes a GPU serving run starts, and starting them.

A :class:`ServerSpec` is one server as an operator would launch it: the model, ``--model-impl``, the
package's switches, CUDA graphs or eager, and upstream's indexer kernel for the fp8 side. Everything a
run adds beyond that is here, in :data:`BASE_ENV` and :func:`ServerSpec.argv`, with the reason:

- Loopback only (``--host 127.0.0.1``, ``SGLANG_HOST_IP``) and NVLink multicast off in NCCL, PyTorch and
  NVSHMEM: a shared GPU host must not be put out of service by a multicast object.
- ``SGLANG_DSV4_FP4_EXPERTS=0``: with no quantization config the pin assumes mxfp4 routed experts
  (``configs/model_config.py``), which dummy bf16 weights are not.
- ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`` and ``SGLANG_IS_FLASHINFER_AVAILABLE=0``: the bundle
  leaves out sglang's rust radix-tree extension and flashinfer (neither is DSV4-specific; upstream's
  python radix tree and pytorch sampling are its own implementations of the same steps).
- ``--load-format dummy --skip-tokenizer-init``: the checkpoints are config-only
  (``harness/dsv4_checkpoints.py``) and requests carry token ids. A spec with a ``tokenizer`` gets
  ``--tokenizer-path`` instead (the ``pd`` set, whose clients are the CPU end-to-end suite's chat clients).

Processes are started and stopped through ``harness/servers.py`` (free loopback ports, own session,
bounded start and stop by PID, logs kept), the same code the CPU end-to-end suite uses, imported by its
full name: ``python -m bench.gpu_server`` from the repository root puts the checkout first on the path,
so a package named ``harness`` on a GPU host's image cannot stand in for the checkout's.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from harness import servers as processes

LOOPBACK, Proc, free_port, log_tail = processes.LOOPBACK, processes.Proc, processes.free_port, processes.log_tail

BASE_ENV = {
    "SGLANG_HOST_IP": LOOPBACK,
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "SGLANG_DSV4_FP4_EXPERTS": "0",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "SGLANG_IS_FLASHINFER_AVAILABLE": "0",
    "PYTHONUNBUFFERED": "1",
}

# Upstream's fp8 indexer kernels on the fp8 side, by name (``layers/attention/dsv4/indexer.py``): DeepGEMM's
# ``fp8_paged_mqa_logits`` is the sm_90 default; TileLang's is the sm_120 default (set by upstream's
# model hook there), the kernel the package's bf16 path is held against.
UPSTREAM_INDEXERS = {
    "deepgemm": {},
    "tilelang": {"SGLANG_OPT_USE_TILELANG_INDEXER": "1"},
}


@dataclass
class ServerSpec:
    """One server of a run (see the module doc)."""

    name: str
    model: str  # a checkpoint of harness/dsv4_checkpoints.py
    impl: str  # --model-impl: "sglang" or "dsv4"
    graphs: bool = True
    index_k: str = "bf16"  # DSV4_SM120_INDEX_K_DTYPE under --model-impl dsv4
    upstream_indexer: str = "deepgemm"  # the fp8 kernel where keys are fp8
    # Each server's KV budget is what is free when it profiles minus (1 - this) x what was free when it started;
    # servers started together may see each other's memory only in the second reading, so the share must cover
    # all the others' use (the pools themselves are capped by --max-total-tokens, not by this).
    mem_fraction: float = 0.3
    max_total_tokens: int = 262144
    context_length: int = 20480
    max_running: int = 64
    # Decode graphs only for the batch sizes the sets time (1, 8, 64; others pad up to the next): on a cold JIT
    # cache, capturing upstream's twelve default sizes compiled for minutes before a server was healthy.
    graph_batches: tuple = (1, 8, 64)
    chunked_prefill: int = 8192
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict = field(default_factory=dict)
    tokenizer: Path | None = None  # --tokenizer-path; None: --skip-tokenizer-init, requests carry token ids

    def env(self) -> dict:
        """The variables this server sets on top of the GPU host's environment."""
        env = dict(BASE_ENV)
        if self.impl == "dsv4":
            env["DSV4_SM120_INDEX_K_DTYPE"] = self.index_k
        else:
            env["SGLANG_PLUGINS"] = "none"  # upstream as it ships, the package not loaded at all
        if self.impl == "sglang" or self.index_k == "fp8":
            env.update(UPSTREAM_INDEXERS[self.upstream_indexer])
        env.update(self.extra_env)
        return env

    def argv(self, models_root: Path, port: int) -> list[str]:
        args = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(models_root / self.model), "--model-impl", self.impl,
            "--load-format", "dummy", "--tp", "1",
            "--host", LOOPBACK, "--port", str(port),
            "--mem-fraction-static", str(self.mem_fraction), "--max-total-tokens", str(self.max_total_tokens),
            "--context-length", str(self.context_length), "--max-running-requests", str(self.max_running),
            "--chunked-prefill-size", str(self.chunked_prefill),
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--random-seed", "0",
            "--enable-metrics", "--cuda-graph-backend-prefill", "disabled",
        ]
        args += ["--tokenizer-path", str(self.tokenizer)] if self.tokenizer else ["--skip-tokenizer-init"]
        if self.impl == "dsv4":  # the package's servers warm every shape up before they report healthy
            args += ["--warmups", "dsv4_shapes"]
        if self.graphs:
            args += ["--cuda-graph-bs-decode", *(str(b) for b in self.graph_batches if b <= self.max_running)]
        else:
            args += ["--cuda-graph-backend-decode", "disabled"]
        return args + list(self.extra_args)


@dataclass
class Started:
    spec: ServerSpec
    proc: Proc
    env: dict
    started_at: float = 0.0
    healthy_after_s: float | None = None

    @property
    def url(self) -> str:
        return self.proc.url


def start(spec: ServerSpec, models_root: Path, log_dir: Path) -> Started:
    """Start ``spec`` on a free loopback port; its log goes to ``log_dir/<name>.log``."""
    port = free_port()
    env = spec.env()
    proc = Proc(spec.name, spec.argv(models_root, port), Path(log_dir) / f"{spec.name}.log", f"http://{LOOPBACK}:{port}")
    proc.start({**os.environ, **env})
    return Started(spec, proc, env, started_at=time.monotonic())


def wait_healthy(started: list[Started], timeout: float) -> None:
    """Until every server answers /health_generate; the first to die or time out raises with its log tail."""
    def one(s: Started) -> None:
        s.proc.wait_ready("/health_generate", timeout)
        s.healthy_after_s = round(time.monotonic() - s.started_at, 1)

    if not started:  # a set of pairs only (the agents set's PD pairs alone on an 80 GB GPU) starts no single
        return
    with ThreadPoolExecutor(len(started)) as pool:
        for fut in [pool.submit(one, s) for s in started]:
            fut.result()


def launch_line(s: Started) -> str:
    """The launch as an operator would type it: the variables set, then the command."""
    env = " ".join(f"{k}={v}" for k, v in sorted(s.env.items()))
    argv = ["python"] + s.proc.argv[1:]
    return f"{env} {' '.join(argv)}"

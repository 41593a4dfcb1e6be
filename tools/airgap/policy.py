"""What a GPU-host bundle carries of the pin, what it leaves to the host's own image, and why.

The bundle starts from every distribution ``sglang==0.5.23`` requires, transitively, as pip resolves
them for CPython 3.12 on x86-64 Linux, and takes out two kinds:

- ``IMAGE``: left to the GPU host's Python, which has them at a version that serves the pin
  (``/work/.library/device/KINDS.md`` lists the image: torch 2.11 + CUDA 13.0, numpy 2.5.2, ...).
  Only large packages go here; a small one is carried even when the image has it, since carrying
  costs little and the image's version is mostly unknown.
- ``DROPPED``: the DSV4 server never imports them on its path (each import site is guarded, lazy,
  or behind a flag the DSV4 runs do not set); carrying them would cost parts and buy nothing.

Neither list's requirements are followed: what a dropped package alone needs is dropped with it,
except what the server imports itself (``ALSO``).
``trims`` takes files out of carried distributions (upstream's test trees, kernels built for other
GPUs or for another Python). The rehearsal (``python -m tools.airgap rehearse``) imports the
server's chain with only the bundle and the image's packages visible, so a wrong entry here shows up
as a missing module before any GPU host's time is spent.
"""

from __future__ import annotations

ROOT_REQUIREMENT = "sglang==0.5.23"
# Imported unconditionally by the server but required only through a distribution dropped below:
# carried in their own right (the venv's versions).
ALSO = {
    "dill": "sglang.srt.sampling.custom_logit_processor imports it; sglang requires it only through datasets",
    "jsonschema": "sglang.srt.entrypoints.openai.serving_chat imports it; sglang requires it only through outlines",
}

# Where pip resolves the bundle: the GPU host's interpreter (PEP 508 marker variables).
TARGET_ENV = {
    "implementation_name": "cpython",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
}

_CUDA_LIBS = ("the image's CUDA 13 libraries (its torch 2.11.0+cu130 uses them); unpack links them where torch "
              "2.14.1 looks for them (<site>/nvidia/...), as GPU_SERVING.md ran it on an H200")
_SAME = "the image has {}, the version the pin installs"

IMAGE = {
    "numpy": "the image has numpy 2.5.2; the pin asks any numpy and the carried compiled packages use numpy 2's stable ABI",
    "scipy": "the image has scipy, built for its numpy; only transformers' loss modules import it",
    "pillow": "the image has pillow; the pin asks any version (images in requests only)",
    "sympy": "torch's symbolic shapes; torch 2.14.1 asks sympy>=1.13.3, as the image's torch does",
    "networkx": "torch 2.14.1 asks networkx>=2.5.1, as the image's torch does",
    "mpmath": "sympy's, with the image's sympy",
    "setuptools": "the image has setuptools (torch.utils.cpp_extension imports it)",
    "ninja": "the JIT builds run the image's ninja command",
    "numba": "not imported on the DSV4 path (multimodal image processing only); the image has numba",
    "llvmlite": "numba's, with the image's numba",
    "torchaudio": _SAME.format("torchaudio 2.11.0"),
    "tokenizers": _SAME.format("tokenizers 0.23.2"),
    "tiktoken": _SAME.format("tiktoken 0.14.0"),
    "safetensors": _SAME.format("safetensors 0.8.0"),
    "huggingface-hub": _SAME.format("huggingface_hub 1.33.0"),
    **{name: _CUDA_LIBS for name in (
        "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cufft",
        "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-nvjitlink", "nvidia-cuda-cupti",
        "nvidia-nvtx", "nvidia-cufile", "nvidia-cusparselt-cu13", "nvidia-nvshmem-cu13")},
    "nvidia-cudnn-cu13": _CUDA_LIBS + "; the image's cuDNN is 9.19, torch 2.14.1 was built with 9.24 and refuses "
                         "an older one only when cuDNN is first used, which a DSV4 forward never does",
}

_FLASHINFER = "FlashInfer's own dependency"
DROPPED = {
    "flashinfer-python": "DSV4 on Hopper runs upstream's dsv4 attention (FlashMLA), JIT and Triton kernels; every "
                         "FlashInfer import on that path is guarded (GPU_SERVING.md's servers ran without it); 580 MB",
    "nvidia-cudnn-frontend": _FLASHINFER,
    "cuda-tile": _FLASHINFER,
    "nccl4py": _FLASHINFER,
    "nccl-extensions": _FLASHINFER,
    "nvidia-cutlass-dsl": "CuTe DSL, for FlashAttention 4, quack and humming kernels: none on the DSV4 Hopper path; 485 MB",
    "flash-attn-4": "FlashAttention 4 (Blackwell); sglang's import is guarded",
    "quack-kernels": "CuTe DSL kernels; not on the DSV4 path",
    "humming-kernels": "CuTe DSL kernels; not on the DSV4 path",
    "sgl-deep-ep": "DeepEP all-to-all, imported only with --moe-a2a-backend deepep",
    "nvshmem4py-cu13": "DeepEP's NVSHMEM binding",
    "nvidia-mathdx": "cuBLASDx headers for JIT kernels off the DSV4 path (GPU_SERVING.md's servers built all 18 "
                     "DSV4 JIT modules without it); 123 MB",
    "torchcodec": "video inputs only; sglang's import is guarded",
    "mistral-common": "Mistral tokenizers; gguf's import is guarded",
    "modelscope": "downloads from ModelScope; the GPU host has no network",
    "kernels": "downloads kernels from the Hugging Face hub; the GPU host has no network",
    "datasets": "benchmark datasets only",
    "timm": "vision encoders of multimodal models only",
    "torch-memory-saver": "--enable-memory-saver only; sglang's import is guarded",
    "jedi": "IPython's completion, never reached by sglang's IPython.display import",
    "openai-harmony": "gpt-oss's message format: /v1/responses needs it, and sglang turns that endpoint off with a "
                      "warning when it cannot load (as it does anyway without network, for the harmony vocabulary)",
    "tml-renderers": "the Inkling output parser only",
    "llguidance": "--grammar-backend llguidance only (the default is xgrammar)",
    "outlines": "--grammar-backend outlines only (the default is xgrammar)",
    "smg-grpc-servicer": "--grpc-mode only",
    "anthropic": "the Anthropic messages endpoint's client types; imported only when that endpoint is used",
    "blobfile": "reads tiktoken files from gs:// or az:// paths; checkpoints here are local",
}

# Distributions of this size (after trims) get an archive of their own, so that the GPU host
# decompresses them side by side; smaller ones share one.
OWN_ARCHIVE_BYTES = 32 << 20


def skip_triton() -> tuple[str, str]:
    return "triton", "--no-triton: the image's Triton 3.6 runs upstream's and the plugin's Triton kernels"


def skip_tilelang() -> dict[str, str]:
    why = "--no-tilelang: upstream's TileLang indexer and mHC kernels are not run (their Triton/torch routes are)"
    return {"tilelang": why, "z3-solver": why, "torch-c-dlpack-ext": why}


def trims(archs: tuple[int, ...]) -> dict[str, list[tuple[str, str]]]:
    """Per distribution, (glob over site-packages paths, reason) of files not carried for GPUs of ``archs``."""
    hopper_only = all(a == 90 for a in archs)
    blackwell = any(a >= 100 for a in archs)
    sgl_kernel = [
        ("sgl_kernel/flash_ops.abi3.so", "FlashAttention 3 (1.07 GB): only the fa3 attention backend and vision "
                                         "encoders load it; DSV4 runs the dsv4 backend"),
        ("sgl_kernel/infllm_ops.cpython-310-*", "built for CPython 3.10"),
    ]
    if 90 not in archs:
        sgl_kernel.append(("sgl_kernel/sm90/*", "common_ops for sm_90 only; no target is sm_90"))
    if hopper_only:
        sgl_kernel.append(("sgl_kernel/sm100/*", "common_ops for GPUs other than sm_90 (sgl_kernel/load_utils.py)"))
    triton = [
        ("triton/backends/nvidia/lib/cupti/*", "CUPTI, for the proton profiler only"),
        ("triton/backends/nvidia/lib/cupti-blackwell/*", "CUPTI, for the proton profiler only"),
        ("triton/_C/libproton.so", "the proton profiler"),
        ("triton/profiler/*", "the proton profiler"),
        ("triton/backends/nvidia/bin/nvdisasm", "SASS disassembly for debugging dumps"),
        ("triton/instrumentation/*", "instrumentation passes for profiling"),
    ]
    if not blackwell:
        triton.append(("triton/backends/nvidia/bin/ptxas-blackwell", "ptxas for sm_100 and later"))
    return {
        "sglang": [
            ("sglang/multimodal_gen/*", "diffusion serving, not the LLM server"),
            ("sglang/test/*", "upstream's tests; imported only under SGLANG_TEST_* switches"),
            ("sglang/benchmark/*", "benchmark clients; the server imports none (sglang.bench_serving needs it)"),
            ("sglang/srt/rust_extensions/*.so", "the Rust server, gRPC and multimodal extensions, loaded only "
                                                "in those modes"),
        ],
        "sglang-kernel": sgl_kernel,
        "triton": triton,
        "tilelang": [("tilelang/3rdparty/composable_kernel/*", "AMD Composable Kernel headers (ROCm only)")],
    }


# --with-pd: what a prefill/decode pair over NIXL behind the PD router needs beyond the serving stack.
# sglang requires neither; both pins are what the CPU tests of the PD pair ran (UPSTREAM_MAP.md).
PD_REQUIREMENTS = {
    "nixl==1.5.1": "sglang's disaggregation/nixl/conn.py imports nixl._api (the meta package, which picks "
                   "nixl_cu13 by the CUDA version of the torch already imported)",
    "sglang-router==0.3.2": "the PD router in front of the pair (python -m sglang_router.launch_router "
                            "--pd-disaggregation), a Rust extension in a Python wheel",
}
# Libraries every Linux host has; the PD record lists only what the host must add beyond these.
BASE_LIBRARIES = ("libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0", "libgcc_s.so.1",
                  "libstdc++.so.6", "ld-linux-x86-64.so.2")


# --with-flashinfer: FlashInfer (the pin's version) and what only it needs, taken off ``DROPPED``. sglang's
# speculative sampling at temperature > 0 builds a JIT kernel that includes FlashInfer's headers, found without
# importing FlashInfer (``sglang/kernels/jit/utils/deps.py``); with FlashInfer importable, a server that leaves
# ``--sampling-backend`` at its default also samples with FlashInfer, as on a host where pip installed the pin.
FLASHINFER = ("flashinfer-python", "nvidia-cudnn-frontend", "cuda-tile", "nccl4py", "nccl-extensions",
              "nvidia-cutlass-dsl")
FLASHINFER_REASON = ("speculative decoding sampled at temperature > 0 JIT-builds a kernel on FlashInfer's headers "
                     "(sglang/kernels/jit/utils/deps.py); the pin's FlashInfer with the CuTe DSL and cuDNN frontend "
                     "its import loads")


def flashinfer_dropped() -> dict[str, str]:
    """What FlashInfer's requirements reach but the GPU host never loads."""
    return {"nvidia-cutlass-dsl-libs-cu12": "the CuTe DSL runtime for CUDA 12; the pin's torch 2.14.1 is a CUDA 13.0 "
                                            "build, and the cu13 runtime is carried"}


def pd_dropped() -> dict[str, str]:
    """What nixl 1.5.1 requires but the GPU host never loads."""
    return {"nixl-cu12": "NIXL built for CUDA 12; the meta package imports nixl_cu13 because the pin's torch "
                         "2.14.1 is a CUDA 13.0 build (and the H200 host's driver 580 is CUDA 13)"}


def pd_trims() -> dict[str, list[tuple[str, str]]]:
    """Files of nixl-cu13 a PD pair over UCX never loads (libnixl.so finds its plugins in the folder
    beside it, ``.nixl_cu13.mesonpy.libs/plugins``, by dladdr; the rehearsal checks UCX still loads)."""
    plugins = ".nixl_cu13.mesonpy.libs/plugins/"
    no_host_library = "a NIXL backend whose library the GPU host image lacks ({}); NIXL skips it with a warning"
    return {"nixl-cu13": [
        ("nixl_ep_cu13/*", "NIXL EP, the MoE all-to-all (--moe-a2a-backend nixl only); 95 MB of torch extensions"),
        ("nixl_cu13-*.data/*", "C++ headers, pkg-config files and example programs"),
        ("nixl_cu13.libs/nixl/*", "a second copy of the plugins that libnixl.so never looks in"),
        ("nixl_cu13.libs/ucx/libucx_perftest_*", "UCX's perftest modules"),
        (plugins + "libplugin_GPUNETIO.so", no_host_library.format("DOCA")),
        (plugins + "libtelemetry_exporter_doca.so", no_host_library.format("DOCA")),
        (plugins + "libplugin_LIBFABRIC.so", no_host_library.format("libfabric")),
        (plugins + "libplugin_INFINIA.so", no_host_library.format("libred_client")),
        (plugins + "libplugin_OBJ.so", no_host_library.format("libcuobjclient")),
    ]}

#!/usr/bin/env bash
# The top-k poison tests (tests/kernels/test_topk_poison.py, marker gpu) on an H200 host, against the
# pin's real CUDA top-k kernels: sglang 0.5.23's JIT top-k v1/v2 (`--dsa-topk-backend sgl-kernel`) and
# flashinfer 0.7.2's top_k / top_k_page_table_transform (`flashinfer`, unfused and fused).
#
# Why a script: the H200 image has CUDA 13.0, torch 2.11 and python 3.12 but neither sglang nor
# flashinfer, and nothing can be fetched there. `pack` (here, with the project venv) trims the pinned
# packages to what the test's import chain and the JIT builds need and puts them under .devcarry/topk/:
#   pin_site.tar.xz  sglang 0.5.23 (its python, data files and kernels/jit csrc + include; no rust
#                    extensions, multimodal_gen, test or benchmark trees), flashinfer-python 0.7.2 (its
#                    python, data/include, data/cccl, data/spdlog and the top-k sources of data/csrc; the
#                    cutlass trees it names as include paths are left empty: no top-k source includes
#                    them) with its top-k module prebuilt (below), tvm_ffi 0.1.11 + torch_c_dlpack_ext
#                    from .devcarry/kern_site.tar.xz (built for the H200 image).
#   wheels/          cp312 wheels of the import chain's packages the image lacks (found by importing the
#                    chain with only the image's package set visible).
# sgl_kernel and deep_gemm, imported at module level on a CUDA host but never by a top-k transform,
# get the stand-ins of tests/kernels/topk_standins.py (the test installs them only when missing).
#
# flashinfer's top-k module (topk.cu, cub_topk.cu and two bindings) takes tens of CPU-minutes to
# compile (cub_topk.cu's segmented sorts), too long to spend on the GPU host. `aot` builds it on the CPU
# machine with flashinfer's own JIT (same sources, flags and nvcc 13.0 as on the GPU host, target sm_90a) and
# `pack` places the .so where flashinfer looks for an ahead-of-time build (data/aot/topk/topk.so); the
# GPU run sets FLASHINFER_DISABLE_JIT=1, so a build that failed to load there fails fast instead of
# recompiling. sglang's three top-k modules (v1, the cluster-occupancy probe, v2) compile on the GPU host.
#
#   aot    (here, once; 1649 s on 2 cores): bash bench/topk_poison_h200.sh aot  -> .devcarry/topk_aot/
#   pack   (here):    bash bench/topk_poison_h200.sh pack
#   device (on the H200 host, with .devcarry/topk copied over; OUT= an output folder):
#                     COMMIT=<git rev-parse HEAD here> bash bench/topk_poison_h200.sh device
#                     -> $OUT/topk_poison_h200.txt (header, JIT compile times, pytest -v lines)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$ROOT/.devcarry/topk
AOT=$ROOT/.devcarry/topk_aot   # stays here: pack copies its .so into pin_site.tar.xz
SGLANG_VERSION=0.5.23
FLASHINFER_VERSION=0.7.2
# The chain's packages the image lacks, at the venv's versions (pip download --no-deps, cp312).
WHEELS="orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4
pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 pyzmq==27.3.0 ipython==9.18.1
traitlets==5.16.1 mistral-common==1.13.1 dill==0.4.1 compressed-tensors==0.18.0 loguru==0.7.3
gguf==0.19.0 openai==2.8.0 sniffio==1.3.1 distro==1.9.0 partial-json-parser==0.2.1.1.post7"

venv_site() {
    "$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

aot() {
    local site work start
    site=$(venv_site)
    work=$(mktemp -d)
    mkdir -p "$work/curand" "$work/stubs" "$AOT"
    # This host's CUDA 13.0 has no curand headers and no libcuda link stub. The module calls no driver
    # API (only cudart), so an empty stub satisfies flashinfer's -lcuda (the linker drops it unused).
    cp "$site"/nvidia/cu13/include/curand*.h "$work/curand/"
    echo "" | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$work/stubs/libcuda.so"
    start=$(date +%s)
    FLASHINFER_WORKSPACE_BASE=$work FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0} \
        FLASHINFER_EXTRA_CUDAFLAGS="-isystem $work/curand" FLASHINFER_EXTRA_LDFLAGS="-L$work/stubs" \
        "$ROOT/.venv/bin/python" -c '
import shutil, sys
from flashinfer.jit.topk import gen_topk_module
spec = gen_topk_module()
spec.build()
shutil.copy(spec.jit_library_path, sys.argv[1])' "$AOT/topk.so"
    {
        echo "flashinfer-python $FLASHINFER_VERSION top-k module, built $(date -u +%Y-%m-%d) by flashinfer's JIT here"
        echo "in $(( $(date +%s) - start )) s on $(nproc) cores with $(${CUDA_HOME:-/usr/local/cuda-13.0}/bin/nvcc --version | tail -1)"
        echo "target sm_90a; sha256 $(sha256sum "$AOT/topk.so" | cut -c1-16)"
    } >"$AOT/BUILD_INFO"
    cat "$AOT/BUILD_INFO"
    rm -rf "$work"
}

pack() {
    local site tmp
    site=$(venv_site)
    tmp=$(mktemp -d)
    mkdir -p "$CARRY"
    (
        cd "$site"
        find sglang \( -path sglang/multimodal_gen -o -path sglang/test -o -path sglang/benchmark \
            -o -name __pycache__ \) -prune -o -type f \
            \( -name '*.py' -o -name '*.json' -o -name '*.yaml' -o -name '*.toml' -o -name '*.csv' \) -print0
        find sglang/kernels/jit/csrc sglang/kernels/jit/include -name __pycache__ -prune -o -type f -print0
        find "sglang-$SGLANG_VERSION.dist-info" -type f -print0
        find flashinfer \( -path flashinfer/data -o -name __pycache__ \) -prune -o -type f \
            \( -name '*.py' -o -name '*.json' -o -name py.typed \) -print0
        find flashinfer/data/include flashinfer/data/cccl flashinfer/data/spdlog -type f -print0
        find flashinfer/data/csrc -maxdepth 1 -type f \( -name '*.h' -o -name 'topk.cu' -o -name 'cub_topk.cu' \
            -o -name 'flashinfer_topk_binding.cu' -o -name 'flashinfer_fast_topk_clusters_binding.cu' \) -print0
        find "flashinfer_python-$FLASHINFER_VERSION.dist-info" -type f -print0
    ) >"$tmp/files"
    mkdir -p "$tmp/extra/flashinfer/data/cutlass/include" "$tmp/extra/flashinfer/data/cutlass/tools/util/include" \
        "$tmp/extra/flashinfer/data/aot/topk"
    cp "$AOT/topk.so" "$AOT/BUILD_INFO" "$tmp/extra/flashinfer/data/aot/topk/"
    tar -xJf "$ROOT/.devcarry/kern_site.tar.xz" -C "$tmp/extra" \
        ./tvm_ffi ./apache_tvm_ffi-0.1.11.dist-info ./torch_c_dlpack_ext ./torch_c_dlpack_ext-0.1.5.dist-info
    find "$tmp/extra" -name __pycache__ -prune -exec rm -rf {} +
    tar -cf "$tmp/pin_site.tar" -C "$site" --null -T "$tmp/files"
    tar -rf "$tmp/pin_site.tar" -C "$tmp/extra" .
    xz -T0 -6 -c "$tmp/pin_site.tar" >"$CARRY/pin_site.tar.xz"
    rm -rf "$CARRY/wheels"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$CARRY/wheels" $WHEELS
    rm -rf "$tmp"
    du -sh "$CARRY"/pin_site.tar.xz "$CARRY"/wheels
}

device() {
    set -o pipefail
    export PYTHONUNBUFFERED=1
    local log=${OUT:-/tmp}/topk_poison_h200.txt site=/tmp/topk_site
    mkdir -p "$site"
    tar -xJf "$CARRY/pin_site.tar.xz" -C "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$CARRY"/wheels/*.whl
    export PYTHONPATH=$site:$ROOT/src:${PYTHONPATH:-} FLASHINFER_DISABLE_JIT=1
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: ${COMMIT:-unknown}"
        echo "nvcc: $(command -v nvcc), $(nvcc --version | tail -1)"
        echo "flashinfer top-k module (ahead-of-time build from the bundle): $(tr '\n' ' ' <"$site/flashinfer/data/aot/topk/BUILD_INFO")"
        local rc=0
        (cd "$ROOT" && python3 tests/kernels/topk_device_run.py) || rc=$?
        echo "pytest exit: $rc"
        echo "$rc" >"$site/pytest_rc"
    } 2>&1 | tee "$log"
    return "$(cat "$site/pytest_rc")"
}

case "${1:-}" in
    aot) aot ;;
    pack) pack ;;
    device) device ;;
    *) echo "usage: $0 aot|pack|device" >&2; exit 2 ;;
esac

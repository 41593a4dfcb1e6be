#!/usr/bin/env bash
# Builds DeepGEMM on an H200 host (no network there) as the sm_90 baseline of bench/indexer_h200.py (issue 14).
#
# Why: on sm_90 the pin's indexer calls DeepGEMM (fp8_paged_mqa_logits for decode and target-verify,
# fp8_mqa_logits for one-request prefill), but the pinned sgl-deep-gemm==0.2.3.post2 wheel ships a
# prebuilt _C.so for a newer torch than the H200 image's 2.11, and no csrc/. Its sources (the fork's
# release branch) are not public in a fetchable form, so this builds the host side of upstream
# deepseek-ai/DeepGEMM at DG_COMMIT -- the first commit whose sm90_fp8_paged_mqa_logits.cuh and
# scheduler/sm90_paged_mqa_logits.cuh are byte-identical to the wheel's -- and points its runtime JIT
# at the wheel's own include/ tree, so every kernel it compiles is the wheel's 0.2.3.post2 device code.
# One adaptation, applied below: the wheel's sm90_fp8_mqa_logits kernel has one more template flag
# (kCleanLogits, in-kernel cleaning) than DG_COMMIT's host passes; the host passes false, the value
# for the pin's clean_logits=False call. Nothing of DeepGEMM is committed: it travels as a tarball.
#
#   pack  (networked machine):  DG_REPO=<deepseek-ai/DeepGEMM git dir> FMT_REPO=<fmtlib/fmt git dir>
#                  WHEEL_PKG=<site-packages/deep_gemm of sgl-deep-gemm 0.2.3.post2>
#                  [PY_INCLUDE=<a CPython 3.12 include/python3.12, used only if the GPU host lacks one>]
#                  bash bench/build_deepgemm_device.sh pack      -> .devcarry/deepgemm_src.tar.xz
#   build (GPU host, with .devcarry copied over):  bash bench/build_deepgemm_device.sh build [DEST=/tmp/dg]
#                  -> DEST/deep_gemm importable with PYTHONPATH=DEST (prints the compile command and time)
set -euo pipefail

DG_COMMIT=54e22612409371d6364144b69086735beb54e98b   # deepseek-ai/DeepGEMM main, 2026-06-23 ("2.6.1")
FMT_COMMIT=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28  # DG_COMMIT's third-party/fmt submodule
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARBALL=$ROOT/.devcarry/deepgemm_src.tar.xz

pack() {
    local tmp
    tmp=$(mktemp -d)
    mkdir -p "$tmp/dg/fmt" "$tmp/dg/py_include"
    git -C "$DG_REPO" archive "$DG_COMMIT" csrc deep_gemm | tar -x -C "$tmp/dg"
    mv "$tmp/dg/deep_gemm/include" "$tmp/dg/host_include"          # DG_COMMIT's headers: host compile only
    cp -r "$WHEEL_PKG/include" "$tmp/dg/deep_gemm/include"           # the wheel's kernels: what the JIT builds
    git -C "$FMT_REPO" archive "$FMT_COMMIT" include | tar -x -C "$tmp/dg/fmt"
    if [ -n "${PY_INCLUDE:-}" ]; then cp -r "$PY_INCLUDE" "$tmp/dg/py_include/"; fi
    {
        echo "deepseek-ai/DeepGEMM $DG_COMMIT (csrc, deep_gemm python package, host headers)"
        echo "fmtlib/fmt $FMT_COMMIT (include)"
        echo "sgl-deep-gemm $(cat "$WHEEL_PKG/VERSION") include/ (JIT kernels)"
        (cd "$WHEEL_PKG/include" && find . -type f | sort | xargs sha256sum | sha256sum | sed 's/^/include sha256 of sha256s: /')
    } > "$tmp/dg/MANIFEST"
    mkdir -p "$(dirname "$TARBALL")"
    tar -cJf "$TARBALL" -C "$tmp" dg
    rm -rf "$tmp"
    ls -l "$TARBALL"
}

patch_clean_logits_flag() {
    python3 - "$1/csrc/jit_kernels/impls/sm90_fp8_mqa_logits.hpp" <<'EOF'
import sys
path = sys.argv[1]
src = open(path).read()
# template arguments: num_heads, head_dim, is_compressed, [kCleanLogits], block_q, block_kv, ...
old_fmt = "        {}, {},\n        {},\n        {}, {},\n        {}, {},\n        {},\n        {}, {},\n        {}\n    >);"
new_fmt = "        {}, {},\n        {}, {},\n        {}, {},\n        {}, {},\n        {},\n        {}, {},\n        {}\n    >);"
old_arg, new_arg = "    args.is_compressed_logits,\n", "    args.is_compressed_logits, false,\n"
assert src.count(old_fmt) == 1 and src.count(old_arg) == 1, "DG_COMMIT's sm90_fp8_mqa_logits.hpp changed"
open(path, "w").write(src.replace(old_fmt, new_fmt).replace(old_arg, new_arg))
print("patched", path)
EOF
}

build() {
    local dest=${DEST:-/tmp/dg} cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
    local unpacked
    unpacked=$(mktemp -d)
    tar -xJf "$TARBALL" -C "$unpacked"
    rm -rf "$dest" && mv "$unpacked/dg" "$dest"
    patch_clean_logits_flag "$dest"
    local torch_dir py_inc abi suffix
    torch_dir=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
    py_inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    [ -f "$py_inc/Python.h" ] || py_inc=$dest/py_include/python3.12
    abi=$(python3 -c "import torch; print(int(torch.compiled_with_cxx11_abi()))")
    suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    # DG_COMMIT's setup.py flags for its CUDAExtension as one c++ call, at C++20 (recent torch headers need it)
    # and with cuda_fp8.h forced in: its host layout headers take sizeof(__nv_fp8_e4m3), which CUDA 13's
    # cublasLt.h no longer pulls in (and cutlass includes only under nvcc)
    local cmd=(c++ -std=c++20 -O3 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -include cuda_fp8.h
        "-D_GLIBCXX_USE_CXX11_ABI=$abi" -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
        "-I$cuda/include" "-I$cuda/include/cccl" "-I$dest/host_include" "-I$dest/deep_gemm/include"
        "-I$dest/fmt/include" "-I$torch_dir/include" "-I$torch_dir/include/torch/csrc/api/include" "-I$py_inc"
        "$dest/csrc/python_api.cpp" -o "$dest/deep_gemm/_C$suffix"
        "-L$cuda/lib64" "-L$torch_dir/lib" -lcudart -lnvrtc
        -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda "-Wl,-rpath,$torch_dir/lib:$cuda/lib64")
    echo "[build_deepgemm] ${cmd[*]}"
    local t0=$SECONDS
    "${cmd[@]}"
    echo "[build_deepgemm] _C built in $((SECONDS - t0)) s (python include: $py_inc)"
    cat "$dest/MANIFEST"
}

case "${1:-}" in
    pack) pack ;;
    build) build ;;
    *) echo "usage: $0 pack|build" >&2; exit 2 ;;
esac

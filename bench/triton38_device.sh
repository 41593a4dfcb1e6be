#!/usr/bin/env bash
# Run the H200 benches under the pin's Triton 3.8 (sglang 0.5.23 -> torch 2.14.1 -> triton 3.8.0) on a GPU
# host whose image has Triton 3.6 and no network. The Triton 3.8 wheel is 248 MB; `pack` (on a networked
# machine) trims it (CUPTI, nvdisasm and the Blackwell ptxas left out: the benches need none of them),
# xz-compresses libtriton.so and cuts it in three, so that the bundle moves in parts of at most 67 MB, one part
# a step below (for hosts that accept uploads of limited size or a file system without room for the whole
# wheel). Each step installs its part under /tmp (/tmp/site, /tmp/tr38) and `activate` joins the libtriton.so
# pieces there again, so run the steps in order on one host and keep /tmp between them. TileLang (the peer
# kernel) comes first.
#
#   networked machine:  bash bench/triton38_device.sh pack
#   GPU host, in order, each step after its folders have been copied over:
#     .devcarry/tl1:                     bash bench/triton38_device.sh tilelang1
#     .devcarry/tl2, .devcarry/tr38/p1:  bash bench/triton38_device.sh tilelang2 && bash bench/triton38_device.sh part1
#     .devcarry/tr38/p2:                 bash bench/triton38_device.sh part2
#     .devcarry/tr38/p3, .devcarry/w:    source bench/triton38_device.sh activate &&
#                                        COMMIT=<sha> python3 bench/indexer_h200.py --tilelang .devcarry/w/tilelang_kernel.py
#   A host that takes all of .devcarry at once runs the same steps one after another.
#
# .devcarry/tl1 holds tilelang 0.1.12, apache-tvm-ffi 0.1.11 and torch-c-dlpack-ext, .devcarry/tl2 z3-solver
# 4.15.4.0, .devcarry/w the pinned sglang wheel's tilelang_kernel.py (pack makes all of them).
set -euo pipefail
CARRY=.devcarry
WHEEL_OPTS="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64"
install_wheels() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }

case "${1:-}" in
  pack)
    mkdir -p "$CARRY"/tl1 "$CARRY"/tl2 "$CARRY"/w "$CARRY"/tr38/p1 "$CARRY"/tr38/p2 "$CARRY"/tr38/p3
    grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
    python3 -m pip download $WHEEL_OPTS -d "$CARRY"/tl1 tilelang==0.1.12 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext
    python3 -m pip download $WHEEL_OPTS -d "$CARRY"/tl2 z3-solver==4.15.4.0
    work=$(mktemp -d)
    python3 -m pip download --no-deps -d "$work" sglang==0.5.23
    unzip -p "$work"/sglang-0.5.23-*.whl sglang/kernels/ops/attention/dsa/tilelang_kernel.py > "$CARRY"/w/tilelang_kernel.py
    python3 -m pip download $WHEEL_OPTS -d "$work" triton==3.8.0
    (cd "$work" && mkdir rest && cd rest && unzip -q ../triton-3.8.0-*.whl -x 'triton/_C/libtriton.so' \
        'triton/backends/nvidia/lib/cupti*' 'triton/backends/nvidia/bin/ptxas-blackwell' \
        'triton/backends/nvidia/bin/nvdisasm' 'triton/instrumentation/*' 'triton/_C/libproton.so' \
        && tar cf - . | xz -4 > "$OLDPWD"/rest.tar.xz)
    unzip -p "$work"/triton-3.8.0-*.whl triton/_C/libtriton.so | xz -6 -T0 > "$work"/lib.xz
    cp "$work"/rest.tar.xz "$CARRY"/tr38/p1/
    head -c 20000000 "$work"/lib.xz > "$CARRY"/tr38/p1/lib.xz.0
    tail -c +20000001 "$work"/lib.xz | head -c 44000000 > "$CARRY"/tr38/p2/lib.xz.1
    tail -c +64000001 "$work"/lib.xz > "$CARRY"/tr38/p3/lib.xz.2
    rm -rf "$work"
    du -sh "$CARRY"/* "$CARRY"/tr38/* ;;
  tilelang1) install_wheels "$CARRY"/tl1/*.whl ;;
  tilelang2) install_wheels "$CARRY"/tl2/*.whl ;;
  part1)
    rm -rf /tmp/site/triton && mkdir -p /tmp/site /tmp/tr38
    tar xJf "$CARRY"/tr38/p1/rest.tar.xz -C /tmp/site && cp "$CARRY"/tr38/p1/lib.xz.0 /tmp/tr38/ ;;
  part2) cp "$CARRY"/tr38/p2/lib.xz.1 /tmp/tr38/ ;;
  activate)  # sourced: sets up this shell for the bench
    cat /tmp/tr38/lib.xz.0 /tmp/tr38/lib.xz.1 "$CARRY"/tr38/p3/lib.xz.2 | xz -d -T4 > /tmp/site/triton/_C/libtriton.so
    export PYTHONPATH=/tmp/site:src PYTHONWARNINGS=ignore::DeprecationWarning
    python3 -c "import triton; assert triton.__version__ == '3.8.0', triton.__version__; print('triton', triton.__version__)"
    set +euo pipefail ;;
  *) echo "usage: $0 pack | tilelang1 | tilelang2 | part1 | part2 | activate (sourced)" >&2; exit 2 ;;
esac

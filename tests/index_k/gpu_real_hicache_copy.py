"""Run upstream's real HiCache page-row copies on 16384-byte bf16 index-K rows, on a CUDA device.

Usage (a GPU host; no sglang needed): ``python tests/index_k/gpu_real_hicache_copy.py
PATH/TO/sgl_kernel/sm90/common_ops.abi3.so OUT.json``. The ops are the pinned
``sglang-kernel`` wheel's own (``torch.ops.sgl_kernel.*``, loaded from its shared library);
they are called with the arguments ``DeepSeekV4PagedHostPool`` (sglang 0.5.23,
``mem_cache/memory_pool_host.py``) passes for whole pages: backup_from_device_all_layer and
load_to_device_per_layer, for each (layout, io backend) sglang resolves for this pool. The
pool object itself is not built here (sglang does not install on that host); the argument
lists are copied from its code, by hand: what is not run is its dispatch, which the CPU
tests run. Host memory is pinned (upstream registers it with cudaHostRegister). A second
pass passes fp8's row size (8448 B) to show that a wrong item size corrupts the rows.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys
import time

import torch

ITEM = 16384  # one bf16 C4 page row: 64 slots x 128 bf16 values
LAYERS, DEVICE_PAGES, HOST_PAGES, MOVED = 4, 96, 80, 37


def load_ops(path: str):
    spec = importlib.util.spec_from_file_location("common_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return torch.ops.sgl_kernel


def run_case(ops, layout: str, io: str, item: int, gen) -> dict:
    dev = torch.device("cuda")
    device_buffers = [torch.randint(0, 256, (DEVICE_PAGES, ITEM), dtype=torch.uint8, device=dev, generator=gen)
                      for _ in range(LAYERS)]
    original = [b.clone() for b in device_buffers]
    device_ptrs = torch.tensor([b.data_ptr() for b in device_buffers], dtype=torch.uint64, device=dev)
    if layout == "layer_first":
        kv_buffer = [torch.zeros((HOST_PAGES, ITEM), dtype=torch.uint8).pin_memory() for _ in range(LAYERS)]
        data_refs = kv_buffer
    elif layout == "page_first":
        kv_buffer = torch.zeros((HOST_PAGES, LAYERS, ITEM), dtype=torch.uint8).pin_memory()
        data_refs = []
    else:  # page_first_direct
        kv_buffer = torch.zeros((HOST_PAGES, LAYERS, 1, ITEM), dtype=torch.uint8).pin_memory()
        data_refs = []
    data_ptrs = (torch.tensor([ops.get_device_accessible_ptr.default(t, 0) for t in data_refs],
                              dtype=torch.uint64, device=dev) if data_refs else None)
    perm = torch.randperm(DEVICE_PAGES)
    src_rows = perm[:MOVED].to(torch.int64)
    host_rows = torch.randperm(HOST_PAGES)[:MOVED].to(torch.int64)
    dst_rows = torch.randperm(DEVICE_PAGES)[:MOVED].to(torch.int64)
    on = {"kernel": dev, "direct": torch.device("cpu")}[io]  # direct ops index on the host, as HiCache passes them
    d_src, d_host, d_dst = src_rows.to(dev), host_rows.to(dev), dst_rows.to(dev)
    quota, warps = 2, 32
    # backup_from_device_all_layer (whole pages)
    if (layout, io) == ("layer_first", "kernel"):
        ops.transfer_kv_all_layer_mla.default(device_ptrs, data_ptrs, d_src, d_host, item, LAYERS, quota, warps)
    elif (layout, io) == ("page_first", "kernel"):
        ops.transfer_kv_all_layer_mla_lf_pf.default(device_ptrs, kv_buffer, d_src, d_host, item, LAYERS * item,
                                                     LAYERS, quota, warps)
    elif (layout, io) == ("layer_first", "direct"):
        ops.transfer_kv_direct.default(device_buffers, data_refs, src_rows.to(on), host_rows.to(on), 1)
    else:
        ops.transfer_kv_all_layer_direct_lf_pf.default(device_buffers, [kv_buffer], src_rows.to(on),
                                                        host_rows.to(on), 1)
    torch.cuda.synchronize()
    for b in device_buffers:
        b.bitwise_not_()
    scribbled = [b.clone() for b in device_buffers]
    # load_to_device_per_layer (whole pages), one layer at a time
    for layer in range(LAYERS):
        if (layout, io) == ("layer_first", "kernel"):
            ops.transfer_kv_per_layer_mla.default(data_refs[layer], device_buffers[layer], d_host, d_dst, item,
                                                  quota, warps)
        elif (layout, io) == ("page_first", "kernel"):
            ops.transfer_kv_per_layer_mla_pf_lf.default(kv_buffer, device_buffers[layer], d_host, d_dst, layer,
                                                        item, LAYERS * item, quota, warps)
        elif (layout, io) == ("layer_first", "direct"):
            ops.transfer_kv_direct.default([data_refs[layer]], [device_buffers[layer]], host_rows.to(on),
                                           dst_rows.to(on), 1)
        else:
            ops.transfer_kv_per_layer_direct_pf_lf.default([kv_buffer], [device_buffers[layer]], host_rows.to(on),
                                                           dst_rows.to(on), layer, 1)
    torch.cuda.synchronize()
    exact = outside_untouched = True
    wrong_rows = 0
    for layer in range(LAYERS):
        got = device_buffers[layer][d_dst]
        want = original[layer][d_src]
        wrong_rows += int((got != want).any(dim=1).sum())
        exact &= torch.equal(got, want)
        untouched = torch.ones(DEVICE_PAGES, dtype=torch.bool, device=dev)
        untouched[d_dst] = False
        outside_untouched &= torch.equal(device_buffers[layer][untouched], scribbled[layer][untouched])
    return {"layout": layout, "io_backend": io, "item_size": item, "pages": MOVED, "layers": LAYERS,
            "byte_exact": bool(exact), "rows_wrong": wrong_rows, "outside_untouched": bool(outside_untouched)}


def main() -> int:
    so, out_path = sys.argv[1], sys.argv[2]
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "library": so, "cases": []}
    try:
        result["device"] = torch.cuda.get_device_name(0)
        result["capability"] = list(torch.cuda.get_device_capability(0))
        result["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
        ops = load_ops(so)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"
        json.dump(result, open(out_path, "w"), indent=1)
        print(json.dumps(result, indent=1))
        return 1
    gen = torch.Generator(device="cuda").manual_seed(17)
    for layout, io in [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct"),
                       ("page_first_direct", "direct")]:
        try:
            result["cases"].append(run_case(ops, layout, io, ITEM, gen))
        except Exception as exc:  # noqa: BLE001
            result["cases"].append({"layout": layout, "io_backend": io, "error": f"{type(exc).__name__}: {exc}"})
    for layout in ("layer_first", "page_first"):  # fp8's row size on bf16 rows: must NOT come back exact
        try:
            result["cases"].append(run_case(ops, layout, "kernel", 8448, gen))
        except Exception as exc:  # noqa: BLE001
            result["cases"].append({"layout": layout, "io_backend": "kernel", "item_size": 8448,
                                    "error": f"{type(exc).__name__}: {exc}"})
    json.dump(result, open(out_path, "w"), indent=1)
    print(json.dumps(result, indent=1))
    good = [c for c in result["cases"] if c.get("item_size") == ITEM]
    return 0 if good and all(c.get("byte_exact") and c.get("outside_untouched") for c in good) else 1


if __name__ == "__main__":
    sys.exit(main())

"""``rehearse``: import the DSV4 server's chain from an unpacked bundle on a CPU host, with nothing visible
but the bundle and a stand-in for the GPU host's image, so that a package the bundle lacks costs a CPU
minute instead of a GPU host's time.

The stand-in (``--image-packages``, filled ``--from-venv``) holds the venv's copies of what the
manifest leaves to the image, with their own requirements, as links. The interpreter runs with
``-S`` (no site-packages of its own) after sourcing the bundle's ``env.sh``. Two stand-ins make the
binaries load as they would on the GPU host: a stub ``libcuda.so.1`` that exports every driver
function the bundle's libraries import (each returns CUDA_ERROR_NO_DEVICE), built with the host's C
compiler, and torch device probes that answer as one GPU of the bundle's first architecture
(``probe.py``). What is left are errors about the missing GPU ("device"), which only the GPU host can
clear, and anything else, which is the bundle's fault.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tools.airgap import bundle, pack

# The server's import chain: entry points, the three processes, DSV4's model, attention, indexer and
# HiCache, the kernels libraries, upstream's TileLang kernels, and the plugin.
MODULES = [
    "triton", "torchvision", "transformers",
    "sglang.launch_server", "sglang.srt.server_args", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.deepseek_v4", "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.dsv4.indexer", "sglang.srt.layers.attention.dsv4.compressor",
    "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool", "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.managers.cache_controller", "sglang.srt.model_loader.loader",
    "sglang.srt.constrained.xgrammar_backend", "sglang.srt.function_call.function_call_parser",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sgl_kernel", "sgl_kernel.flash_mla", "sgl_kernel.kvcacheio", "deep_gemm", "flash_mla", "tvm_ffi", "tilelang",
    "sglang.kernels.ops.attention.dsa.tilelang_kernel", "sglang.kernels.ops.layernorm.mhc",
    "sglang.kernels.ops.layernorm.mhc_mega",
    "dsv4_sm120.plugin", "dsv4_sm120.model.deepseek_v4",
]
# A bundle packed --with-pd: what the prefill/decode pair and the router import.
PD_MODULES = ["nixl._api", "sglang.srt.disaggregation.nixl.conn", "sglang.srt.disaggregation.prefill",
              "sglang.srt.disaggregation.decode", "sglang_router", "sglang_router.launch_router"]
# A bundle packed --with-flashinfer: FlashInfer's sampler and the CuTe DSL its import loads (found through the
# .pth folder env.sh puts on PYTHONPATH).
FLASHINFER_MODULES = ["flashinfer", "flashinfer.sampling", "cutlass"]


def make_image(venv: Path, image: Path, manifest: dict) -> list[str]:
    """Fill ``image`` with links to the venv's files of each distribution left to the image and of what
    those require that the bundle does not carry (the image has those too, or they would be bundled)."""
    sites = sorted(venv.glob("lib/python3.*/site-packages"))
    available = pack.scan_site(sites[0])
    python = sites[0].parent.name.removeprefix("python")
    names: set[str] = set()
    for name in manifest["left_to_image"]:
        if name in available:
            reached, _ = pack.resolve([available[name].name], available, python, skip=set(manifest["bundled"]))
            names.update(n for n in reached if n in available and n not in manifest["bundled"])
    shutil.rmtree(image, ignore_errors=True)
    for name in sorted(names):
        dist = available[name]
        for rel in dist.files:
            src, dest = dist.site / rel, image / rel
            if src.exists() and not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.symlink_to(src.resolve())
    return sorted(names)


def stub_driver(dirs: list[Path], work: Path) -> Path | None:
    """Build a stub libcuda.so.1 in ``work`` exporting every cu* function the ELF files in ``dirs`` import."""
    if not (shutil.which("cc") and shutil.which("nm")):
        return None
    libs = [str(p) for d in dirs for p in d.rglob("*.so*") if p.is_file()]
    symbols = set()
    for start in range(0, len(libs), 200):
        out = subprocess.run(["nm", "-D", "--undefined-only", *libs[start:start + 200]],
                             capture_output=True, text=True).stdout
        symbols.update(m.group(1) for m in re.finditer(r"\sU (cu[A-Z]\w*)", out))
    work.mkdir(parents=True, exist_ok=True)
    source = work / "libcuda_stub.c"
    source.write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in sorted(symbols)))  # CUDA_ERROR_NO_DEVICE
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(work / "libcuda.so.1"), "-Wl,-soname,libcuda.so.1",
                    str(source)], check=True)
    (work / "libcuda.so").unlink(missing_ok=True)
    (work / "libcuda.so").symlink_to("libcuda.so.1")
    return work


def main(stage: Path, image: Path, from_venv: Path | None, python: str, parts: Path | None = None) -> int:
    if parts is not None:
        for part in sorted(parts.glob("part[0-9][0-9]")):
            if bundle.add_part(part, stage):
                return 1
    manifest = json.loads((stage / bundle.MANIFEST).read_text())
    if from_venv is not None:
        names = make_image(from_venv, image, manifest)
        print(f"rehearse: image stand-in {image}: {', '.join(names)}")
    root = stage / "root"
    info = bundle.read_json(root / "bundle.json")
    if not info or info["bundle"] != manifest["bundle"] or info["host_site"] != str(image):
        if bundle.finish(stage, host_site=image, force=True):
            return 1
    stub = stub_driver([root / "site", image], stage / "rehearse-driver")
    print(f"rehearse: stub CUDA driver: {stub / 'libcuda.so.1' if stub else 'none (no cc or nm here)'}")
    arch = manifest["archs"][0]
    probe = Path(__file__).with_name("probe.py")
    script = (f'. {root / "env.sh"} && export PYTHONPATH="$PYTHONPATH:{image}" '
              f'LD_LIBRARY_PATH={stub or ""} && exec "$0" -S "$@"')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LD_LIBRARY", "DSV4_", "SGLANG_"))}
    modules = ["--pd", *MODULES, *PD_MODULES] if (manifest.get("pd") or {}).get("bundled") else list(MODULES)
    if (manifest.get("flashinfer") or {}).get("bundled"):
        modules += FLASHINFER_MODULES
    with tempfile.TemporaryDirectory() as home:
        env["HOME"] = home
        proc = subprocess.run(["bash", "-c", script, python, str(probe), str(arch), *modules],
                              capture_output=True, text=True, env=env, cwd=home)
    return report(proc)


def report(proc: subprocess.CompletedProcess) -> int:
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "module" in line]
    checks = next((line["checks"] for line in lines if "checks" in line), None)
    for r in results:
        detail = f"  {r['error']}  ({r['at']})" if "error" in r else ""
        print(f"{r['status']:8} {r['module']}{detail}")
    if checks:
        print("checks:", json.dumps(checks))
    bad = [r for r in results if r["status"] in ("missing", "error")]
    if proc.returncode or checks is None:
        print(proc.stderr[-3000:])
        return 1
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "device", "missing", "error")}
    print(f"rehearse: {counts['ok']} ok, {counts['device']} device-only errors, {counts['missing']} missing, "
          f"{counts['error']} other errors")
    return 1 if bad else 0

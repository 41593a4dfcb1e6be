"""``unpack``: on the GPU host, gather a bundle's parts into a stage and set up a tree to serve from.

Standard library only: it runs on the host's bare Python 3.12, before anything is installed. Parts
may arrive one upload at a time, so ``add_part`` copies one part's chunks into ``STAGE/chunks``
(checking each chunk's sha256 as it copies, so a damaged upload is named while it can still be
redone) and says which parts are still missing. A stage keeps the chunks a newer bundle shares with
the one it held: after a repack that changed only the project, only the last part travels again.

``finish`` verifies every chunk, reassembles and extracts the archives side by side (the ``xz`` and
``tar`` commands with threads where the host has them, else ``lzma`` and ``tarfile``) into
``STAGE/root``, and then:

- ``root/site`` goes first on PYTHONPATH; torch 2.14.1 looks for its CUDA libraries at
  ``<site>/nvidia/<lib>/lib``, so the host's own ``nvidia/{cu13,cudnn,cusparselt,nvshmem,...}`` are
  linked there beside the bundled ``nvidia/nccl`` (torch 2.14.1 needs NCCL 2.30.7; the image's
  2.28.9 lacks ``ncclCommResume``);
- the project's wheel is installed into ``root/site`` and its console scripts into ``root/bin``;
- ``root/models`` gets the checkpoints of ``harness/dsv4_checkpoints.py``;
- ``root/env.sh`` sets the paths and points every JIT cache under one cache root that can be kept
  between runs (a warm cache saves about two minutes of nvcc per server start);
- ``root/bundle.json`` says what is there;
- a bundle packed ``--with-pd`` also gets the PD router's console scripts in ``root/bin`` and, for
  NIXL's UCX CUDA modules, the folders of the host's CUDA libraries they load on ``LD_LIBRARY_PATH``
  (``libucm_cuda`` needs ``libcudart.so.13`` and names no path to it); ``bundle.json`` says where each
  host library NIXL and the router need was found, or that it was not.
"""

from __future__ import annotations

import configparser
import concurrent.futures
import datetime
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import site as site_module
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

from harness import dsv4_checkpoints

MANIFEST = "manifest.json"
# Versions bundle.json reports, by distribution name.
REPORTED = ("torch", "triton", "torchvision", "sglang", "sglang-kernel", "sgl-deep-gemm", "sgl-flash-mla",
            "tilelang", "z3-solver", "apache-tvm-ffi", "transformers", "nvidia-nccl-cu13", "dsv4-sm120",
            "nixl", "nixl-cu13", "sglang-router")
# Every JIT cache the server's stack keeps, by the variable that moves it (subfolder of the cache root).
CACHES = {
    "SGLANG_CACHE_DIR": "sglang",  # sglang's default for its deep_gemm, CuTe and third-party caches
    "SGLANG_JIT_CACHE_DIR": "sglang-jit",  # sglang's JIT kernels (not under SGLANG_CACHE_DIR by default)
    "SGLANG_DG_CACHE_DIR": "deep_gemm",  # sglang copies it into DG_JIT_CACHE_DIR at import
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "TRITON_CACHE_DIR": "triton",
    "TVM_FFI_CACHE_DIR": "tvm-ffi",
    "TILELANG_CACHE_DIR": "tilelang",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "CUDA_CACHE_PATH": "nv",  # the driver's PTX JIT cache
    "FLASHINFER_WORKSPACE_BASE": "",  # FlashInfer appends .cache/flashinfer itself
}


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def sha256(path: Path, offset: int = 0, length: int | None = None) -> str:
    """sha256 of ``length`` bytes of ``path`` from ``offset`` (the rest of the file when None)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = path.stat().st_size - offset if length is None else length
        while left:
            block = f.read(min(left, 8 << 20))
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _present(manifest: dict, chunks: Path) -> set[str]:
    """Names of the chunks in ``chunks`` that have their full size (their sha256 is checked by copy and finish)."""
    return {c["file"] for c in manifest["chunks"]
            if (chunks / c["file"]).exists() and (chunks / c["file"]).stat().st_size == c["bytes"]}


def _status(manifest: dict, chunks: Path) -> tuple[list[str], list[str]]:
    have = _present(manifest, chunks)
    present = [p for p in manifest["parts"] if all(c["file"] in have for c in manifest["chunks"] if c["part"] == p)]
    return present, [p for p in manifest["parts"] if p not in present]


def add_part(part: Path, stage: Path) -> int:
    """Copy the chunks in ``part`` into ``stage`` (again: no-op) and say which parts are present and missing."""
    if not (part / MANIFEST).exists():
        print(f"unpack: {part} has no {MANIFEST}; is it a part of a bundle?", file=sys.stderr)
        return 2
    manifest = json.loads((part / MANIFEST).read_text())
    chunks = stage / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    held = read_json(stage / MANIFEST)
    if held and held["bundle"] != manifest["bundle"]:
        wanted = {(c["file"], c["sha256"]) for c in manifest["chunks"]}
        shared = 0
        for c in held["chunks"]:
            if (c["file"], c["sha256"]) in wanted:
                shared += (chunks / c["file"]).exists()
            else:
                (chunks / c["file"]).unlink(missing_ok=True)
        print(f"unpack: the stage held bundle {held['bundle']}; bundle {manifest['bundle']} shares {shared} "
              f"of its chunks, the others were removed")
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    have, damaged, copied = _present(manifest, chunks), [], 0
    for c in manifest["chunks"]:
        src = part / c["file"]
        if c["file"] in have or not src.exists():
            continue
        dest = chunks / c["file"]
        shutil.copyfile(src, dest.with_suffix(".partial"))
        if sha256(dest.with_suffix(".partial")) != c["sha256"]:
            dest.with_suffix(".partial").unlink()
            damaged.append(c["file"])
            continue
        dest.with_suffix(".partial").rename(dest)
        copied += 1
    present, missing = _status(manifest, chunks)
    print(f"bundle {manifest['bundle']}: {copied} chunks copied from {part}")
    if damaged:
        print(f"unpack: DAMAGED in {part} (sha256 differs; upload that part again): {' '.join(damaged)}")
    print(f"parts present ({len(present)}/{len(manifest['parts'])}): {' '.join(present) or '-'}")
    print(f"parts missing: {' '.join(missing) or '-'}")
    if not missing:
        print(f"all parts present: python -m tools.airgap unpack --finish --stage {stage}")
    return 1 if damaged else 0


def finish(stage: Path, cache_root: Path | None = None, host_site: Path | None = None, force: bool = False) -> int:
    """Verify and extract the stage's bundle into ``stage/root`` and set it up (see the module doc)."""
    manifest = read_json(stage / MANIFEST)
    if manifest is None:
        print(f"unpack: {stage} holds no bundle yet; add parts with --part first", file=sys.stderr)
        return 2
    root = stage / "root"
    done = read_json(root / "bundle.json")
    if done and done["bundle"] == manifest["bundle"] and not force:
        print(f"bundle {manifest['bundle']} is already set up in {root}; source {root / 'env.sh'}")
        return 0
    chunks = stage / "chunks"
    _, missing = _status(manifest, chunks)
    if missing:
        print(f"unpack: parts missing: {' '.join(missing)}", file=sys.stderr)
        return 1
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        shas = dict(zip([c["file"] for c in manifest["chunks"]],
                        pool.map(sha256, [chunks / c["file"] for c in manifest["chunks"]])))
    bad = [c for c in manifest["chunks"] if shas[c["file"]] != c["sha256"]]
    if bad:
        for c in bad:
            (chunks / c["file"]).unlink()
        print(f"unpack: sha256 differs, removed; upload again: {' '.join(sorted({c['part'] for c in bad}))}",
              file=sys.stderr)
        return 1
    building = stage / "root.partial"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    _extract_all(manifest, chunks, building)
    shutil.rmtree(root, ignore_errors=True)
    building.rename(root)

    site = root / "site"
    host_site = host_site or find_host_site()
    linked = link_host_libraries(site, host_site)
    scripts = install_wheel(root / "wheels" / manifest["project"]["wheel"], site, root / "bin")
    checkpoints = dsv4_checkpoints.write_all(root / "models")
    cache_root = (cache_root or stage / "cache").resolve()
    pd = set_up_pd(manifest.get("pd") or {}, site, root / "bin")
    env = write_env(root, cache_root, manifest["bundle"], pd.get("library_path", []), pth_paths(site))
    info = {
        "bundle": manifest["bundle"],
        "packed": manifest["created"],
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "project": manifest["project"],
        "archs": manifest["archs"],
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "root": str(root),
        "site": str(site),
        "env": str(env),
        "cache_root": str(cache_root),
        "versions": {n: v for n, v in installed(site).items() if n in REPORTED},
        "host_site": str(host_site) if host_site else None,
        "host_libraries_linked": linked,
        "host_cuda_distributions": {n: v for n, v in installed(host_site).items()
                                    if n.startswith(("nvidia-", "cuda-"))} if host_site else {},
        "console_scripts": scripts,
        "models": {p.name: str(p) for p in checkpoints},
        "left_to_image": {n: e["reason"] for n, e in manifest["left_to_image"].items()},
        "pd": pd,
        "flashinfer": manifest.get("flashinfer") or {"bundled": False, "reason": "packed before --with-flashinfer"},
    }
    (root / "bundle.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"bundle {manifest['bundle']} set up in {root}: torch {info['versions'].get('torch')}, "
          f"sglang {info['versions'].get('sglang')}, triton {info['versions'].get('triton')}, "
          f"host libraries linked: {', '.join(linked) or 'none'}")
    if pd.get("bundled"):
        absent = [lib for lib, path in pd["host_libraries"].items() if path is None]
        print(f"PD: {', '.join(f'{n} {v}' for n, v in pd['versions'].items())}; host libraries not found: "
              f"{', '.join(absent) or 'none'}")
    if not linked:
        print(f"unpack: WARNING no nvidia/ CUDA libraries found in {host_site}; torch will not find cuBLAS and "
              f"friends (give --host-site)", file=sys.stderr)
    print(f"source {env}")
    return 0


def _extract_all(manifest: dict, chunks: Path, dest: Path) -> None:
    """Extract every archive into ``dest``, all at once (each through its own xz | tar)."""
    parts = {}
    for c in sorted(manifest["chunks"], key=lambda c: (c["archive"], c["offset"])):
        parts.setdefault(c["archive"], []).append(chunks / c["file"])
    tools = shutil.which("xz") and shutil.which("tar")
    extract = _extract_with_tools if tools else _extract_with_stdlib
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        for future in [pool.submit(extract, files, dest) for files in parts.values()]:
            future.result()


def _extract_with_tools(files: list[Path], dest: Path) -> None:
    cat = subprocess.Popen(["cat", *map(str, files)], stdout=subprocess.PIPE)
    xz = subprocess.Popen(["xz", "-dc", "-T0"], stdin=cat.stdout, stdout=subprocess.PIPE)
    tar = subprocess.Popen(["tar", "-xf", "-", "-C", str(dest), "--no-same-owner"], stdin=xz.stdout)
    cat.stdout.close()
    xz.stdout.close()
    codes = [tar.wait(), xz.wait(), cat.wait()]
    if any(codes):
        raise RuntimeError(f"extracting {files[0].name}...: tar/xz/cat exited {codes}")


class _Joined:
    """The chunks of one archive read as one file (what ``cat`` gives the tools)."""

    def __init__(self, files: list[Path]):
        self._files = iter(files)
        self._current = None

    def read(self, size: int = -1) -> bytes:
        while True:
            if self._current is None:
                path = next(self._files, None)
                if path is None:
                    return b""
                self._current = open(path, "rb")
            block = self._current.read(size)
            if block:
                return block
            self._current.close()
            self._current = None


def _extract_with_stdlib(files: list[Path], dest: Path) -> None:
    with lzma.open(_Joined(files)) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


def find_host_site() -> Path | None:
    """This Python's site-packages that holds the nvidia/ CUDA libraries (the image's torch's)."""
    candidates = [*site_module.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return next((Path(p) for p in candidates if (Path(p) / "nvidia").is_dir()), None)


def link_host_libraries(site: Path, host_site: Path | None) -> dict[str, str]:
    """Link each of the host's nvidia/<lib> folders into ``site/nvidia`` unless the bundle has its own (NCCL)."""
    if host_site is None or not (host_site / "nvidia").is_dir():
        return {}
    (site / "nvidia").mkdir(parents=True, exist_ok=True)
    linked = {}
    for lib in sorted((host_site / "nvidia").iterdir()):
        target = site / "nvidia" / lib.name
        if not lib.is_dir() or lib.name == "__pycache__" or target.exists() or target.is_symlink():
            continue
        target.symlink_to(lib.resolve())
        linked[lib.name] = str(lib.resolve())
    return linked


def install_wheel(wheel: Path, site: Path, bin_dir: Path) -> list[str]:
    """Install a pure-Python wheel into ``site`` (replacing an earlier install) and its console scripts
    into ``bin_dir``; what ``pip install --no-deps --target`` does, without needing pip on the host."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        for top in {n.split("/", 1)[0] for n in names}:
            shutil.rmtree(site / top, ignore_errors=True)
        stem = wheel.name.split("-")[0]
        for old in site.glob(f"{stem}-*.dist-info"):
            shutil.rmtree(old)
        zf.extractall(site)
        entry_points = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
        return write_scripts(zf.read(entry_points).decode() if entry_points else "", bin_dir)


def write_scripts(entry_points: str, bin_dir: Path) -> list[str]:
    """Write the console scripts of an ``entry_points.txt`` text into ``bin_dir``, run by this Python
    (pip's launchers, which the bundle's carried distributions do not get: they travel as files)."""
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.read_string(entry_points)
    scripts = []
    if parser.has_section("console_scripts"):
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, target in parser.items("console_scripts"):
            module, func = (s.strip() for s in target.split(":"))
            script = bin_dir / name
            script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
            script.chmod(0o755)
            scripts.append(name)
    return scripts


def set_up_pd(record: dict, site: Path, bin_dir: Path) -> dict:
    """For a bundle packed --with-pd: the router's scripts, and where the host provides each library that
    NIXL's and the router's binaries load from outside the bundle (None: not found, that part will fail)."""
    if not record.get("bundled"):
        return {"bundled": False, "reason": record.get("reason", "packed before --with-pd existed")}
    versions = installed(site)
    scripts = []
    for name in record["distributions"]:
        for info in site.glob(f"{normalize(name).replace('-', '_')}-*.dist-info/entry_points.txt"):
            scripts += write_scripts(info.read_text(), bin_dir)
    found = {lib: find_library(lib, site) for lib in record["host_libraries"]}
    in_bundle = [str(Path(path).parent) for path in found.values() if path and path.startswith(str(site))]
    return {"bundled": True, "versions": {n: versions.get(normalize(n)) for n in record["distributions"]},
            "console_scripts": scripts, "host_libraries": found, "library_path": sorted(set(in_bundle))}


def find_library(name: str, site: Path) -> str | None:
    """Where the dynamic loader would find ``name``: the host's CUDA libraries linked into
    ``site/nvidia``, then LD_LIBRARY_PATH, then the loader's cache (``ldconfig -p``)."""
    dirs = [*sorted(site.glob("nvidia/*/lib")), *map(Path, filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")))]
    for d in dirs:
        if (d / name).exists():
            return str(d / name)
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else None)
    if ldconfig:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            lib, _, path = line.strip().partition(" => ")
            if lib.split(" (")[0] == name and "x86-64" in lib:
                return path
    return None


def installed(site: Path) -> dict[str, str]:
    """{normalized name: version} of the distributions in ``site``, from their dist-info folder names."""
    found = {}
    for info in site.glob("*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").partition("-")
        found[normalize(name)] = version
    return found


def pth_paths(site: Path) -> list[str]:
    """The folders the ``.pth`` files in ``site`` add to ``sys.path`` (the CuTe DSL's adds its packages'
    folder). Python reads ``.pth`` files only in site directories, not in PYTHONPATH's, so env.sh puts
    these on PYTHONPATH itself; they are found as a site directory would find them, in a child Python."""
    if not any(site.glob("*.pth")):
        return []
    probe = ("import json, site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
             "print(json.dumps([p for p in sys.path if p not in before and p != sys.argv[1]]))")
    done = subprocess.run([sys.executable, "-S", "-c", probe, str(site)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(site)})
    if done.returncode != 0:
        raise RuntimeError(f"reading the .pth files of {site} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_env(root: Path, cache_root: Path, bundle_id: str, library_path: list[str] = (),
              python_paths: list[str] = ()) -> Path:
    q = shlex.quote
    loader = [f'export LD_LIBRARY_PATH={q(":".join(library_path))}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"',
              ] if library_path else []
    lines = [
        f"# bundle {bundle_id}, set up by `python -m tools.airgap unpack --finish`: source it before serving.",
        f"export DSV4_BUNDLE_ROOT={q(str(root))}",
        f"export DSV4_BUNDLE_PYTHON={q(sys.executable)}",
        f'export PYTHONPATH={q(":".join([str(root / "site"), *python_paths]))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        f'export PATH={q(str(root / "bin"))}":$PATH"',
        *(["# NIXL's UCX CUDA modules load libcudart.so.13 by name (the host's, linked under site/nvidia)"] + loader
          if loader else []),
        "# JIT caches, all under one root that can be kept between runs",
        f'export DSV4_CACHE_ROOT="${{DSV4_CACHE_ROOT:-{cache_root}}}"',
        *(f'export {var}="$DSV4_CACHE_ROOT{"/" + sub if sub else ""}"' for var, sub in CACHES.items()),
    ]
    env = root / "env.sh"
    env.write_text("\n".join(lines) + "\n")
    return env

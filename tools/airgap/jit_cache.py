"""The GPU host's JIT caches (Triton, TileLang, DeepGEMM, sglang's own, the driver's), carried between hosts.

A DeepSeek-V4 server on a fresh GPU host compiles upstream's kernels while it captures decode graphs: three
servers on Flash's dimensions were still compiling after 300 s on an H200 with a cold cache, eight small ones
started in 85 s with the cache of an earlier run. A cluster whose nodes start bare can keep that time by
carrying the cache root (``DSV4_CACHE_ROOT``, which ``env.sh`` points every cache at): ``save`` writes it as
xz parts no larger than a given size (uploads and downloads may be limited per file), ``load`` puts them back.
Standard library only, like ``unpack``.

    python -m tools.airgap cache save --out DIR [--part-mb 15]     # DIR/jit_cache.tar.xz.00, .01, ...
    python -m tools.airgap cache load DIR/jit_cache.tar.xz.*

The same root tells a benchmark when a measured stretch waited on a compile (:func:`compiled_since`, :func:`during`).
"""

from __future__ import annotations

import io
import lzma
import os
import tarfile
import time
from pathlib import Path

NAME = "jit_cache.tar.xz"


def default_root() -> Path:
    return Path(os.environ.get("DSV4_CACHE_ROOT", "/tmp/dsv4-bundle/cache"))


def save(cache_root: Path, out_dir: Path, part_mb: float = 15.0, preset: int = 1) -> list[Path]:
    """The cache root as ``out_dir/jit_cache.tar.xz.NN`` parts of at most ``part_mb`` MiB; returns them."""
    if not cache_root.is_dir():
        raise SystemExit(f"no JIT cache at {cache_root}: run a server first, or point --cache-root at it")
    buf = io.BytesIO()
    with lzma.open(buf, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(cache_root, arcname=".")
    data, size = buf.getvalue(), int(part_mb * (1 << 20))
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, max(len(data), 1), size):
        part = out_dir / f"{NAME}.{i // size:02d}"
        part.write_bytes(data[i:i + size])
        parts.append(part)
    return parts


def load(parts: list[Path], cache_root: Path) -> int:
    """Extract the parts (in name order, all of one save) into the cache root; returns the files written."""
    data = b"".join(p.read_bytes() for p in sorted(parts))
    cache_root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data)), mode="r") as tar:
        tar.extractall(cache_root, filter="data")  # nothing lands outside the cache root
        return sum(m.isfile() for m in tar.getmembers())


def compiled_since(cache_root: Path, since: float) -> dict:
    """What the caches under ``cache_root`` gained since ``since`` (epoch seconds): files per cache and the Triton
    kernels among them. A server compiles a kernel for a shape it has not met into this root and reads it from
    there after (a loaded cache keeps its archive's file times), so a file newer than a stretch's start says
    that the stretch waited on a compile: an H100 took 2-15 s for a DeepGEMM or TileLang kernel and about a
    second for a Triton one, against 10-20 s for a C=64 level of the ``agents`` set. Names starting with a dot
    are markers, not compiles (DeepGEMM wrote its ``.committed`` minutes after a kernel's files)."""
    by_cache: dict[str, int] = {}
    triton: set[str] = set()
    for path in cache_root.rglob("*") if cache_root.is_dir() else ():
        try:
            if path.name.startswith(".") or not path.is_file() or path.stat().st_mtime < since:
                continue
        except FileNotFoundError:  # a compile's temporary file, gone between listing and looking
            continue
        kind = path.relative_to(cache_root).parts[0]
        by_cache[kind] = by_cache.get(kind, 0) + 1
        if kind == "triton" and path.suffix == ".cubin":
            triton.add(path.stem)
    return {"files": sum(by_cache.values()), "by_cache": dict(sorted(by_cache.items())),
            "triton_kernels": sorted(triton)}


def during(call):
    """``call()``'s result and what the cache root (:func:`default_root`) gained while it ran."""
    since = time.time()
    result = call()
    return result, compiled_since(default_root(), since)

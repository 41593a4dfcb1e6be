"""``pack``: turn a venv of the pin into the parts a GPU host without network access receives.

Runs on a host with network access, from a venv built for the GPU host's Python (``python3.12 -m
venv V && V/bin/pip install sglang==0.5.23``); it never imports what the venv holds, so any Python
3.10+ can pack. Steps: resolve the distributions the pin requires (``policy``), fetch wheels for any
the venv lacks, select their files minus the trims, blank GPU code for other architectures
(``fatbin``) and strip debug sections, write a few ``.tar.xz`` archives (one per large
distribution, so that the GPU host decompresses them side by side), and cut the archives into
chunks that fill parts of at most ``--part-mb`` MiB, the upload limit on the GPU host's side. Every
part holds ``manifest.json``, so any one part names its bundle and its siblings.

Archives are cached under ``--cache`` by what went into them, so repacking after a project commit
recompresses only the project's wheel.
"""

from __future__ import annotations

import csv
import datetime
import email.parser
import fnmatch
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from harness import dsv4_checkpoints, run_record
from tools.airgap import fatbin, policy
from tools.airgap.bundle import MANIFEST, normalize, sha256

try:
    from packaging.requirements import Requirement
except ImportError:  # pip's vendored copy: pack needs pip anyway to fetch missing wheels
    from pip._vendor.packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
FORMAT = 1
_RESERVE_STEP = 64 << 10
# Bumped when what pack does to a file changes, so cached archives from before are not reused.
_ARCHIVE_RECIPE = 1
_PIP_PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                  "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


@dataclass
class Dist:
    """An installed distribution: its name, version, requirements and files (relative to ``site``)."""

    name: str
    version: str
    requires: list[str]
    site: Path
    files: list[str] = field(default_factory=list)
    binaries: list[str] = field(default_factory=list)  # native programs it installs into the venv's bin/


def scan_site(site: Path) -> dict[str, Dist]:
    dists = {}
    for info in sorted(site.glob("*.dist-info")):
        meta = email.parser.Parser().parsestr((info / "METADATA").read_text(encoding="utf-8", errors="replace"))
        with open(info / "RECORD", newline="", encoding="utf-8") as f:
            files = [row[0] for row in csv.reader(f) if row]
        binaries = [p for p in files if p.startswith("../../../bin/") and _is_native(site / p)]
        files = [p for p in files if not p.startswith("../") and "__pycache__/" not in p and not p.endswith(".pyc")]
        dist = Dist(meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or [], site, files, binaries)
        dists[normalize(dist.name)] = dist
    return dists


def _is_native(path: Path) -> bool:
    """An ELF program (py-spy), which runs from any folder; not a console script, whose first line names the
    venv's own interpreter (the bundle writes those itself)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def resolve(roots: list[str], available: dict[str, Dist], python: str, skip: set[str]) -> tuple[list[str], dict[str, str]]:
    """Names reached from ``roots`` for CPython ``python`` ("3.12") on Linux x86-64, not following ``skip``.

    Returns (names reached, {name: requirement} of those not in ``available``).
    """
    env = dict(policy.TARGET_ENV, python_version=python, python_full_version=python + ".0")
    reached: dict[str, None] = {}
    missing: dict[str, str] = {}
    done: set[tuple[str, str]] = set()
    todo = [Requirement(root) for root in roots]
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        reached[name] = None
        if name in skip:
            continue
        dist = available.get(name)
        if dist is None:
            req.marker = None
            missing.setdefault(name, str(req))
            continue
        for extra in ["", *sorted(req.extras)]:
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for spec in dist.requires:
                sub = Requirement(spec)
                if sub.marker is None or sub.marker.evaluate(dict(env, extra=extra)):
                    todo.append(sub)
    return list(reached), missing


def fetch_wheels(requirements: list[str], cache: Path, python: str) -> dict[str, Dist]:
    """Download cp/abi3/py3 wheels of ``requirements`` for the GPU host and unpack each into the cache."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    tag = python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", tag,
           "--implementation", "cp", "-d", str(wheels)]
    for platform in _PIP_PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + requirements, check=True)
    found = {}
    for req in map(Requirement, requirements):
        for wheel in sorted(wheels.glob("*.whl")):
            name, version = wheel.name.split("-")[:2]
            if normalize(name) != normalize(req.name) or not req.specifier.contains(version, prereleases=True):
                continue
            site = cache / "unpacked" / wheel.stem
            if not site.exists():
                partial = site.parent / (site.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(partial)
                partial.rename(site)
            found.update(scan_site(site))
    return found


@dataclass
class Selection:
    """What the bundle carries and leaves, and why."""

    carried: dict[str, Dist]
    image: dict[str, str]
    dropped: dict[str, str]
    trimmed: dict[str, list[dict]]
    pd: list[str] = field(default_factory=list)  # carried only for --with-pd (their own archives)
    flashinfer: list[str] = field(default_factory=list)  # carried only for --with-flashinfer (their own archives)


def select(venv: Path, archs: tuple[int, ...], cache: Path, triton: bool, tilelang: bool,
           pd: bool = False, flashinfer: bool = False) -> tuple[Selection, str]:
    """Resolve the pin in ``venv`` (fetching wheels it lacks) and apply the policy; returns the python tag too.

    With ``pd``, NIXL and the PD router join the roots; what only they reach is listed in ``Selection.pd``.
    With ``flashinfer``, FlashInfer and its own requirements leave the dropped list; what only they reach is
    listed in ``Selection.flashinfer``.
    """
    sites = sorted(venv.glob("lib/python3.*/site-packages"))
    if len(sites) != 1:
        raise SystemExit(f"{venv}: expected one lib/python3.*/site-packages, found {len(sites)}")
    python = sites[0].parent.name.removeprefix("python")
    available = scan_site(sites[0])
    image = dict(policy.IMAGE)
    dropped = dict(policy.DROPPED)
    if not triton:
        name, why = policy.skip_triton()
        image[name] = why
    if not tilelang:
        dropped.update(policy.skip_tilelang())
    if pd:
        dropped.update(policy.pd_dropped())
    skip_without_flashinfer = set(image) | set(dropped)
    if flashinfer:
        dropped = {n: why for n, why in dropped.items() if n not in policy.FLASHINFER}
        dropped.update(policy.flashinfer_dropped())
    skip = set(image) | set(dropped)
    base = [policy.ROOT_REQUIREMENT, *policy.ALSO]
    roots = base + (list(policy.PD_REQUIREMENTS) if pd else [])
    reached, missing = resolve(roots, available, python, skip)
    while missing:  # a fetched wheel may require more that the venv lacks (nixl -> nixl-cu13)
        print(f"pack: {venv} lacks {', '.join(sorted(missing))}; fetching their wheels", flush=True)
        fetched = fetch_wheels(sorted(missing.values()), cache, python)
        if not set(missing) & set(fetched):
            raise SystemExit(f"pack: no wheel found for {', '.join(sorted(missing))}")
        available.update(fetched)
        reached, missing = resolve(roots, available, python, skip)
    carried, trimmed = {}, {}
    rules = {**policy.trims(archs), **(policy.pd_trims() if pd else {})}
    for name in reached:
        if name in skip:
            continue
        dist = available[name]
        kept, cut = [], {}
        for path in dist.files:
            why = next((w for pattern, w in rules.get(name, []) if fnmatch.fnmatch(path, pattern)), None)
            if why is None:
                kept.append(path)
            else:
                cut.setdefault(why, []).append(path)
        dist.files = kept
        carried[name] = dist
        if cut:
            trimmed[name] = [{"reason": why, "files": len(paths),
                              "bytes": sum((dist.site / p).stat().st_size for p in paths)} for why, paths in cut.items()]
    def decided(reasons: dict[str, str]) -> dict[str, dict]:
        """The entries that concern this pin: reached by its resolution or installed in its venv."""
        return {n: {"version_in_pin": available[n].version if n in available else None, "reason": why}
                for n, why in sorted(reasons.items()) if n in reached or n in available}

    only_pd = sorted(set(reached) - set(resolve(base, available, python, skip)[0]) - skip) if pd else []
    only_flashinfer = []
    if flashinfer:  # what the same roots carry with FlashInfer dropped, as without the option
        carried_without = set(resolve(roots, available, python, skip_without_flashinfer)[0]) - skip_without_flashinfer
        only_flashinfer = sorted(set(carried) - carried_without)
    selection = Selection(carried, decided(image), decided(dropped), trimmed, only_pd, only_flashinfer)
    return selection, "cp" + python.replace(".", "")


def wheel_builder_problem() -> str | None:
    """Why this python cannot build the project's wheel offline, or None. ``pip wheel --no-build-isolation``
    uses this python's own setuptools, which builds wheels itself only from 70.1 (before it, the ``wheel``
    package must be installed: without either pip fails deep inside with "invalid command 'bdist_wheel'")."""
    from importlib import metadata

    try:
        version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        version = None
    try:
        metadata.version("wheel")
        return None
    except metadata.PackageNotFoundError:
        pass
    parts = tuple(int(x) for x in re.findall(r"\d+", version or "0")[:2])
    if version is not None and parts >= (70, 1):
        return None
    return (f"pack builds the project's wheel offline with this python's setuptools ({sys.executable}: setuptools "
            f"{version or 'not installed'}, no 'wheel' package); it needs setuptools >= 70.1 or the 'wheel' package. "
            f"Run pack with the project's environment (python3 -m venv .venv && .venv/bin/pip install -e '.[test]', "
            f"then .venv/bin/python -m tools.airgap pack ...), or: {sys.executable} -m pip install 'setuptools>=70.1'")


def build_project_wheel(out: Path) -> Path:
    """The project's wheel, built offline from a copy of what a source distribution holds (not the checkout).

    Dated by its newest source file, not by the build (SOURCE_DATE_EPOCH, and the wheel's own time):
    the same source packs to the same bytes, so an unchanged project keeps the bundle id and the chunks a
    GPU host has staged.
    """
    problem = wheel_builder_problem()
    if problem:
        raise SystemExit(problem)
    src = out / "source"
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    newest = max(int(p.stat().st_mtime) for p in src.rglob("*") if p.is_file())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, env={**os.environ, "SOURCE_DATE_EPOCH": str(newest)})
    wheel = next(out.glob("dsv4_sm120-*.whl"))
    os.utime(wheel, (newest, newest))
    return wheel


@dataclass
class Archive:
    name: str
    members: list[tuple[str, Path]]  # (name in the archive, source file)
    holds: list[str]  # "name version" of each distribution in it

    @property
    def raw_bytes(self) -> int:
        return sum(src.stat().st_size for _, src in self.members)


def plan_archives(selection: Selection, wheel: Path) -> list[Archive]:
    """The archives, in part order: the serving stack, then --with-pd's, then --with-flashinfer's, then the
    project (changed most often).

    An option's distributions never join the serving stack's archives, so that those stay the same bytes
    with or without it: the same cached archives, and the same chunks on a GPU host's stage.
    """
    optional = {"pd": set(selection.pd), "flashinfer": set(selection.flashinfer)}
    serving = {n: d for n, d in selection.carried.items() if not any(n in names for names in optional.values())}
    archives = _group(serving, "site-packages")
    for group, names in optional.items():
        if names:
            archives += _group({n: d for n, d in selection.carried.items() if n in names}, group)
    archives.append(Archive("project", [(f"wheels/{wheel.name}", wheel)], [wheel.name]))
    return archives


def _group(dists: dict[str, Dist], shared_name: str) -> list[Archive]:
    """One archive per large distribution, and one named ``shared_name`` for all the small ones."""
    shared = Archive(shared_name, [], [])
    archives = []
    for name, dist in sorted(dists.items()):
        members = [(f"site/{p}", dist.site / p) for p in dist.files]
        members += [(f"bin/{Path(p).name}", (dist.site / p).resolve()) for p in dist.binaries]
        if sum(src.stat().st_size for _, src in members) >= policy.OWN_ARCHIVE_BYTES:
            archives.append(Archive(name, members, [f"{dist.name} {dist.version}"]))
        else:
            shared.members += members
            shared.holds.append(f"{dist.name} {dist.version}")
    return archives + [shared]


def _archive_key(archive: Archive, archs: tuple[int, ...], level: int, strip: bool) -> str:
    h = hashlib.sha256(json.dumps([_ARCHIVE_RECIPE, archive.name, archs, level, strip]).encode())
    for arcname, src in archive.members:
        st = src.stat()
        h.update(f"{arcname}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def write_archive(archive: Archive, dest: Path, archs: tuple[int, ...], level: int, threads: int,
                  strip: str | None) -> dict:
    """Write ``archive`` as ``dest`` (.tar.xz), blanking other GPUs' code and debug sections on copies.

    Returns what was changed: {"fatbin_pruned": {member: bytes zeroed/kept}, "debug_stripped": [member]}.
    """
    work = Path(tempfile.mkdtemp(prefix="dsv4-pack-", dir=dest.parent))
    changed = {"fatbin_pruned": {}, "debug_stripped": []}
    partial = dest.with_suffix(".partial")
    try:
        with open(partial, "wb") as out:
            proc = subprocess.Popen(["xz", f"-{level}", f"-T{threads}", "-c"], stdin=subprocess.PIPE, stdout=out) \
                if shutil.which("xz") else None
            sink = proc.stdin if proc else lzma.open(out, "wb", preset=level)
            with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for arcname, src in sorted(archive.members):
                    data = _slim(src, arcname, work, archs, strip, changed)
                    with open(data, "rb") as f:
                        info = tar.gettarinfo(arcname=arcname, fileobj=f)
                        info.mtime, info.uid, info.gid, info.uname, info.gname = src.stat().st_mtime, 0, 0, "", ""
                        tar.addfile(info, f)
                    if data != src:
                        data.unlink()
            sink.close()
            if proc and proc.wait():
                raise SystemExit(f"pack: xz failed on {archive.name}")
        partial.rename(dest)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return changed


def _slim(src: Path, arcname: str, work: Path, archs, strip: str | None, changed: dict) -> Path:
    """A copy of ``src`` without other GPUs' code and debug sections, or ``src`` itself when it has neither."""
    names = {name for name, _, _ in fatbin.read_sections(src)}
    prune = bool(names & set(fatbin.SECTIONS))
    debug = strip is not None and any(name.startswith(".debug_") for name in names)
    if not (prune or debug):
        return src
    copy = work / src.name
    shutil.copy2(src, copy)
    if debug:
        subprocess.run([strip, "--strip-debug", str(copy)], check=True)
        changed["debug_stripped"].append(arcname)
    if prune:
        zeroed, kept = fatbin.prune(copy, archs)
        if zeroed:
            changed["fatbin_pruned"][arcname] = {"zeroed": zeroed, "kept": kept}
    return copy


def layout(archives: dict[str, Path], capacity: int) -> list[list[dict]]:
    """Cut the archives, in order, into chunks filling parts of ``capacity`` bytes; one list of chunks per part."""
    parts: list[list[dict]] = [[]]
    room = capacity
    for name, path in archives.items():
        size, offset, index = path.stat().st_size, 0, 0
        while offset < size:
            if room == 0:
                parts.append([])
                room = capacity
            take = min(room, size - offset)
            parts[-1].append({"file": f"{name}.tar.xz.{index:03d}", "archive": name, "offset": offset, "bytes": take})
            offset, room, index = offset + take, room - take, index + 1
    return parts


def _git_commit() -> dict:
    head, dirty = run_record.checkout()
    return {"commit": head, "dirty": dirty}


def pack(venv: Path, out: Path, part_mb: float, archs: tuple[int, ...], cache: Path, level: int, threads: int,
         triton: bool = True, tilelang: bool = True, pd: bool = False, flashinfer: bool = False) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    selection, python_tag = select(venv, archs, cache, triton, tilelang, pd, flashinfer)
    strip = shutil.which("strip")
    work = Path(tempfile.mkdtemp(prefix="dsv4-wheel-"))
    try:
        wheel = build_project_wheel(work)
        archives, contents = {}, {}
        for archive in plan_archives(selection, wheel):
            key = _archive_key(archive, archs, level, strip is not None)
            dest = cache / "archives" / f"{archive.name}-{key}.tar.xz"
            record = dest.with_suffix(".json")
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                print(f"pack: compressing {archive.name} ({archive.raw_bytes / 2**20:.0f} MiB)", flush=True)
                changed = write_archive(archive, dest, archs, level, threads, strip)
                record.write_text(json.dumps(changed))
            archives[archive.name] = dest
            contents[archive.name] = {"holds": archive.holds, "files": len(archive.members),
                                      "raw_bytes": archive.raw_bytes, "bytes": dest.stat().st_size,
                                      "sha256": sha256(dest), **json.loads(record.read_text())}
        manifest = _manifest(selection, python_tag, archs, wheel, contents)
        capacity_limit = int(part_mb * 2**20)
        # The manifest lists the chunks and sits in every part, so each part leaves it room: whole 64 KiB
        # steps, so that a repack whose manifest only says more keeps the chunk boundaries (and the
        # chunks a GPU host has staged).
        reserve = _RESERVE_STEP
        while True:
            if reserve >= capacity_limit:
                raise SystemExit(f"pack: --part-mb {part_mb} leaves no room beside the manifest")
            parts = layout(archives, capacity_limit - reserve)
            manifest["chunks"] = [dict(c, part=f"part{i:02d}") for i, chunks in enumerate(parts, 1) for c in chunks]
            manifest["parts"] = [f"part{i:02d}" for i in range(1, len(parts) + 1)]
            needed = len(json.dumps(manifest, indent=1)) + 128 * len(manifest["chunks"]) + 4096  # + sha256s, id
            if needed <= reserve:
                break
            reserve = -(-needed // _RESERVE_STEP) * _RESERVE_STEP
        _write_parts(out, archives, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _manifest(selection: Selection, python_tag: str, archs, wheel: Path, contents: dict) -> dict:
    holder = {held: name for name, archive in contents.items() for held in archive["holds"]}
    return {
        "format": FORMAT,
        "bundle": None,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pin": policy.ROOT_REQUIREMENT,
        "python": python_tag,
        "platform": "linux x86_64",
        "archs": list(archs),
        "project": {**_git_commit(), "wheel": wheel.name, "wheel_sha256": sha256(wheel)},
        "models": {name: hashlib.sha256(json.dumps(dsv4_checkpoints.config(name), sort_keys=True).encode()).hexdigest()
                   for name in dsv4_checkpoints.MODELS},
        "archives": contents,
        "bundled": {n: {"version": d.version, "archive": holder[f"{d.name} {d.version}"]}
                    for n, d in sorted(selection.carried.items())},
        "trimmed": selection.trimmed,
        "left_to_image": selection.image,
        "dropped": selection.dropped,
        "pd": pd_record(selection),
        "flashinfer": flashinfer_record(selection),
    }


def flashinfer_record(selection: Selection) -> dict:
    """Whether the bundle carries FlashInfer, and which of its distributions."""
    if not selection.flashinfer:
        return {"bundled": False, "reason": "packed without --with-flashinfer"}
    return {"bundled": True, "reason": "--with-flashinfer: " + policy.FLASHINFER_REASON,
            "distributions": {selection.carried[n].name: selection.carried[n].version for n in selection.flashinfer}}


def pd_record(selection: Selection) -> dict:
    """Whether the bundle carries the PD pair's NIXL and router, and which host libraries their binaries
    load that neither they nor the base system provide (the GPU host's driver and CUDA runtime)."""
    if not selection.pd:
        return {"bundled": False, "reason": "packed without --with-pd"}
    dists = [selection.carried[n] for n in selection.pd]
    provided, users = set(policy.BASE_LIBRARIES), {}
    for dist in dists:
        for rel in dist.files:
            soname, libs = fatbin.needed(dist.site / rel)
            provided.update({Path(rel).name, soname} - {None})
            for lib in libs:
                users.setdefault(lib, []).append(rel)
    return {
        "bundled": True,
        "reason": "--with-pd: " + "; ".join(f"{req}: {why}" for req, why in policy.PD_REQUIREMENTS.items()),
        "distributions": {d.name: d.version for d in dists},
        "host_libraries": {lib: {"files": len(paths), "e.g.": sorted(paths)[:2]}
                           for lib, paths in sorted(users.items()) if lib not in provided},
    }


def _write_parts(out: Path, archives: dict[str, Path], manifest: dict) -> None:
    """Write each part directory: its chunks and the manifest; the bundle id hashes every chunk."""
    for chunk in manifest["chunks"]:
        chunk["sha256"] = sha256(archives[chunk["archive"]], chunk["offset"], chunk["bytes"])
    manifest["bundle"] = hashlib.sha256("".join(c["sha256"] for c in manifest["chunks"]).encode()).hexdigest()[:12]
    if out.exists():
        for stale in out.glob("part[0-9][0-9]"):
            shutil.rmtree(stale)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(manifest, indent=1) + "\n"
    (out / MANIFEST).write_text(text)
    for part in manifest["parts"]:
        (out / part).mkdir()
        (out / part / MANIFEST).write_text(text)
    for chunk in manifest["chunks"]:
        with open(archives[chunk["archive"]], "rb") as src, open(out / chunk["part"] / chunk["file"], "wb") as dst:
            src.seek(chunk["offset"])
            left = chunk["bytes"]
            while left:
                block = src.read(min(left, 8 << 20))
                dst.write(block)
                left -= len(block)


def report(manifest: dict, out: Path) -> None:
    """Print the parts (what each upload weighs) and the archives (what each holds)."""
    print(f"bundle {manifest['bundle']}: {len(manifest['parts'])} parts in {out}")
    for part in manifest["parts"]:
        size = sum(f.stat().st_size for f in (out / part).iterdir())
        files = [c["file"] for c in manifest["chunks"] if c["part"] == part]
        print(f"  {part}  {size / 2**20:6.1f} MiB  {' '.join(files)}")
    for name, a in manifest["archives"].items():
        print(f"  archive {name}: {a['bytes'] / 2**20:.1f} MiB xz of {a['raw_bytes'] / 2**20:.0f} MiB "
              f"({', '.join(a['holds'][:4])}{', ...' if len(a['holds']) > 4 else ''})")

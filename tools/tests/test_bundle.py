"""pack -> parts -> unpack on a tiny fake venv: the parts stay under the upload limit, any arrival order
works, and the tree the GPU host gets holds the venv's files byte for byte plus its set-up."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness import dsv4_checkpoints
from tools.airgap import bundle, pack

REPO = Path(__file__).resolve().parents[2]
PART_MB = 1.0


def _dist(site: Path, name: str, version: str, files: dict[str, bytes], requires=()) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    record = [f"{rel},sha256=x,{len(data)}" for rel, data in files.items()]
    record += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,", f"../../../bin/{name},,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


def _elf(needed: list[str], soname: str | None = None) -> bytes:
    """A minimal ELF64 file whose dynamic section names ``needed`` (and ``soname``): enough for pack's reader."""
    names = [soname, *needed] if soname else needed
    dynstr = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    offsets = [dynstr.index(b"\0" + n.encode() + b"\0") + 1 for n in names]
    tags = ([14] if soname else []) + [1] * len(needed)
    dynamic = b"".join(struct.pack("<qQ", t, o) for t, o in zip(tags, offsets)) + struct.pack("<qQ", 0, 0)
    shstr = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    body = dynstr + dynamic + shstr
    at_dynstr, at_dynamic, at_shstr = 64, 64 + len(dynstr), 64 + len(dynstr) + len(dynamic)
    shoff = 64 + len(body)
    header = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0,
                                                                  64, 4, 3)
    section = lambda name, kind, off, size: struct.pack("<IIQQQQIIQQ", name, kind, 0, 0, off, size, 0, 0, 1, 0)
    sections = (section(0, 0, 0, 0) + section(1, 3, at_dynstr, len(dynstr))
                + section(9, 6, at_dynamic, len(dynamic)) + section(18, 3, at_shstr, len(shstr)))
    return header + body + sections


def _pd_dists(site: Path) -> None:
    """NIXL as PyPI ships 1.5.1 (a meta package over per-CUDA builds) and the PD router."""
    _dist(site, "nixl", "1.5.1", {"nixl/__init__.py": b"", "nixl/_api.py": b""},
          requires=["nixl-cu12==1.5.1", "nixl-cu13==1.5.1"])
    _dist(site, "nixl-cu12", "1.5.1", {"nixl_cu12/__init__.py": b""})
    _dist(site, "nixl-cu13", "1.5.1", {
        "nixl_cu13/__init__.py": b"",
        ".nixl_cu13.mesonpy.libs/libnixl.so": _elf(["libucs-1.so.0", "libc.so.6"], "libnixl.so"),
        "nixl_cu13.libs/libucs-1.so.0": _elf(["libc.so.6"]),
        "nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0": _elf(["libucs-1.so.0", "libcuda.so.1", "libcudart.so.13"]),
        "nixl_ep_cu13/nixl_ep_cpp_torch214.so": _elf(["libtorch.so"]),
    }, requires=["torch", "numpy"])
    _dist(site, "sglang-router", "0.3.2", {"sglang_router/__init__.py": b"", "sglang_router/cli.py": b"def main(): pass\n",
                                           "sglang_router/sglang_router_rs.abi3.so": _elf(["libstdc++.so.6"])})
    info = site / "sglang_router-0.3.2.dist-info"
    (info / "entry_points.txt").write_text("[console_scripts]\nsglang-router = sglang_router.cli:main\n")
    (info / "RECORD").write_text((info / "RECORD").read_text() + f"{info.name}/entry_points.txt,,\n")


def _flashinfer_dists(site: Path) -> None:
    """FlashInfer as the pin installs it: the CuTe DSL in per-CUDA runtimes, its packages found through a .pth."""
    _dist(site, "flashinfer-python", "0.7.2", {"flashinfer/__init__.py": b"", "flashinfer/data/include/x.cuh": b""},
          requires=["nvidia-cudnn-frontend>=1.31.0", "nvidia-cutlass-dsl>=4.6.2a0", "cuda-tile>=1.4.0", "torch"])
    _dist(site, "nvidia-cudnn-frontend", "1.32.0", {"cudnn/__init__.py": b""}, requires=["nvidia-cutlass-dsl[cu13]>=4.8.0"])
    _dist(site, "cuda-tile", "1.7.0", {"cuda/tile/__init__.py": b""})
    pth = (b"import sys, os, nvidia_cutlass_dsl; "
           b"sys.path.insert(0, os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n")
    _dist(site, "nvidia-cutlass-dsl", "4.8.0", {"nvidia_cutlass_dsl_packages.pth": pth},
          requires=["nvidia-cutlass-dsl-libs-base==4.8.0", "nvidia-cutlass-dsl-libs-cu12==4.8.0",
                    'nvidia-cutlass-dsl-libs-cu13==4.8.0; extra == "cu13"'])
    _dist(site, "nvidia-cutlass-dsl-libs-base", "4.8.0",
          {"nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": b"RUNTIME = 'cu13'\n"})
    for cuda in ("cu12", "cu13"):
        _dist(site, f"nvidia-cutlass-dsl-libs-{cuda}", "4.8.0", {f"nvidia_cutlass_dsl/{cuda}/lib/runtime.so": b"x"})


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv shaped like the pin's: a root 'sglang', a multi-MB binary, NCCL's library folder."""
    root = tmp_path_factory.mktemp("venv")
    site = root / "lib" / "python3.12" / "site-packages"
    rng = __import__("random").Random(0)
    _dist(site, "sglang", "0.5.23", {"sglang/__init__.py": b"__version__ = '0.5.23'\n",
                                     "sglang/test/test_utils.py": b"# trimmed\n"},
          requires=["bigbin>=1", "small[extra1]", "numpy", "torch", "flashinfer-python==0.7.2", "triton", "tilelang",
                    'old-python-only; python_version < "3.12"', 'test-only; extra == "test"'])
    _dist(site, "bigbin", "1.0", {"bigbin/__init__.py": b"", "bigbin/_core.so": rng.randbytes(3 << 20)})
    _dist(site, "small", "2.0", {"small/__init__.py": b"X = 1\n"}, requires=['nvidia-nccl-cu13; extra == "extra1"'])
    (root / "bin").mkdir()  # what small puts in the venv's bin/: a native program (like py-spy) and a console script
    (root / "bin" / "small-tool").write_bytes(_elf(["libc.so.6"]))
    (root / "bin" / "small-tool").chmod(0o755)
    (root / "bin" / "small-cli").write_text(f"#!{root}/bin/python\n")
    record = site / "small-2.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "../../../bin/small-tool,,\n../../../bin/small-cli,,\n")
    _dist(site, "nvidia-nccl-cu13", "2.30.7", {"nvidia/nccl/lib/libnccl.so.2": rng.randbytes(200_000)})
    _dist(site, "triton", "3.8.0", {f"triton/{rel}": b"x" for rel in (
        "__init__.py", "backends/nvidia/bin/ptxas", "backends/nvidia/bin/ptxas-blackwell", "_C/libproton.so")})
    _dist(site, "tilelang", "0.1.12", {"tilelang/__init__.py": b""}, requires=["z3-solver"])
    _dist(site, "z3-solver", "4.15.4.0", {"z3/__init__.py": b""})
    _dist(site, "torch", "2.14.1", {"torch/__init__.py": b""})
    for name in ("dill", "jsonschema"):  # the server imports these itself (policy.ALSO)
        _dist(site, name, "1.0", {f"{name}/__init__.py": b""})
    _pd_dists(site)
    _flashinfer_dists(site)
    return root


def _pack(venv: Path, out: Path, cache: Path, *flags: str) -> Path:
    subprocess.run([sys.executable, "-m", "tools.airgap", "pack", "--venv", str(venv), "--out", str(out),
                    "--part-mb", str(PART_MB), "--cache", str(cache), "--xz-level", "6", *flags],
                   cwd=REPO, check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def packed(venv, tmp_path_factory) -> Path:
    return _pack(venv, tmp_path_factory.mktemp("bundle"), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def packed_pd(venv, tmp_path_factory) -> Path:
    return _pack(venv, tmp_path_factory.mktemp("bundle-pd"), tmp_path_factory.mktemp("cache-pd"), "--with-pd")


@pytest.fixture(scope="module")
def packed_flashinfer(venv, tmp_path_factory) -> Path:
    return _pack(venv, tmp_path_factory.mktemp("bundle-fi"), tmp_path_factory.mktemp("cache-fi"), "--with-flashinfer")


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _unpack(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.airgap", "unpack", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True)


def test_parts_stay_under_the_limit_and_the_manifest_names_everything(packed):
    manifest = _manifest(packed)
    parts = sorted(packed.glob("part*"))
    assert [p.name for p in parts] == manifest["parts"] and len(parts) >= 4  # 3 MiB of random bytes at 1 MiB a part
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= PART_MB * 2**20
        assert json.loads((part / "manifest.json").read_text()) == manifest
    assert manifest["python"] == "cp312" and manifest["archs"] == [90]
    assert manifest["project"]["wheel"].startswith("dsv4_sm120-") and "project" in manifest["archives"]
    assert set(manifest["models"]) == set(dsv4_checkpoints.MODELS) >= {"tiny", "flash12"}
    assert set(manifest["bundled"]) == {"sglang", "bigbin", "small", "nvidia-nccl-cu13", "dill", "jsonschema",
                                        "triton", "tilelang", "z3-solver", "torch"}
    assert manifest["left_to_image"]["numpy"]["reason"] and manifest["dropped"]["flashinfer-python"]["reason"]
    assert manifest["trimmed"]["sglang"][0]["files"] == 1
    assert manifest["pd"] == {"bundled": False, "reason": "packed without --with-pd"}
    assert "pd" not in manifest["archives"] and "nixl-cu12" not in manifest["dropped"]
    big = [c for c in manifest["chunks"] if c["archive"] == "site-packages"]
    assert len({c["part"] for c in big}) >= 3  # the big binary is split across parts


def test_parts_arrive_one_at_a_time_in_any_order_and_finish_sets_up_the_tree(packed, venv, tmp_path):
    manifest = _manifest(packed)
    stage = tmp_path / "stage"
    parts = sorted(packed.glob("part*"), reverse=True)
    first = _unpack("--part", parts[0], "--stage", stage)
    assert first.returncode == 0 and f"parts missing: {' '.join(p.name for p in sorted(parts[1:]))}" in first.stdout
    assert _unpack("--finish", "--stage", stage).returncode == 1  # not all there yet
    for part in parts[1:]:
        assert _unpack("--part", part, "--stage", stage).returncode == 0
    again = _unpack("--part", parts[0], "--stage", stage)
    assert "0 chunks copied" in again.stdout and "parts missing: -" in again.stdout

    host = tmp_path / "host-site"
    (host / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (host / "nvidia" / "nccl" / "lib").mkdir(parents=True)  # the image's own NCCL: the bundle's wins
    done = _unpack("--finish", "--stage", stage, "--host-site", host, "--cache-root", tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    root = stage / "root"
    site = root / "site"
    venv_site = venv / "lib" / "python3.12" / "site-packages"
    for rel in ["bigbin/_core.so", "small/__init__.py", "sglang/__init__.py", "nvidia/nccl/lib/libnccl.so.2",
                "bigbin-1.0.dist-info/METADATA"]:
        assert (site / rel).read_bytes() == (venv_site / rel).read_bytes(), rel
    assert not (site / "sglang" / "test").exists()
    assert (site / "nvidia" / "cu13").resolve() == (host / "nvidia" / "cu13").resolve()
    assert not (site / "nvidia" / "nccl").is_symlink()
    assert (site / "dsv4_sm120" / "plugin.py").exists() and (root / "bin" / "dsv4-sm120").exists()
    tool = root / "bin" / "small-tool"  # a native program comes along, runnable; a venv's console script does not
    assert tool.read_bytes() == (venv / "bin" / "small-tool").read_bytes() and os.access(tool, os.X_OK)
    assert not (root / "bin" / "small-cli").exists()
    for name in dsv4_checkpoints.MODELS:
        assert json.loads((root / "models" / name / "config.json").read_text()) == dsv4_checkpoints.config(name)

    env = (root / "env.sh").read_text()
    assert f"export PYTHONPATH={site}" in env and "TRITON_CACHE_DIR=" in env and "TVM_FFI_CACHE_DIR=" in env
    shell = subprocess.run(["bash", "-c", f". {root / 'env.sh'} && echo $PYTHONPATH && echo $TILELANG_CACHE_DIR"],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    assert shell == [str(site), str(tmp_path / "cache" / "tilelang")]
    info = json.loads((root / "bundle.json").read_text())
    assert info["bundle"] == manifest["bundle"] and info["versions"]["sglang"] == "0.5.23"
    assert info["versions"]["dsv4-sm120"]
    assert info["host_libraries_linked"] == {"cu13": str((host / "nvidia" / "cu13").resolve())}
    assert info["pd"]["bundled"] is False and not (site / "nixl").exists() and not (root / "bin" / "sglang-router").exists()
    assert "LD_LIBRARY_PATH" not in env
    assert "already set up" in _unpack("--finish", "--stage", stage).stdout


def test_with_pd_carries_nixl_and_the_router_in_archives_of_their_own(packed, packed_pd):
    manifest, plain = _manifest(packed_pd), _manifest(packed)
    pd = manifest["pd"]
    assert pd["bundled"] and pd["distributions"] == {"nixl": "1.5.1", "nixl-cu13": "1.5.1", "sglang-router": "0.3.2"}
    assert {"nixl", "nixl-cu13", "sglang-router"} <= set(manifest["bundled"]) and "nixl-cu12" in manifest["dropped"]
    assert {manifest["bundled"][n]["archive"] for n in pd["distributions"]} == {"pd"}
    assert set(pd["host_libraries"]) == {"libcuda.so.1", "libcudart.so.13"}  # not its own, not the base system's
    assert manifest["trimmed"]["nixl-cu13"][0]["files"] == 1  # NIXL EP's torch extension
    for name in set(plain["archives"]) - {"project"}:  # the serving stack's archives stay the same bytes
        assert manifest["archives"][name]["sha256"] == plain["archives"][name]["sha256"], name


def test_with_pd_unpack_sets_up_the_router_and_the_cuda_runtime_for_ucx(packed_pd, tmp_path):
    stage = tmp_path / "stage"
    for part in sorted(packed_pd.glob("part*")):
        assert _unpack("--part", part, "--stage", stage).returncode == 0
    host = tmp_path / "host-site"
    (host / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (host / "nvidia" / "cu13" / "lib" / "libcudart.so.13").write_bytes(b"")
    done = _unpack("--finish", "--stage", stage, "--host-site", host)
    assert done.returncode == 0, done.stderr
    root = stage / "root"
    site = root / "site"
    assert (site / "nixl" / "_api.py").exists() and (site / ".nixl_cu13.mesonpy.libs" / "libnixl.so").exists()
    assert not (site / "nixl_ep_cu13").exists() and not (site / "nixl_cu12").exists()
    assert (root / "bin" / "sglang-router").exists()
    info = json.loads((root / "bundle.json").read_text())
    assert info["versions"]["nixl-cu13"] == "1.5.1" and info["versions"]["sglang-router"] == "0.3.2"
    cudart = site / "nvidia" / "cu13" / "lib"
    assert info["pd"]["host_libraries"]["libcudart.so.13"] == str(cudart / "libcudart.so.13")
    assert info["pd"]["console_scripts"] == ["sglang-router"] and "libcudart.so.13" not in done.stdout.split("not found:")[1]
    shell = subprocess.run(["bash", "-c", f". {root / 'env.sh'} && echo $LD_LIBRARY_PATH && command -v sglang-router"],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    assert shell == [str(cudart), str(root / "bin" / "sglang-router")]


def test_finish_without_the_xz_and_tar_commands(packed, venv, tmp_path, monkeypatch):
    stage = tmp_path / "stage"
    for part in sorted(packed.glob("part*")):
        assert bundle.add_part(part, stage) == 0
    monkeypatch.setattr(bundle.shutil, "which", lambda name: None)
    assert bundle.finish(stage, host_site=tmp_path) == 0
    so = "bigbin/_core.so"
    assert (stage / "root" / "site" / so).read_bytes() == (venv / "lib" / "python3.12" / "site-packages" / so).read_bytes()


def test_a_damaged_chunk_is_named_and_refused(packed, tmp_path):
    part = tmp_path / "part01"
    part.mkdir()
    manifest = _manifest(packed)
    for f in (packed / "part01").iterdir():
        part.joinpath(f.name).write_bytes(f.read_bytes())
    victim = next(c["file"] for c in manifest["chunks"] if c["part"] == "part01")
    data = bytearray((part / victim).read_bytes())
    data[100] ^= 0xFF
    (part / victim).write_bytes(bytes(data))
    result = _unpack("--part", part, "--stage", tmp_path / "stage")
    assert result.returncode == 1 and f"DAMAGED in {part}" in result.stdout and victim in result.stdout


def test_a_newer_bundle_keeps_the_chunks_it_shares(packed, tmp_path):
    """After a repack that changes only the project, the stage needs only the part with the changed chunk."""
    stage = tmp_path / "stage"
    for part in sorted(packed.glob("part*")):
        bundle.add_part(part, stage)
    old = _manifest(packed)
    new = json.loads(json.dumps(old))
    wheel = b"another wheel"
    last = new["chunks"][-1]
    assert last["archive"] == "project"
    last.update(sha256=hashlib.sha256(wheel).hexdigest(), bytes=len(wheel))
    new["bundle"] = "newer"
    newer = tmp_path / "newer" / last["part"]
    newer.mkdir(parents=True)
    (newer / "manifest.json").write_text(json.dumps(new))
    (newer / last["file"]).write_bytes(wheel)
    out = _unpack("--part", newer, "--stage", stage).stdout
    assert f"shares {len(old['chunks']) - 1} of its chunks" in out and "parts missing: -" in out


def test_arch_and_flags_choose_what_is_carried(venv, tmp_path):
    hopper, _ = pack.select(venv, (90,), tmp_path, triton=True, tilelang=True)
    carried = [f for f in hopper.carried["triton"].files if f.startswith("triton/")]
    assert carried == ["triton/__init__.py", "triton/backends/nvidia/bin/ptxas"]  # no profiler, no Blackwell ptxas
    both, _ = pack.select(venv, (90, 120), tmp_path, triton=True, tilelang=True)
    assert "triton/backends/nvidia/bin/ptxas-blackwell" in both.carried["triton"].files  # Blackwell's ptxas
    lean, _ = pack.select(venv, (90,), tmp_path, triton=False, tilelang=False)
    assert "triton" in lean.image and {"tilelang", "z3-solver"} <= set(lean.dropped)
    assert not {"triton", "tilelang", "z3-solver"} & set(lean.carried)


def test_jit_cache_save_splits_within_the_size_and_load_puts_every_file_back(tmp_path):
    import os

    from tools.airgap import __main__ as cli

    root = tmp_path / "cache"
    for i in range(3):
        (root / "triton" / f"k{i}").mkdir(parents=True)
        (root / "triton" / f"k{i}" / "kernel.cubin").write_bytes(os.urandom(300_000))  # incompressible
    assert cli.main(["cache", "save", "--cache-root", str(root), "--out", str(tmp_path / "out"), "--part-mb", "0.25"]) == 0
    parts = sorted((tmp_path / "out").iterdir())
    assert len(parts) >= 4 and all(p.stat().st_size <= 0.25 * (1 << 20) for p in parts)
    fresh = tmp_path / "fresh"
    assert cli.main(["cache", "load", *map(str, reversed(parts)), "--cache-root", str(fresh)]) == 0
    for i in range(3):
        rel = f"triton/k{i}/kernel.cubin"
        assert (fresh / rel).read_bytes() == (root / rel).read_bytes()


@pytest.mark.parametrize("setuptools, wheel, refused", [("65.5.0", False, True), ("70.1.0", False, False),
                                                         ("65.5.0", True, False), (None, False, True)])
def test_a_python_that_cannot_build_the_wheel_is_told_which_and_what_it_needs(monkeypatch, setuptools, wheel, refused):
    from importlib import metadata

    def version(name):
        found = {"setuptools": setuptools, "wheel": "0.45.0" if wheel else None}.get(name)
        if found is None:
            raise metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(metadata, "version", version)
    problem = pack.wheel_builder_problem()
    assert (problem is not None) == refused
    if refused:
        assert sys.executable in problem and "setuptools >= 70.1" in problem and ".venv/bin/python -m tools.airgap" in problem
        with pytest.raises(SystemExit, match="setuptools >= 70.1"):
            pack.build_project_wheel(Path("/nonexistent"))


def test_with_flashinfer_carries_it_in_archives_of_their_own_and_puts_the_cute_dsl_on_the_path(packed, packed_flashinfer,
                                                                                               tmp_path):
    manifest, plain = _manifest(packed_flashinfer), _manifest(packed)
    carried = {"flashinfer-python", "nvidia-cudnn-frontend", "cuda-tile", "nvidia-cutlass-dsl",
               "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13"}
    assert plain["flashinfer"]["bundled"] is False and "flashinfer-python" in plain["dropped"]
    assert not carried & set(plain["bundled"])
    assert manifest["flashinfer"]["bundled"] and set(manifest["flashinfer"]["distributions"]) == carried
    assert {manifest["bundled"][n]["archive"] for n in carried} == {"flashinfer"}
    assert "nvidia-cutlass-dsl-libs-cu12" in manifest["dropped"] and "flashinfer-python" not in manifest["dropped"]
    for name in set(plain["archives"]) - {"project"}:  # the serving stack's archives stay the same bytes
        assert manifest["archives"][name]["sha256"] == plain["archives"][name]["sha256"], name
    stage = tmp_path / "stage"
    for part in sorted(packed_flashinfer.glob("part*")):
        assert _unpack("--part", part, "--stage", stage).returncode == 0
    done = _unpack("--finish", "--stage", stage, "--host-site", tmp_path / "no-host-site")
    assert done.returncode == 0, done.stderr
    root = stage / "root"
    assert not (root / "site" / "nvidia_cutlass_dsl" / "cu12").exists()
    assert json.loads((root / "bundle.json").read_text())["flashinfer"]["bundled"]
    # python -S: no site directory is read, as under PYTHONPATH; the .pth's folder comes from env.sh
    shell = subprocess.run(["bash", "-c", f". {root / 'env.sh'} && exec {sys.executable} -S -c "
                            "'import cutlass, flashinfer; print(cutlass.RUNTIME)'"],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert shell.stdout.split() == ["cu13"], shell.stderr

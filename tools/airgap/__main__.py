"""``python -m tools.airgap {pack,unpack,rehearse,cache}``: the pin's packages for a GPU host without network.

On a host with network, from a venv of the pin built for the GPU host's Python (3.12)::

    python -m tools.airgap pack --venv V --out B            # B/part01, B/part02, ... (55 MiB each)
    python -m tools.airgap rehearse --bundle B --stage S --image-packages I --from-venv V --python python3.12
                                                                # the import chain, on this CPU host

On the GPU host, one upload per part, then once::

    python -m tools.airgap unpack --part B/partNN --stage /tmp/dsv4-bundle
    python -m tools.airgap unpack --finish --stage /tmp/dsv4-bundle
    . /tmp/dsv4-bundle/root/env.sh

Between GPU hosts, ``cache save --out DIR`` and ``cache load DIR/jit_cache.tar.xz.*`` carry the JIT caches
(a warm cache saves minutes of kernel compiles per server start).

Then, on the GPU host, ``python -m bench.gpu_server run SET`` serves and measures (``bench/gpu_server``).

Each subcommand imports its module only when chosen: ``unpack`` runs on the GPU host's bare Python
before anything is installed, so nothing it reaches may import more than the standard library.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_STAGE = "/tmp/dsv4-bundle"


def _archs(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(a) for a in text.split(",")}))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.airgap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    pk = sub.add_parser("pack", help="make the parts for a GPU host from a venv of the pin (on a networked host)")
    pk.add_argument("--venv", type=Path, required=True, help="a venv of the pin built for the GPU host's Python")
    pk.add_argument("--out", type=Path, required=True, help="writes OUT/part01, OUT/part02, ... and OUT/manifest.json")
    pk.add_argument("--part-mb", type=float, default=55.0, help="largest part, in MiB (the upload limit); default 55")
    pk.add_argument("--arch", type=_archs, default=(90,), help="GPU architectures to keep code for, e.g. 90 or 90,120")
    pk.add_argument("--no-triton", dest="triton", action="store_false", help="leave Triton to the GPU host's image")
    pk.add_argument("--no-tilelang", dest="tilelang", action="store_false", help="leave out TileLang and z3")
    pk.add_argument("--with-pd", dest="pd", action="store_true",
                    help="also carry NIXL (CUDA 13) and the PD router, for a prefill/decode pair")
    pk.add_argument("--with-flashinfer", dest="flashinfer", action="store_true",
                    help="also carry FlashInfer (the pin's version), for speculative decoding sampled at temperature > 0")
    pk.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dsv4-gpu-bundle",
                    help="fetched wheels and compressed archives, reused by later packs")
    pk.add_argument("--xz-level", type=int, default=9, choices=range(0, 10))
    pk.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="xz threads (default 2)")

    up = sub.add_parser("unpack", help="on the GPU host: gather parts into a stage, then --finish it")
    up.add_argument("--stage", type=Path, default=Path(DEFAULT_STAGE))
    what = up.add_mutually_exclusive_group(required=True)
    what.add_argument("--part", type=Path, help="a part directory (partNN) to copy into the stage")
    what.add_argument("--finish", action="store_true", help="verify, extract and set up STAGE/root")
    up.add_argument("--cache-root", type=Path, help="JIT/Triton/TileLang caches (default STAGE/cache)")
    up.add_argument("--host-site", type=Path, help="site-packages with the host's nvidia/ CUDA libraries "
                                                     "(default: found from this Python)")
    up.add_argument("--force", action="store_true", help="with --finish: rebuild STAGE/root even if it is current")

    rh = sub.add_parser("rehearse", help="check the unpacked bundle's import chain on a CPU host")
    rh.add_argument("--stage", type=Path, required=True, help="a stage holding the bundle's chunks (see --bundle)")
    rh.add_argument("--bundle", type=Path, help="add every part of this pack --out folder to the stage first")
    rh.add_argument("--image-packages", type=Path, required=True,
                    help="a folder standing in for the GPU host image's site-packages (made with --from-venv)")
    rh.add_argument("--from-venv", type=Path, help="fill --image-packages from this venv's copies of the "
                                                   "distributions the bundle leaves to the image")
    rh.add_argument("--python", default=sys.executable, help="the interpreter to rehearse with (the bundle's)")

    jc = sub.add_parser("cache", help="carry the GPU host's JIT caches to the next host (tools/airgap/jit_cache.py)")
    jc.add_argument("action", choices=("save", "load"))
    jc.add_argument("parts", nargs="*", type=Path, help="with load, right after it: the jit_cache.tar.xz.NN files of one save")
    jc.add_argument("--cache-root", type=Path, default=None, help="default $DSV4_CACHE_ROOT or STAGE/cache")
    jc.add_argument("--out", type=Path, default=Path("."), help="with save: where the parts go")
    jc.add_argument("--part-mb", type=float, default=15.0, help="with save: largest part, in MiB; default 15")

    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "pack":
        from tools.airgap import pack

        manifest = pack.pack(args.venv, args.out, args.part_mb, args.arch, args.cache, args.xz_level, args.threads,
                             triton=args.triton, tilelang=args.tilelang, pd=args.pd,
                             flashinfer=args.flashinfer)
        pack.report(manifest, args.out)
        return 0
    if args.command == "unpack":
        from tools.airgap import bundle

        if args.part:
            return bundle.add_part(args.part, args.stage)
        return bundle.finish(args.stage, args.cache_root, args.host_site, force=args.force)
    if args.command == "cache":
        from tools.airgap import jit_cache

        root = args.cache_root or jit_cache.default_root()
        if args.action == "save":
            for part in jit_cache.save(root, args.out, args.part_mb):
                print(f"{part} {part.stat().st_size / (1 << 20):.1f} MiB")
            return 0
        if not args.parts:
            print("cache load: name the jit_cache.tar.xz.NN files", file=sys.stderr)
            return 2
        print(f"{jit_cache.load(args.parts, root)} cache files into {root}")
        return 0
    from tools.airgap import rehearse

    return rehearse.main(args.stage, args.image_packages, args.from_venv, args.python, args.bundle)


if __name__ == "__main__":
    sys.exit(main())

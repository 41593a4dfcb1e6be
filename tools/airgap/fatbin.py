"""Blank the GPU code a bundle's target GPUs can never load, so that xz squeezes it to nothing.

A CUDA library carries its device code as fat binaries (ELF sections ``.nv_fatbin`` and
``__nv_relfatbin``): one entry per GPU architecture, machine code (SASS, for sm_XY) or PTX. torch
2.14.1's ``libtorch_cuda.so`` holds 330 MB of them for eight architectures, already compressed by
nvcc, so xz cannot shrink them; an H200 (sm_90) only ever loads the sm_90 entries (55 MB).

The driver picks one entry per kernel: SASS of the device's own major version and a minor no higher
than the device's, else PTX of an architecture no higher than the device's, which it compiles. So
an entry is kept when some target could pick it, and every other entry's payload is overwritten with
zeros in place. Headers, sizes and offsets stay as they were: the file keeps its layout, the driver
still reads every header, and what it picks for a target GPU is byte for byte the original. A GPU
outside the targets that picks a blanked entry fails to load the kernel; the manifest and bundle.json
record the targets so that nobody runs a bundle on the wrong GPU.

Checked on a Hopper GPU host: with torch's, NCCL's and sgl_kernel's fat
binaries blanked to sm_90, torch 2.14.1 ran matmuls (bf16, fp32), softmax, layer norm, top-k, sort,
scatter, FFT, linalg.solve, fp8 casts, flash SDPA and a one-rank NCCL all-reduce, and sgl_kernel's
rmsnorm matched a torch reference. The packed torch shrinks from 304 MB of xz to 64 MB.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_FATBIN_MAGIC = 0xBA55ED50
SECTIONS = (".nv_fatbin", "__nv_relfatbin")
_SASS, _PTX = 2, 1


def elf_sections(buf) -> list[tuple[str, int, int]]:
    """(name, offset, size) of each section of an ELF64 little-endian image; [] for anything else."""
    if len(buf) < 64 or buf[:4] != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", buf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    if not shoff or shstrndx >= shnum:
        return []
    headers = [struct.unpack_from("<IIQQQQ", buf, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    sections = []
    for name_off, _type, _flags, _addr, offset, size in headers:
        start = strtab + name_off
        sections.append((bytes(buf[start:start + 64]).split(b"\0", 1)[0].decode("latin-1"), offset, size))
    return sections


def read_sections(path: Path) -> list[tuple[str, int, int]]:
    """The sections of ELF file ``path`` ([] when it is not one)."""
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF" or path.stat().st_size < 64:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return elf_sections(buf)


def _entries(buf, offset: int, size: int):
    """(kind, arch, payload offset, payload size) of each entry of the fat binaries in a section."""
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", buf, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned; padding sits between them
            continue
        entry, entries_end = pos + header_size, pos + header_size + fat_size
        while entry < entries_end:
            kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", buf, entry)
            arch, = struct.unpack_from("<I", buf, entry + 28)
            yield kind, arch, entry + entry_header, payload
            entry += entry_header + payload
        pos = entries_end


def usable(kind: int, arch: int, targets: tuple[int, ...]) -> bool:
    """Whether a GPU of one of ``targets`` (sm numbers: 90, 120) could load this entry."""
    if kind == _SASS:
        return any(arch // 10 == t // 10 and arch <= t for t in targets)
    return kind == _PTX and any(arch <= t for t in targets)


def prune(path: Path, targets: tuple[int, ...]) -> tuple[int, int]:
    """Zero, in place, the payloads no GPU of ``targets`` could load; returns (bytes zeroed, bytes kept)."""
    zeroed = kept = 0
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as buf:
        for name, offset, size in elf_sections(buf):
            if name not in SECTIONS:
                continue
            for kind, arch, start, length in list(_entries(buf, offset, size)):
                if usable(kind, arch, targets):
                    kept += length
                else:
                    buf[start:start + length] = bytes(length)
                    zeroed += length
        buf.flush()
    return zeroed, kept


def needed(path: Path) -> tuple[str | None, list[str]]:
    """(DT_SONAME, [DT_NEEDED...]) of ELF file ``path``: the libraries the loader must find for it."""
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF" or path.stat().st_size < 64:
            return None, []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            sections = {name: (offset, size) for name, offset, size in elf_sections(buf)}
            if ".dynamic" not in sections or ".dynstr" not in sections:
                return None, []
            (dyn, dyn_size), (strtab, _) = sections[".dynamic"], sections[".dynstr"]

            def string(at: int) -> str:
                return bytes(buf[strtab + at:strtab + at + 256]).split(b"\0", 1)[0].decode("latin-1")

            soname, libs = None, []
            for i in range(0, dyn_size - 15, 16):
                tag, value = struct.unpack_from("<qQ", buf, dyn + i)
                if tag == 0:
                    break
                if tag == 1:
                    libs.append(string(value))
                elif tag == 14:
                    soname = string(value)
            return soname, libs

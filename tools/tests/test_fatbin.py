"""Blanking other GPUs' code: on a hand-built ELF, exactly the payloads no target GPU could load turn to
zeros, and every other byte (ELF, fat-binary and entry headers, the kept payloads) stays."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tools.airgap import fatbin

SASS, PTX = 2, 1


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    body = b""
    for kind, arch, payload in entries:
        header = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(payload), 0, 0, 8, 0, arch)
        body += header + bytes(64 - len(header)) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf(path: Path, section: bytes) -> tuple[int, int]:
    """A minimal ELF64 with ``section`` as .nv_fatbin; returns the section's (offset, size)."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    data_off, names_off = 64, 64 + len(section)
    shoff = names_off + len(names)
    head = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 2)
    shdr = lambda name, typ, off, size: struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, 0, 0, 8, 0)
    path.write_bytes(head + section + names + shdr(0, 0, 0, 0) + shdr(1, 1, data_off, len(section))
                     + shdr(12, 3, names_off, len(names)))
    return data_off, len(section)


ENTRIES = [(SASS, 80, b"\x80" * 40), (SASS, 90, b"\x90" * 48), (SASS, 120, b"\x12" * 24), (PTX, 120, b"P" * 32)]


@pytest.mark.parametrize("targets, kept", [((90,), {90}), ((120,), {120, "ptx"}), ((90, 120), {90, 120, "ptx"})])
def test_prune_blanks_only_what_no_target_loads(tmp_path, targets, kept):
    # two fat binaries in one section, 8 bytes of padding between them, as nvcc lays them out
    section = _fatbin(ENTRIES[:2]) + bytes(8) + _fatbin(ENTRIES[2:])
    path = tmp_path / "lib.so"
    _elf(path, section)
    before = path.read_bytes()
    zeroed, kept_bytes = fatbin.prune(path, targets)
    after = path.read_bytes()
    assert len(after) == len(before)
    for kind, arch, payload in ENTRIES:
        start = before.index(payload)
        stays = (arch if kind == SASS else "ptx") in kept
        assert after[start:start + len(payload)] == (payload if stays else bytes(len(payload))), (kind, arch)
    assert zeroed + kept_bytes == sum(len(p) for _, _, p in ENTRIES)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert all(any(before.index(p) <= i < before.index(p) + len(p) for _, _, p in ENTRIES) for i in changed)


def test_usable_follows_the_drivers_choice():
    assert fatbin.usable(SASS, 90, (90,)) and not fatbin.usable(SASS, 80, (90,))  # SASS stays within a major
    assert fatbin.usable(SASS, 86, (89,)) and not fatbin.usable(SASS, 121, (120,))
    assert fatbin.usable(PTX, 80, (90,)) and not fatbin.usable(PTX, 100, (90,))  # PTX compiles for newer GPUs


def test_files_without_gpu_code_are_left_alone(tmp_path):
    plain = tmp_path / "plain.so"
    plain.write_bytes(b"not an ELF at all" * 10)
    assert fatbin.read_sections(plain) == [] and fatbin.prune(plain, (90,)) == (0, 0)

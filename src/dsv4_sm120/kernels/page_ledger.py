"""The integrity ledger's GPU steps, each one launch: record a backup, judge a read, find a lost key write.

Integrity mode (``index_k.integrity``) keeps, per (layer, host page), the checksum of the page row backed up
there (``expected``), whether one was recorded (``recorded``) and whether that content has been checked
since (``verified``); both flags are uint8 [layers, host pages]. Checksums are :mod:`.page_checksum`'s.

- :func:`record_pages` (at backup): for each pair (device page d_i, host page h_i) of a backup,
  ``expected[l, h_i] = checksum(rows[d_i])``, ``recorded[l, h_i] = 1``, ``verified[l, h_i] = 0``.
- :func:`check_pages` (at the C4 indexer's read): a load is given as upstream gives it, token indices of
  whole pages (page p covers indices ``[p * S, (p + 1) * S)``, S = slots per page), so page i of the load is
  ``d_i = device[i * S] // S`` and ``h_i = host[i * S] // S``. Report row i is
  ``(h_i, d_i, verdict_i, first_i)`` with ``verdict = 2`` (no checksum on record) where ``recorded`` is 0,
  else ``checksum(rows[d_i]) != expected[l, h_i]``; ``first_i = recorded & !verified`` (the content's first
  check: a distinct page); then ``verified |= recorded``.
- :func:`key_sums` and :func:`lost_keys` (a forward's key stores, rows of 256 bytes): the checksums of the keys
  at the stored slots right after the store, and at the read, per slot: -2 for no slot (negative), -1 for a
  key unchanged, else the device page of a key that changed between (a key write lost to a load).

Each step is one launch over pages (or keys), one program each, reading the page in place: upstream's host
indices and the report stay on the GPU, so no step makes the host wait, and a call costs one launch of host
time instead of the dozen tensor operations the same arithmetic takes in torch. Triton on CUDA, the torch
references elsewhere (CPU tests, and the kernels' own reference in the interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels.launch import launch
from dsv4_sm120.kernels.page_checksum import page_checksum_ref, row_checksum

BLOCK = 1024  # int32 words per checksum step (a 16 KiB page row: 4 steps)
KEY_BLOCK = 64  # a 256-byte key: one step
NUM_WARPS = 4
NO_RECORD, NO_SLOT, KEPT = 2, -2, -1


@triton.jit
def _record_kernel(rows_ptr, stride_row, row_words, dev_ptr, host_ptr, expected_ptr, recorded_ptr, verified_ptr,
                   layer_off, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    d = tl.load(dev_ptr + i).to(tl.int64)
    h = layer_off + tl.load(host_ptr + i).to(tl.int64)
    tl.store(expected_ptr + h, row_checksum(rows_ptr + d * stride_row, row_words, BLOCK))
    tl.store(recorded_ptr + h, 1)
    tl.store(verified_ptr + h, 0)


@triton.jit
def _check_kernel(rows_ptr, stride_row, row_words, dev_idx_ptr, host_idx_ptr, slots_per_page, expected_ptr,
                  recorded_ptr, verified_ptr, layer_off, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    d = tl.load(dev_idx_ptr + i * slots_per_page).to(tl.int64) // slots_per_page
    hp = tl.load(host_idx_ptr + i * slots_per_page).to(tl.int64) // slots_per_page
    h = layer_off + hp
    rec = tl.load(recorded_ptr + h).to(tl.int64)
    ver = tl.load(verified_ptr + h).to(tl.int64)
    differs = (row_checksum(rows_ptr + d * stride_row, row_words, BLOCK) != tl.load(expected_ptr + h)).to(tl.int64)
    verdict = tl.where(rec != 0, differs, 2)
    first = rec & (1 - ver)
    tl.store(verified_ptr + h, (ver | rec).to(tl.uint8))
    col = tl.arange(0, 4)
    row = tl.where(col == 0, hp, tl.where(col == 1, d, tl.where(col == 2, verdict, first)))
    tl.store(out_ptr + i * 4 + col, row)


@triton.jit
def _key_sums_kernel(keys_ptr, stride_key, key_words, slots_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.maximum(tl.load(slots_ptr + i).to(tl.int64), 0)
    tl.store(out_ptr + i, row_checksum(keys_ptr + slot * stride_key, key_words, BLOCK))


@triton.jit
def _lost_keys_kernel(keys_ptr, stride_key, key_words, slots_ptr, sums_ptr, keys_per_page, out_ptr,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    now = row_checksum(keys_ptr + tl.maximum(slot, 0) * stride_key, key_words, BLOCK)
    lost = now != tl.load(sums_ptr + i)
    tl.store(out_ptr + i, tl.where(slot < 0, -2, tl.where(lost, slot // keys_per_page, -1)))


def _words(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % 4 or rows.stride(1) != 1 or rows.stride(0) % 4:
        raise ValueError(f"ledger rows must be uint8 [N, bytes] with bytes and row stride multiples of 4; got "
                         f"{rows.dtype} {tuple(rows.shape)} strides {rows.stride()}")
    return rows.view(torch.int32)


def _use_triton(tensor: torch.Tensor, kernel: bool | None) -> bool:
    """Whether a call runs the Triton kernel: on CUDA by default, anywhere with ``kernel=True``."""
    return tensor.device.type == "cuda" if kernel is None else kernel


def record_pages(rows, device_pages, host_pages, expected, recorded, verified, layer: int, *, kernel=None) -> None:
    """Record the checksums of page rows ``rows[device_pages]`` as layer ``layer``'s backups at ``host_pages``.

    ``kernel``: None runs Triton on CUDA and the torch reference elsewhere; True runs Triton anywhere."""
    n = device_pages.shape[0]
    if not n:
        return
    if not _use_triton(rows, kernel):
        expected[layer, host_pages] = page_checksum_ref(rows.index_select(0, device_pages))
        recorded[layer, host_pages] = 1
        verified[layer, host_pages] = 0
        return
    words = _words(rows)
    launch(_record_kernel, (n,), (words, words.stride(0), words.shape[1], device_pages, host_pages, expected,
                                  recorded, verified, layer * expected.shape[1]), dict(BLOCK=BLOCK),
           num_warps=NUM_WARPS, num_stages=3)


def check_pages(rows, device_indices, host_indices, slots_per_page: int, expected, recorded, verified, layer: int,
                *, kernel=None) -> torch.Tensor:
    """The report [pages, 4] (host page, device page, verdict, first check) of layer ``layer``'s pages of one
    load as ``rows`` holds them now; marks the recorded ones verified."""
    n = device_indices.shape[0] // slots_per_page
    if not _use_triton(rows, kernel):
        host = host_indices.reshape(-1, slots_per_page)[:, 0].long() // slots_per_page
        device = device_indices.reshape(-1, slots_per_page)[:, 0].long() // slots_per_page
        rec, ver = recorded[layer, host].long(), verified[layer, host].long()
        differs = (page_checksum_ref(rows.index_select(0, device)) != expected[layer, host]).long()
        verdict = torch.where(rec != 0, differs, NO_RECORD)
        verified[layer, host] = (ver | rec).to(verified.dtype)
        return torch.stack([host, device, verdict, rec & (1 - ver)], 1)
    out = torch.empty((n, 4), dtype=torch.int64, device=rows.device)
    if n:
        words = _words(rows)
        launch(_check_kernel, (n,), (words, words.stride(0), words.shape[1], device_indices, host_indices,
                                     slots_per_page, expected, recorded, verified, layer * expected.shape[1], out),
               dict(BLOCK=BLOCK), num_warps=NUM_WARPS, num_stages=3)
    return out


def key_sums(keys: torch.Tensor, slots: torch.Tensor, *, kernel=None) -> torch.Tensor:
    """int64 [n] checksums of the key rows ``keys`` [slots, 256 B] at ``slots`` (a negative slot: row 0's)."""
    if not _use_triton(keys, kernel):
        return page_checksum_ref(keys.index_select(0, slots.long().clamp(min=0)))
    out = torch.empty(slots.shape[0], dtype=torch.int64, device=keys.device)
    if slots.shape[0]:
        words = _words(keys)
        launch(_key_sums_kernel, (slots.shape[0],), (words, words.stride(0), words.shape[1], slots, out),
               dict(BLOCK=KEY_BLOCK), num_warps=1, num_stages=1)
    return out


def lost_keys(keys: torch.Tensor, slots: torch.Tensor, sums: torch.Tensor, keys_per_page: int, *,
              kernel=None) -> torch.Tensor:
    """Per stored slot: -2 (no slot), -1 (its key as stored) or the device page of a key that changed."""
    if not _use_triton(keys, kernel):
        slots = slots.long()
        lost = key_sums(keys, slots, kernel=False) != sums
        return torch.where(slots < 0, NO_SLOT, torch.where(lost, slots // keys_per_page, KEPT))
    out = torch.empty(slots.shape[0], dtype=torch.int64, device=keys.device)
    if slots.shape[0]:
        words = _words(keys)
        launch(_lost_keys_kernel, (slots.shape[0],), (words, words.stride(0), words.shape[1], slots, sums,
                                                      keys_per_page, out), dict(BLOCK=KEY_BLOCK),
               num_warps=1, num_stages=1)
    return out

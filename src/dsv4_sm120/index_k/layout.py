"""The bf16 C4 index-K page layout: one contract shared by the pool and the kernels.

Upstream stores each compressed index key as 128 fp8 bytes plus a 4-byte fp32
scale (132 B), laid out per page as ``[64 x 128 B keys | 64 x 4 B scales]``.
The bf16 layout drops the scale section: a page row is 64 compressed slots of
128 bf16 values, 256 B each, 16384 B in all. Compressed slot ``s`` lives in
page ``s // SLOTS_PER_PAGE`` at byte offset ``(s % SLOTS_PER_PAGE) * 256`` of
that page's row.

This module imports no sglang: the Triton kernels read it on a GPU host that has
no serving stack.
"""

from __future__ import annotations

# One C4 index page = one 256-token tree page after 4:1 compression.
SLOTS_PER_PAGE = 64
INDEX_HEAD_DIM = 128
BF16_BYTES_PER_TOKEN = INDEX_HEAD_DIM * 2  # 256: 128 bf16 values, no scale
BF16_PAGE_ROW_BYTES = SLOTS_PER_PAGE * BF16_BYTES_PER_TOKEN  # 16384

# Upstream's fp8 layout, for reporting and comparison only (the pool keeps
# using upstream's own code for it): 128 fp8 keys + one fp32 scale per 128 values.
FP8_BYTES_PER_TOKEN = INDEX_HEAD_DIM + INDEX_HEAD_DIM // 128 * 4  # 132
FP8_PAGE_ROW_BYTES = SLOTS_PER_PAGE * FP8_BYTES_PER_TOKEN  # 8448

DTYPES = ("bf16", "fp8")

# Appended to upstream's PD layout string when the index keys are bf16, so a
# bf16 peer and an fp8 peer never agree on the layout. fp8 keeps upstream's string.
PD_LAYOUT_TAG_BF16 = "index_k:bf16"


def bytes_per_token(dtype: str) -> int:
    """Bytes one compressed index key occupies in the device page row."""
    return {"bf16": BF16_BYTES_PER_TOKEN, "fp8": FP8_BYTES_PER_TOKEN}[_checked(dtype)]


def page_row_bytes(dtype: str) -> int:
    """Bytes of one index-K page row (64 compressed slots)."""
    return SLOTS_PER_PAGE * bytes_per_token(dtype)


def slot_address(slot: int) -> tuple[int, int]:
    """(page, byte offset in the page row) of a compressed slot in the bf16 layout."""
    return slot // SLOTS_PER_PAGE, (slot % SLOTS_PER_PAGE) * BF16_BYTES_PER_TOKEN


def pd_layout_dtype(pd_kv_layout: str | None) -> str:
    """The index-K dtype a peer's PD layout string announces (untagged = upstream fp8)."""
    if pd_kv_layout and PD_LAYOUT_TAG_BF16 in pd_kv_layout.split(","):
        return "bf16"
    return "fp8"


def _checked(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"index-K dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype

"""The layout contract shared with the kernels: numbers, slot addressing, no sglang import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_sm120.index_k import layout


def test_contract_constants():
    assert layout.SLOTS_PER_PAGE == 64
    assert layout.INDEX_HEAD_DIM == 128
    assert layout.BF16_BYTES_PER_TOKEN == 256
    assert layout.BF16_PAGE_ROW_BYTES == 16384
    assert (layout.bytes_per_token("fp8"), layout.page_row_bytes("fp8")) == (132, 8448)
    assert (layout.bytes_per_token("bf16"), layout.page_row_bytes("bf16")) == (256, 16384)
    with pytest.raises(ValueError, match="fp4"):
        layout.bytes_per_token("fp4")


@pytest.mark.parametrize("slot, page, offset", [(0, 0, 0), (63, 0, 63 * 256), (64, 1, 0), (130, 2, 512)])
def test_slot_address(slot, page, offset):
    assert layout.slot_address(slot) == (page, offset)


def test_pd_layout_dtype():
    assert layout.pd_layout_dtype("v4,c4:v4,c128:v4,index_k:bf16") == "bf16"
    assert layout.pd_layout_dtype("v4,c4:v4,c128:v4") == "fp8"
    assert layout.pd_layout_dtype(None) == "fp8"


def test_layout_module_imports_no_sglang():
    code = "import sys, dsv4_sm120.index_k.layout; print(sorted(m for m in sys.modules if m.startswith('sglang')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"

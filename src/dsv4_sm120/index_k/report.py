"""``dsv4-sm120 doctor`` section: the index-K layout the settings in force select."""

from __future__ import annotations

from dsv4_sm120 import settings
from dsv4_sm120.doctor_rows import FAIL, OK, Row, Section
from dsv4_sm120.index_k import layout


def doctor_section() -> Section:
    try:
        dtype = settings.raw("DSV4_SM120_INDEX_K_DTYPE")
    except settings.SettingsError as exc:
        return Section("index_k", {"dtype": None, "error": str(exc)},
                       [Row("index_k", FAIL, str(exc))])
    data = {"dtype": dtype, "bytes_per_token": layout.bytes_per_token(dtype),
            "page_row_bytes": layout.page_row_bytes(dtype)}
    detail = (f"{dtype} C4 index keys under --model-impl dsv4: {data['bytes_per_token']} B/token, "
              f"{data['page_row_bytes']} B page rows")
    if dtype == "fp8":
        detail += " (upstream's layout)"
    return Section("index_k", data, [Row("index_k", OK, detail)])

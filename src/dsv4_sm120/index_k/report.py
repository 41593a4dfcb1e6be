"""``dsv4-sm120 doctor`` section: the index-K layout the settings in force select."""

from __future__ import annotations

from dsv4_sm120 import doctor, settings
from dsv4_sm120.index_k import layout


def doctor_section() -> doctor.Section:
    try:
        dtype = settings.raw("DSV4_SM120_INDEX_K_DTYPE")
    except settings.SettingsError as exc:
        return doctor.Section("index_k", {"dtype": None, "error": str(exc)},
                              [doctor.Row("index_k", doctor.FAIL, str(exc))])
    data = {"dtype": dtype, "bytes_per_token": layout.bytes_per_token(dtype),
            "page_row_bytes": layout.page_row_bytes(dtype)}
    detail = (f"{dtype} C4 index keys under --model-impl dsv4: {data['bytes_per_token']} B/token, "
              f"{data['page_row_bytes']} B page rows")
    if dtype == "fp8":
        detail += " (upstream's layout)"
    return doctor.Section("index_k", data, [doctor.Row("index_k", doctor.OK, detail)])

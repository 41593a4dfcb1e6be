"""PD handshake: a bf16-key peer and an fp8-key peer refuse to connect, and say why.

The pool's ``pd_kv_layout()`` carries ``index_k:bf16`` when the keys are bf16
(fp8 keeps upstream's string, so an fp8 server still pairs with a plain
upstream one). Upstream's decode side compares the two layouts in
``CommonKVManager.try_ensure_parallel_info`` and raises a mismatch that names
only its own knobs; this AROUND hook re-raises it, when the index-K dtypes
differ, with both layouts, both dtypes and the switch that fixes it.
"""

from __future__ import annotations

import re

from dsv4_sm120.index_k import layout

TARGET = "sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info"

_UPSTREAM_MISMATCH = re.compile(r"prefill server has kv_layout=(.*?), but decode server has kv_layout=(.*?)\. ")


class IndexKLayoutMismatch(RuntimeError):
    """Prefill and decode store C4 index keys in different dtypes."""


def explain_mismatch(prefill_layout: str | None, decode_layout: str | None) -> str | None:
    """The refusal message when the two PD layouts disagree on index-K dtype, else None."""
    prefill, decode = layout.pd_layout_dtype(prefill_layout), layout.pd_layout_dtype(decode_layout)
    if prefill == decode:
        return None
    return (
        f"PD index-K layout mismatch: the prefill server stores {prefill} C4 index keys "
        f"(kv_layout={prefill_layout}) but this decode server stores {decode} "
        f"(kv_layout={decode_layout}). Index-K pages travel with the KV pages byte for byte, "
        f"so the two cannot be paired. Set DSV4_SM120_INDEX_K_DTYPE to the same value "
        f"(bf16 or fp8) on both servers and launch both with --model-impl dsv4 "
        f"(a server without it stores fp8 keys)."
    )


def try_ensure_parallel_info(original, manager, *args, **kwargs):
    """AROUND hook: turn upstream's layout mismatch into the index-K one when that is the cause."""
    try:
        return original(manager, *args, **kwargs)
    except RuntimeError as exc:
        match = _UPSTREAM_MISMATCH.search(str(exc))
        message = match and explain_mismatch(match.group(1), match.group(2))
        if message:
            raise IndexKLayoutMismatch(message) from exc
        raise

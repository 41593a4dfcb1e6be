"""Hooks of the bf16 index-K area.

The pool builder, planner and PD handshake hooks are registered unconditionally and
decide when called, from ``--model-impl`` and the registered ``DSV4_SM120_INDEX_K_DTYPE``, whether
to act; with any other model impl or with ``fp8`` they call upstream unchanged. The
three request-failure hooks (admission, and the plain and PD prefill result) act
only once an integrity-mode host mirror exists in the process; the fourth keeps the
batch's load slot on the copy the overlap scheduler hands to result processing. Hook bodies
import upstream lazily: registering costs nothing. The PD integrity hooks (:mod:`.pd_integrity`: the
send/receive check, the decode's late-write re-reads and its hold of a failed request's pages) are registered
only when ``DSV4_SM120_INDEX_K_CHECKSUM=1``.
"""

from __future__ import annotations

from dsv4_sm120.hooks import hook
from dsv4_sm120.index_k import builder, gate, pd, pd_integrity, planner, request_fail
from dsv4_sm120.settings import Settings


def register(cfg: Settings) -> None:
    """Register the pool builder, planner, PD handshake and integrity-mode request-failure
    hooks (the HiCache strategy is registered by the pool itself, when a bf16 pool is built); their bodies
    decide from ``cfg``, kept in :mod:`.gate`."""
    gate.use(cfg)
    hook(builder.TARGET, builder.build_dsv4_kv_pool)
    hook(planner.TARGET, planner.indexer_bytes_per_token)
    hook(pd.TARGET, pd.try_ensure_parallel_info)
    hook(request_fail.TARGET, request_fail.get_new_batch_prefill)
    for target in request_fail.RESULT_TARGETS:
        hook(target, request_fail.process_prefill_result)
    hook(request_fail.COPY_TARGET, request_fail.keep_load_slot)
    if cfg.index_k_checksum:
        # The PD send/receive check: with the switch off nothing is hooked (no extra frame).
        pd_integrity.register_hooks()

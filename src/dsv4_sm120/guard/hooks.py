"""Hooks of the collective-guard area: a loud startup warning when the guard is not in the code,
and the transfer polls' MIN-reduction through the guard's shared memory.

The guard itself is a patch (``dsv4-sm120 patch apply``), not a hook; nothing
here can turn it on. What a hook can do is notice, when a PD scheduler builds
its disaggregation state, that the loaded loop modules lack the guard call,
and say so where operators look, instead of letting the deadlock wait for the
next mass abort. The poll hook (``poll_reduce``) acts only on groups the guard
itself set up, so without the patch it never changes anything.
"""

from __future__ import annotations

import logging

from dsv4_sm120.hooks import hook
from dsv4_sm120.settings import Settings

logger = logging.getLogger("dsv4_sm120.guard")

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_disaggregation"


def register(cfg: Settings) -> None:
    """With the guard on: the startup check and the shared-memory poll reduction; off: nothing."""
    if cfg.collective_guard:
        from dsv4_sm120.guard import poll_reduce  # numpy and torch.distributed: only when the guard is on

        hook(TARGET, warn_if_unpatched)
        hook(poll_reduce.TARGET, poll_reduce.all_reduce_polls)


def warn_if_unpatched(result, scheduler, *args, **kwargs):
    """AFTER ``init_disaggregation``: warn when a PD scheduler runs the unguarded upstream loops."""
    from dsv4_sm120 import patching

    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
    if mode in ("prefill", "decode") and patching.applied_in_process() is not True:
        logger.warning(
            "\n%s\ndsv4-sm120: the PD collective guard is NOT applied to this sglang (%s scheduler, TP rank %s).\n"
            "A mass abort can leave TP ranks in different collectives and hang this engine with /health still OK.\n"
            "Fix: stop the server, run `dsv4-sm120 patch apply`, restart. Check with `dsv4-sm120 patch check "
            "--require-applied` or `dsv4-sm120 doctor`. Silence: DSV4_SM120_COLLECTIVE_GUARD=0.\n%s",
            "!" * 100, mode, getattr(scheduler, "tp_rank", "?"), "!" * 100,
        )
    return result

"""Hooks of the collective-guard area: a loud startup warning when the guard is not in the code,
the later agreements of an iteration, and the transfer polls' MIN-reduction through shared memory.

The guard's per-iteration call is a patch (``dsv4-sm120 patch apply``), not a hook: no hook
reaches a loop body. What hooks can do: notice, when a PD scheduler builds its disaggregation
state, that the loaded loop modules lack the guard call, and say so where operators look instead
of letting the deadlock wait for the next mass abort; agree on each queue right before its
conditional poll (``queue_check``) and on the formed batch right before the loop's ``if batch:``
(``batch_check``); and MIN-reduce polls through the guard's shared memory (``poll_reduce``).

The last three have nothing to agree on without TP (or CP) peers, so they are put on only in a
scheduler that has peers: plugins load before a scheduler knows its ranks, so the startup hook
registers and applies them through upstream's ``HookRegistry`` once ``init_disaggregation`` is done
(the scheduler's groups exist by then, and the loop has not started). At one rank the loop calls
upstream's methods with nothing in between: those hooks ran on every iteration, idle ones
included, and took 0.5-1.3% of a TP=1 PD pair's scheduler loops on a Hopper GPU to step aside.
With peers they act only on schedulers the patched loop's call set up, so without the patch they
never change anything.
"""

from __future__ import annotations

import logging

from dsv4_sm120.hooks import hook
from dsv4_sm120.settings import Settings

logger = logging.getLogger("dsv4_sm120.guard")

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_disaggregation"


def register(cfg: Settings) -> None:
    """With the guard on: the startup hook (the warning; the peers' hooks where there are peers); off: nothing."""
    if cfg.collective_guard:
        hook(TARGET, on_scheduler_start)


def on_scheduler_start(result, scheduler, *args, **kwargs):
    """AFTER ``init_disaggregation``: warn when a PD scheduler runs the unguarded loops; put the hooks that agree
    with the TP peers on when this PD scheduler has peers."""
    from dsv4_sm120.guard import consensus

    warn_if_unpatched(result, scheduler)
    mode = _mode(scheduler)
    if mode in ("prefill", "decode") and consensus.groups_of(scheduler):
        apply_peer_hooks()
        logger.info("dsv4-sm120 guard: %s scheduler with TP/CP peers: the agreements before each poll and on the "
                    "formed batch are on", mode)
    return result


def _mode(scheduler) -> str:
    """The scheduler's disaggregation mode: ``prefill``, ``decode`` or ``null``."""
    return getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")


_peer_hooks_registered = False


def apply_peer_hooks() -> None:
    """Register (once a process) and apply the agreements before each queue's poll and on the formed batch, and
    the polls' shared-memory MIN-reduction."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_sm120.guard import batch_check, poll_reduce, queue_check  # numpy and torch.distributed

    global _peer_hooks_registered
    if not _peer_hooks_registered:
        _peer_hooks_registered = True
        hook(poll_reduce.TARGET, poll_reduce.all_reduce_polls)
        for target, (queue, on_queue_object) in queue_check.TARGETS.items():
            hook(target, queue_check.hook_for(queue, on_queue_object))
        hook(batch_check.PREFILL_TARGET, batch_check.check_prefill_batch)
        hook(batch_check.DECODE_TARGET, batch_check.check_decode_batch)
    HookRegistry.apply_hooks()  # the targets not applied yet: these


def warn_if_unpatched(result, scheduler, *args, **kwargs):
    """Warn when a PD scheduler runs the unguarded upstream loops (at ``init_disaggregation``'s end)."""
    from dsv4_sm120 import patching
    from dsv4_sm120.guard import loop_guard

    mode = _mode(scheduler)
    if mode in ("prefill", "decode") and patching.applied_in_process() is not True:
        logger.warning(
            "\n%s\ndsv4-sm120: the PD collective guard is NOT applied to this sglang (%s scheduler, TP rank %s).\n"
            "A mass abort can leave TP ranks in different collectives and hang this engine with /health still OK.\n"
            "Fix: stop the server, run `dsv4-sm120 patch apply`, restart. Check with `dsv4-sm120 patch check "
            "--require-applied` or `dsv4-sm120 doctor`. Silence: DSV4_SM120_COLLECTIVE_GUARD=0.\n%s",
            "!" * 100, mode, loop_guard.tp_rank_of(scheduler), "!" * 100,
        )
    return result

"""Runtime of the PD-loop collective guard that ``patches/`` call into.

Upstream's PD loops decide rank-locally which collectives an iteration issues (polls are skipped
on an empty queue, a batch runs or ``on_idle`` does). After a mass abort the TP ranks' queues can
differ and the ranks enter different collective sequences: a silent hang. The patched loops call
:func:`dsv4_sm120.guard.loop_guard.check_iteration` once per iteration, before the first such
collective; it makes the ranks agree, reconciles, or fails fast. Later in the same iteration,
hooks agree again right before each poll whose queue may have changed (``queue_check``) and on the
formed batch right before the forward (``batch_check``).
"""

"""Test-only sglang plugin: what the pinned sglang 0.5.23 needs to serve a PD pair on a CPU-only machine.

Loaded through the same ``sglang.srt.plugins`` entry point as dsv4-sm120, in
every sglang process of the e2e suite, and only there (it is installed in the
suite's own virtual environment, never in the wheel). Each hook acts only when
the server runs with ``--device cpu`` and names the upstream code it works around:

* ``NixlKVManager.__init__`` (``disaggregation/nixl/conn.py``): the KV buffers'
  NIXL memory kind defaults to "VRAM" (``_normalize_kv_mem_kinds``; ``decode.py``
  ~L629 hard-codes it), and UCX refuses to register host memory as VRAM. On CPU
  the buffers are host memory, so they are relabelled "DRAM".
* ``SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk``
  (``disaggregation/prefill.py`` ~L1495): under the overlap scheduler it records a
  ``torch.cuda.Event`` on the forward stream so the transfer worker waits for the
  previous forward's writes. There is no CUDA on CPU, and a CPU forward has
  finished writing when the scheduler thread gets here, so the call runs as it
  does without overlap. The overlap loops themselves (the ones dsv4-sm120 patches)
  still run.

``faults`` is not an adapter but the suite's fault injector (``Scheduler.init_disaggregation``
AFTER, ``Scheduler.process_input_requests`` AROUND): with ``DSV4_E2E_FAULT_DIR`` set, a prefill
scheduler kills its own NIXL threads, or TP rank 1 forgets a request, on request.

The other adapters are not hooks: ``common_ops`` (beside this package) stands in
for sgl_kernel's CUDA-built extension, and the e2e fixtures set the environment
(``SGLANG_USE_CPU_ENGINE=1``, ``SGLANG_NCCL_SO_PATH``, ``SGLANG_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

_NIXL_INIT = "sglang.srt.disaggregation.nixl.conn.NixlKVManager.__init__"
_EARLY_SEND = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk"


def _host_memory_is_dram(mgr, *args, **kwargs):
    """BEFORE ``NixlKVManager.__init__(args, disaggregation_mode, server_args, ...)``: CPU KV buffers are DRAM."""
    kv_args = args[0] if args else kwargs["args"]
    server_args = args[2] if len(args) > 2 else kwargs["server_args"]
    if server_args.device == "cpu":
        kv_args.kv_data_mem_kinds = ["DRAM"] * len(kv_args.kv_data_ptrs)
    return None


def _early_send_without_cuda_event(original, scheduler, *args, **kwargs):
    """AROUND ``maybe_send_cached_prefix_chunk``: no CUDA event to record on a CPU forward stream."""
    if scheduler.device != "cpu" or not scheduler.enable_overlap:
        return original(scheduler, *args, **kwargs)
    scheduler.enable_overlap = False
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.enable_overlap = True


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_NIXL_INIT, _host_memory_is_dram, HookType.BEFORE)
    HookRegistry.register(_EARLY_SEND, _early_send_without_cuda_event, HookType.AROUND)
    from dsv4_cpu_testkit import faults

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.init_disaggregation", faults.start_watcher,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.process_input_requests", faults.drop_on_rank1,
                          HookType.AROUND)

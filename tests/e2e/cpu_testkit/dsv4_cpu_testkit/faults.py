"""Fault injection into a running prefill scheduler, from the test side (test infrastructure, never shipped).

The liveness scenario needs a NIXL bootstrap thread or transfer worker that
dies inside a real server, without any test hook in dsv4-sm120 itself. When the
e2e suite sets ``DSV4_E2E_FAULT_DIR``, each PD scheduler process of the set runs
this watcher; the test drops a file there to ask for a fault:

* ``kill-bootstrap-thread``: raise ``SystemExit`` inside the NIXL prefill
  bootstrap thread (the hardened one or the pin's closure, found by name or
  target), as an unexpected error would;
* ``kill-transfer-worker``: the same inside transfer worker 0; a wake-up item
  is put on its queue so the exception lands at once, before the item is read.

* ``drop-next-request``: a rank-local divergence for the collective-guard
  scenario. On TP rank 1 only (of the server the file names: ``prefill`` or
  ``decode``), the next generate request that the scheduler
  loop receives is taken out of that rank's PD queue right after the loop
  ingested it (every rank got it from the broadcast; rank 1 forgets it), as a
  rank-local abort would. This one runs inside the scheduler thread, from an
  AROUND hook on ``Scheduler.process_input_requests``, so it never races the loop.

The exception is raised with ``PyThreadState_SetAsyncExc``: it lands when the
thread next runs Python code. The watcher answers with ``<name>.done`` holding
what it did.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

_started = False


def _raise_in(thread: threading.Thread) -> None:
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))
    if n != 1:
        raise RuntimeError(f"PyThreadState_SetAsyncExc hit {n} threads for {thread.name}")


def _target_name(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    return getattr(target, "__name__", "") if target is not None else ""


def _bootstrap_thread() -> threading.Thread:
    for t in threading.enumerate():
        if t.name.startswith("dsv4-nixl-bootstrap") or _target_name(t) == "bootstrap_thread_guarded":
            return t
    raise LookupError("no NIXL prefill bootstrap thread in this process")


def _kill_transfer_worker(scheduler) -> str:
    workers = [t for t in threading.enumerate() if _target_name(t) == "transfer_worker" and getattr(t, "_args", ())]
    worker = next((t for t in workers if t._args[-1] == 0), None)
    if worker is None:
        raise LookupError(f"no transfer worker 0 among {[t.name for t in threading.enumerate()]}")
    _raise_in(worker)
    worker._args[0].put(None)  # wakes the worker from queue.get(); the exception lands before it reads the item
    return f"SystemExit raised in transfer worker 0 ({worker.name})"


def _serve(scheduler, fault_dir: Path) -> None:
    while True:
        for name in ("kill-bootstrap-thread", "kill-transfer-worker"):
            ask = fault_dir / name
            if not ask.exists():
                continue
            ask.unlink()
            try:
                if name == "kill-bootstrap-thread":
                    thread = _bootstrap_thread()
                    _raise_in(thread)
                    done = f"SystemExit raised in {thread.name}"
                else:
                    done = _kill_transfer_worker(scheduler)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
                done = f"FAILED: {type(exc).__name__}: {exc}"
            (fault_dir / f"{name}.done").write_text(done)
        time.sleep(0.3)


def start_watcher(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.init_disaggregation``: the prefill scheduler watches the fault folder, if one is set."""
    global _started
    fault_dir = os.environ.get("DSV4_E2E_FAULT_DIR")
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
    if fault_dir and mode == "prefill" and not _started:
        _started = True
        threading.Thread(target=_serve, args=(scheduler, Path(fault_dir)), name="e2e-fault-injector",
                         daemon=True).start()
    return result


def drop_on_rank1(original, scheduler, recv_reqs, *args, **kwargs):
    """AROUND ``Scheduler.process_input_requests``: on request, rank 1 forgets the request it just ingested."""
    result = original(scheduler, recv_reqs, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel  # the pin's Scheduler keeps no tp_rank attribute

    fault_dir = os.environ.get("DSV4_E2E_FAULT_DIR")
    if not fault_dir or get_parallel().tp_rank != 1:
        return result
    ask = Path(fault_dir) / "drop-next-request"
    try:
        role = ask.read_text().strip()
    except FileNotFoundError:
        return result
    if role and role != getattr(getattr(scheduler, "disaggregation_mode", None), "value", None):
        return result
    rids = {getattr(r, "rid", None) for r in recv_reqs or ()} - {None}
    queue = scheduler.disagg_prefill_bootstrap_queue or scheduler.disagg_decode_prealloc_queue
    held = [r for r in getattr(queue, "queue", []) if getattr(getattr(r, "req", r), "rid", None) in rids]
    dropped = [r for r in held if not str(getattr(getattr(r, "req", r), "rid", "")).startswith("HEALTH_CHECK")]
    if dropped:
        queue.queue.remove(dropped[0])
        ask.unlink()
        rid = getattr(getattr(dropped[0], "req", dropped[0]), "rid", "?")
        (Path(fault_dir) / "drop-next-request.done").write_text(f"rank 1 dropped {rid} from {type(queue).__name__}")
    return result

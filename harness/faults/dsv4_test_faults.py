"""Test-only faults for the GPU HiCache controls, loaded by sglang as a plugin of its own.

This folder goes on a control server's ``PYTHONPATH`` (``harness.faults.pythonpath``, for
``bench/gpu_server/hicache.py`` and ``abort_safety.py``); its dist-info registers :func:`register` in the
``sglang.srt.plugins`` group, so every process of that server loads it beside the package. Nothing here is
in the wheel and no product switch reaches it; ``DSV4_TEST_FAULT`` picks the fault:

- ``plant_one_page``: after upstream's copy kernel has loaded a bf16 index-K layer back from host (and
  before the C4 indexer reads it), one byte of one loaded page is flipped, once per process: the
  integrity mode must count it at the read, name the page and layer, quarantine the page and fail its request.
- ``fence_off``: the package's bf16 index-K accessors stop waiting for the layer's HiCache load to land
  (upstream's own accessors of that layer are left as they are), to show what upstream's ordering gives
  without the package's fence.
- ``slow_send`` (a PD prefill): one KV send in ``DSV4_TEST_FAULT_SEND_EVERY`` (default 3) is posted
  ``DSV4_TEST_FAULT_SEND_DELAY_S`` (default 1.5) late, in the transfer worker, as a busy transport posts
  it: a room the decode aborts in that window still has its write on the way. A run changes both while the
  server serves through the file ``DSV4_TEST_FAULT_SEND_CONTROL`` names: while it exists, its ``every delay_s``
  stand for the variables.
- ``fence_off_all``: the same, and upstream's own per-layer wait too (``wait_layer_transfer`` of the
  DeepSeek-V4 pool, which its compressor-state and KV accessors take before the C4 indexer reads a layer):
  nothing orders a forward after the loads it reads, the race the fence exists for.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("dsv4_test_faults")
PLANT_AFTER_LOADS = 20  # after the storm's first load-backs
PLANT_LAYER = 1  # the host pool's local layer index of the page to corrupt
PLANT_BYTE = 1000


def _plant_one_page() -> None:
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    original = DeepSeekV4PagedHostPool.load_to_device_per_layer
    state = {"loads": 0, "planted": False}

    def load_then_flip(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs):
        original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
        if getattr(self, "index_k_ledger", None) is None or layer_id != PLANT_LAYER or state["planted"]:
            return
        if not self._has_transfer_indices(host_indices, device_indices):
            return
        state["loads"] += 1
        if state["loads"] < PLANT_AFTER_LOADS:
            return
        device_page = int(self._to_page_indices(device_indices)[0])
        rows = self.device_buffers[layer_id]
        rows[device_page, PLANT_BYTE] = rows[device_page, PLANT_BYTE] ^ 0x40  # on the load's stream, after the copy
        state["planted"] = True
        logger.error("dsv4_test_faults: flipped byte %d of device page %d, layer %d, after its load",
                     PLANT_BYTE, device_page, layer_id)

    DeepSeekV4PagedHostPool.load_to_device_per_layer = load_then_flip


def _fence_off() -> None:
    from dsv4_sm120.index_k.pool import DSV4SM120TokenToKVPool

    def pages_bf16(self, layer_id):
        pool, local = self._bf16_index_pool(layer_id)
        return pool.pages_bf16(local)

    def set_bf16(self, layer_id, slot_indices, keys):
        pool, local = self._bf16_index_pool(layer_id)
        pool.write_slots(local, slot_indices, keys)

    DSV4SM120TokenToKVPool.index_k_pages_bf16 = pages_bf16
    DSV4SM120TokenToKVPool.set_index_k_bf16 = set_bf16


def _fence_off_all() -> None:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    _fence_off()
    DeepSeekV4TokenToKVPool.wait_layer_transfer = lambda self, layer_id: None


def _slow_send() -> None:
    import itertools
    import time

    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    every = int(os.environ.get("DSV4_TEST_FAULT_SEND_EVERY", "3"))
    delay_s = float(os.environ.get("DSV4_TEST_FAULT_SEND_DELAY_S", "1.5"))
    control = os.environ.get("DSV4_TEST_FAULT_SEND_CONTROL", "")
    original = NixlKVManager.send_kvcache
    calls = itertools.count()

    def knobs() -> tuple[int, float]:
        try:
            with open(control) as f:
                e, d = f.read().split()
            return int(e), float(d)
        except (OSError, ValueError):  # no file (or none named): the variables
            return every, delay_s

    def send_late(self, *args, **kwargs):
        e, d = knobs()
        if next(calls) % e == 0:
            time.sleep(d)
        return original(self, *args, **kwargs)

    NixlKVManager.send_kvcache = send_late
    logger.error("dsv4_test_faults: one NIXL KV send in %d is posted %.1f s late", every, delay_s)


FAULTS = {"plant_one_page": _plant_one_page, "fence_off": _fence_off, "fence_off_all": _fence_off_all,
          "slow_send": _slow_send}


def register() -> None:
    fault = os.environ.get("DSV4_TEST_FAULT", "")
    if fault in FAULTS:
        FAULTS[fault]()
    elif fault:
        raise ValueError(f"DSV4_TEST_FAULT={fault!r}: expected one of {sorted(FAULTS)}")

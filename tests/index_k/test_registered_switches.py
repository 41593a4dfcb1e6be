"""The index-K hooks decide from the settings ``plugin.register`` loaded once, never from the environment again.

The area is registered with one set of switches, then the environment says the opposite and
``settings.load`` / ``settings.raw`` fail if called: the planner, the pool and the HiCache mirror still
follow the registered switches (the PD integrity state: ``test_pd_integrity.py``; the model class:
``tests/kernels/model_build.py`` hands it its switches the same way).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.index_k import pool_harness


def _read_again(*args):
    raise AssertionError("a hook read the DSV4_SM120_* environment again after plugin.register")


@pytest.mark.parametrize("dtype, checksum", [("bf16", True), ("fp8", False)])
def test_hooks_follow_the_registered_switches_not_a_later_environment(checkpoint, hooked, monkeypatch,
                                                                       dtype, checksum):
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    from dsv4_sm120 import settings
    from dsv4_sm120.index_k import gate, hooks, pd_integrity

    monkeypatch.setattr(gate, "_switches", gate._switches)  # restored after the test
    monkeypatch.setattr(hooks, "hook", lambda target, fn: None)  # the session's hooks are applied already
    monkeypatch.setattr(pd_integrity, "register_hooks", lambda: None)
    hooks.register(dataclasses.replace(settings.load(), index_k_dtype=dtype, index_k_checksum=checksum))
    monkeypatch.setenv("DSV4_SM120_INDEX_K_DTYPE", "fp8" if dtype == "bf16" else "bf16")
    monkeypatch.setenv("DSV4_SM120_INDEX_K_CHECKSUM", "0" if checksum else "1")
    monkeypatch.setattr(settings, "load", _read_again)
    monkeypatch.setattr(settings, "raw", _read_again)

    planner = create_memory_pool_configurator(pool_harness.configurator(checkpoint, "dsv4"))
    assert planner.indexer_bytes_per_token == (256 if dtype == "bf16" else 132)
    result, stack, _ = pool_harness.build_stack(checkpoint, "layer_first", monkeypatch)
    assert result.token_to_kv_pool.index_k_dtype == dtype
    host = stack.host_pool_group.get_pool(PoolName.DEEPSEEK_V4_C4_INDEXER)
    assert (getattr(host, "index_k_ledger", None) is not None) is checksum

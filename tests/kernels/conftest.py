"""Kernel tests run the real Triton kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be in force before ``triton.language`` is first imported,
so ``tests/conftest.py`` sets it for the whole session on hosts without CUDA; the
AOT compile tests run in subprocesses without it.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest

KERNEL_MODULES = ("_common", "layout", "index_k_store", "index_query", "query_store", "mqa_logits", "page_checksum", "page_ledger", "page_copy",
                  "two_stage_logits")


@pytest.fixture(scope="session")
def kern() -> SimpleNamespace:
    """The kernel modules as decorated in this session (interpreted on a CPU-only host)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tests run on hosts without CUDA; on a GPU use -m gpu")
    return SimpleNamespace(**{n: importlib.import_module(f"dsv4_sm120.kernels.{n}") for n in KERNEL_MODULES})


@pytest.fixture(scope="session")
def kv(tmp_path_factory, kern):
    """The real DSV4 pool with bf16 index keys, built on the CPU by the memory area's harness."""
    from tests.index_k import pool_harness

    pool_harness.apply_index_k_hooks()
    ckpt = pool_harness.tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with pytest.MonkeyPatch.context() as mp:
        pool_harness.switches(mp, index_k_dtype="bf16")
        return pool_harness.build(ckpt, "dsv4").token_to_kv_pool

"""One sglang import per test process: the hooks are applied once, pools are built on demand."""

from __future__ import annotations

import pytest

import pool_harness


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return pool_harness.tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def hooked():
    """This area's hooks, applied through upstream's HookRegistry (as load_plugins does)."""
    pool_harness.apply_index_k_hooks()


@pytest.fixture(scope="session")
def built(checkpoint, hooked):
    """``built(model_impl, dtype)``: a real configure() result, cached per combination."""
    import os

    cache = {}

    def build(model_impl: str, dtype: str):
        if (model_impl, dtype) not in cache:
            old = os.environ.get("DSV4_SM120_INDEX_K_DTYPE")
            os.environ["DSV4_SM120_INDEX_K_DTYPE"] = dtype
            try:
                cache[model_impl, dtype] = pool_harness.build(checkpoint, model_impl)
            finally:
                if old is None:
                    os.environ.pop("DSV4_SM120_INDEX_K_DTYPE")
                else:
                    os.environ["DSV4_SM120_INDEX_K_DTYPE"] = old
        return cache[model_impl, dtype]

    return build

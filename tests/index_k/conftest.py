"""One sglang import per test process: the hooks are applied once, pools are built on demand."""

from __future__ import annotations

import pytest

from tests.index_k import pool_harness


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
    cache = {}

    def build(model_impl: str, dtype: str):
        if (model_impl, dtype) not in cache:
            with pytest.MonkeyPatch.context() as mp:
                pool_harness.switches(mp, index_k_dtype=dtype)
                cache[model_impl, dtype] = pool_harness.build(checkpoint, model_impl)
        return cache[model_impl, dtype]

    return build


@pytest.fixture(scope="session")
def stacks(checkpoint, hooked):
    """``stacks(layout, dtype, checksum)``: (configure() result, StackBuildResult, strategy), cached.

    The HiCache stack as upstream's strategy registry builds it on the real pool;
    ``cudaHostRegister`` is replaced (it needs a CUDA driver), so host pinning is off.
    """
    cache = {}

    def get(layout, dtype="bf16", checksum=False):
        if (layout, dtype, checksum) not in cache:
            with pytest.MonkeyPatch.context() as mp:
                pool_harness.switches(mp, index_k_dtype=dtype, index_k_checksum=checksum)
                cache[layout, dtype, checksum] = pool_harness.build_stack(checkpoint, layout, mp)
        return cache[layout, dtype, checksum]

    return get

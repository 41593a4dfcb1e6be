"""Kernel tests run the real Triton kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be in force when ``@triton.jit`` decorates a kernel,
so the ``kern`` fixture sets it and (re)imports the kernel modules; the AOT
compile tests run in subprocesses without it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest

KERNEL_MODULES = ("_common", "layout", "index_k_store", "index_query", "mqa_logits", "page_checksum", "page_copy")


def interpreted_kernels() -> SimpleNamespace:
    os.environ["TRITON_INTERPRET"] = "1"
    mods = {}
    for name in KERNEL_MODULES:
        full = f"dsv4_sm120.kernels.{name}"
        mod = sys.modules.get(full)
        mods[name] = importlib.reload(mod) if mod is not None else importlib.import_module(full)
    return SimpleNamespace(**mods)


@pytest.fixture(scope="session")
def kern():
    return interpreted_kernels()

"""The GPU sets' CPU tests see no JIT cache but one of their own.

The ``agents`` and ``hicache`` sets look at the cache root after each measured stretch
(``tools.airgap.jit_cache.compiled_since``) and repeat a stretch that met a compile: the caches of the machine the
tests run on must not decide what a test sees.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_jit_cache_root(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE_ROOT", str(tmp_path_factory.mktemp("jit-cache-root")))

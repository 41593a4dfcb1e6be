"""Make upstream's DSV4 pool builder build :class:`~.pool.DSV4SM120TokenToKVPool`.

``KVCacheConfigurator._build_dsv4_kv_pool`` names the pool class through its
module's global ``DeepSeekV4TokenToKVPool`` and offers no override point. A
class REPLACE hook would swap the class in every module (and break other
subclasses' ``isinstance`` checks), so this AROUND hook binds the package's
subclass to that one module name only for the duration of a ``--model-impl
dsv4`` build, and restores upstream's class afterwards, also on error.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from dsv4_sm120.settings import is_dsv4_impl

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsv4_kv_pool"
POOL_NAME = "DeepSeekV4TokenToKVPool"

_lock = threading.Lock()


@contextmanager
def _pool_class_bound(module, cls):
    with _lock:
        upstream = getattr(module, POOL_NAME)
        setattr(module, POOL_NAME, cls)
        try:
            yield
        finally:
            setattr(module, POOL_NAME, upstream)


def build_dsv4_kv_pool(original, configurator, *args, **kwargs):
    """AROUND hook: under ``--model-impl dsv4`` the built pool is the package's subclass."""
    if not is_dsv4_impl(configurator.model_config.model_impl):
        return original(configurator, *args, **kwargs)
    from sglang.srt.mem_cache import kv_cache_configurator

    from dsv4_sm120.index_k.pool import DSV4SM120TokenToKVPool

    with _pool_class_bound(kv_cache_configurator, DSV4SM120TokenToKVPool):
        return original(configurator, *args, **kwargs)

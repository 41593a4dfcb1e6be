"""Stand-ins for packages of the pin that cannot load on the H200 image and that no top-k transform runs.

On a CUDA host, sglang 0.5.23 imports ``sgl_kernel`` (the sglang-kernel 0.4.10 wheel: ahead-of-time CUDA
ops, 1.2 GB, built against torch 2.14) at module level along the import chain to its DSV4 indexer
(quantization schemes, layers). The H200 image has torch 2.11 and no sglang, and 1.2 GB is a lot to move to an
air-gapped host for a module nothing calls. The transforms under test never call it: ``sgl-kernel`` v1/v2 are JIT kernels of
``sglang/kernels/jit`` (tvm-ffi + nvcc, despite the backend's name) and flashinfer's are flashinfer JIT
kernels. Every name of a stand-in is a placeholder that raises when called, so a top-k path that did
reach one fails loudly instead of passing.

Used only where the real package is missing (``install_missing``); on a host with the package the real
one loads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STANDIN_PACKAGES = ("sgl_kernel", "deep_gemm")


class Absent:
    """Any name of a stand-in package: attribute access gives another, calling raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "Absent":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a test stand-in (harness/topk_standins.py); it cannot run here")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class StandinModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self.__name__}.{attr}")


class StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``pkg`` and every ``pkg.sub`` of the given packages as a :class:`StandinModule`."""

    def __init__(self, packages):
        self.packages = tuple(packages)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_missing(packages=STANDIN_PACKAGES) -> tuple[str, ...]:
    """Put stand-ins in for those of ``packages`` that are not installed; returns their names."""
    missing = tuple(p for p in packages if p not in sys.modules and importlib.util.find_spec(p) is None)
    if missing:
        sys.meta_path.append(StandinFinder(missing))
    return missing

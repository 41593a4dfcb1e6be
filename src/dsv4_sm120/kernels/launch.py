"""Kernel launches that skip Triton's per-call dispatch once a specialization has been launched.

``kernel[grid](...)`` binds every argument, specializes each one, turns the result into a string key and
looks the compiled kernel up, on every call. For the indexer's logits kernel (28 parameters) that is part of
the ~40 us an eager call spent on the host beyond its kernel on the H200 (issue 24: 0.057 ms eager with the
split count given, 0.018 ms in a CUDA graph), paid per C4 layer per step; bench/indexer_h200.py's eager table
times both launch paths. :func:`launch` keeps the
``CompiledKernel`` that Triton's own launch returned, keyed by kernel, device, launch options and the
argument specialization (:func:`specialization_key`), and hands later launches of that key straight to it,
the call ``JITFunction.run`` makes after its lookup (same launcher arguments, same launch hooks).

It does so only where that call is known: Triton 3.6 and 3.8 (the GPU image's and the pin's, whose
``runtime/jit.py`` and ``compiler/compiler.py`` were read for it), a real GPU (the interpreter always takes
Triton's path), a kernel without pre-run hooks or module globals that Triton would re-check. Every first
launch of a key goes through ``kernel[grid](...)``, so compiling, Triton's caches and its errors are Triton's.
Triton's debug and instrumentation knobs come from the environment and are taken as fixed once a kernel ran.
"""

from __future__ import annotations

import operator

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver

from dsv4_sm120.kernels._common import interpreting

_READ_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2]) in ((3, 6), (3, 8))
DIRECT = _READ_TRITON and not interpreting()  # bench/indexer_h200.py turns it off to time Triton's own dispatch
_LAUNCHES: dict = {}  # (id(kernel), device, num_warps, num_stages, specialization_key) -> CompiledKernel
_PLANS: dict = {}  # id(kernel) -> (kernel, constexpr getter, runtime parameters); by id: hashing a kernel locks


def _plan(kernel) -> tuple:
    """The constexprs' positions (one itemgetter) and each runtime parameter's (position, specialize, align)."""
    entry = _PLANS.get(id(kernel))
    if entry is None:
        const = [p.num for p in kernel.params if p.is_constexpr]
        runtime = tuple((p.num, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                        for p in kernel.params if not p.is_constexpr)
        entry = _PLANS[id(kernel)] = (kernel, operator.itemgetter(*const) if const else lambda args: (), runtime)
    return entry


def _arg_key(value, specialize: bool, align: bool):
    """Triton's specialization of one unannotated runtime argument, as ``native_specialize_impl``
    (python/src/specialize.cc: handle_tensor, handle_bool_type, handle_long_type, handle_float_type) makes it
    for the binder that ``create_function_from_signature`` (runtime/jit.py) builds: a tensor by dtype and a
    16-byte aligned address; an int equal to 1 becomes a constant, any other is told by i32 / i64 / u64 range
    and divisibility by 16; bools and floats by type only. ``do_not_specialize`` drops the value's part,
    ``do_not_specialize_on_alignment`` the divisibility."""
    if type(value) is int:  # the common case first (a bool is an int, but not of type int)
        if specialize and value == 1:
            return 1
        width = 32 if -(1 << 31) <= value < (1 << 31) else 64 if -(1 << 63) <= value < (1 << 63) else 65
        return width, specialize and align and value & 15 == 0
    if isinstance(value, torch.Tensor):
        return value.dtype, specialize and align and value.data_ptr() & 15 == 0
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return _arg_key(int(value), specialize, align)
    if isinstance(value, float):
        return float
    raise TypeError(f"no specialization rule for a {type(value).__name__} kernel argument")


def specialization_key(kernel, args) -> tuple:
    """A key that tells apart exactly the launches Triton's JIT compiles apart: ``args`` are all of the
    kernel's parameters in order; constexprs are keyed by value. Needs a ``JITFunction`` (not the interpreter's)."""
    _, constexprs, runtime = _plan(kernel)
    return constexprs(args), tuple([_arg_key(args[i], specialize, align) for i, specialize, align in runtime])


def all_args(kernel, args: tuple, constexprs: dict) -> tuple:
    """Every parameter's value in order, as Triton's binder hands them to the launcher."""
    return (*args, *[constexprs[name] for name in kernel.arg_names[len(args):]])


def launch(kernel, grid, args, constexprs: dict, *, num_warps: int, num_stages: int) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``; ``args`` are the runtime
    arguments in the kernel's order, ``constexprs`` the parameters after them, by name."""
    if not DIRECT or kernel.pre_run_hooks:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    full = all_args(kernel, args, constexprs)
    device = driver.active.get_current_device()
    key = (id(kernel), device, num_warps, num_stages, specialization_key(kernel, full))
    compiled = _LAUNCHES.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if isinstance(compiled, CompiledKernel) and not kernel.used_global_vals:
            _LAUNCHES[key] = compiled  # holds the kernel (compiled.src.fn), so its id stays its own
        return
    stream = driver.active.get_current_stream(device)
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *full), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *full)

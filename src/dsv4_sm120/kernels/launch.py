"""Kernel launches that skip Triton's per-call host work once a specialization has been launched.

``kernel[grid](...)`` binds every argument, specializes each one, turns the result into a string key and looks
the compiled kernel up, on every call; its launcher then builds a launch-metadata dict for the launch hooks,
calls two (empty) hook chains from C and asks the driver about every tensor's address. For the indexer's
logits kernel (28 parameters) an eager call spent about 60 us on a Hopper host for a 3 us kernel, paid per
C4 layer per step.

Two levels, both built on Triton's own first launch of a specialization (so compiling, Triton's caches and its
errors stay Triton's):

- :func:`launch` keys a launch by :func:`specialization_key` and hands later launches of that key to a
  :class:`_Direct`, the call ``JITFunction.run`` makes after its lookup.
- :class:`Launch` is a wrapper's launch with everything but its tensors fixed (one per argument layout, kept by
  the wrapper): a call reads the tensors' addresses, checks the few that the kernel is specialized on for
  16-byte alignment and hands them to the cached ``_Direct``, with no binding and no key at all.

``_Direct`` calls Triton's C launcher itself where Triton's Python launcher would add nothing but the above (no
launch hook set, no scratch memory, no tensor descriptor), with the same arguments save the hooks and their
metadata, passed as ``None``, which the C launcher skips; with a hook set it launches as Triton does.

Only where these calls are known: Triton 3.6 and 3.8 (the GPU image's and the pin's, whose ``runtime/jit.py``,
``compiler/compiler.py`` and ``backends/nvidia/driver.py`` were read for it), a real GPU (the interpreter always
takes Triton's path), a kernel without pre-run hooks or module globals that Triton would re-check. Triton's
debug and instrumentation knobs come from the environment and are taken as fixed once a kernel ran.
"""

from __future__ import annotations

import functools
import operator

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver

from dsv4_sm120.kernels._common import interpreting

try:
    from triton.backends.nvidia.driver import CudaLauncher
except ImportError:  # a Triton without the NVIDIA backend: Triton's launcher every time
    CudaLauncher = None

_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
DIRECT = _VERSION in ((3, 6), (3, 8)) and not interpreting()  # bench/indexer/ turns it off to time Triton
_LAUNCHES: dict = {}  # (id(kernel), device, num_warps, num_stages, specialization_key) -> _Direct
_PARAMS: dict = {}  # id(kernel) -> (kernel, constexpr getter, runtime parameters); by id: hashing a kernel locks
_HOOK_CHAIN = getattr(knobs, "HookChain", None)
_DATA_PTR = torch.Tensor.data_ptr


def _params(kernel) -> tuple:
    """The constexprs' positions (one itemgetter) and each runtime parameter's (position, specialize, align)."""
    entry = _PARAMS.get(id(kernel))
    if entry is None:
        const = [p.num for p in kernel.params if p.is_constexpr]
        runtime = tuple((p.num, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                        for p in kernel.params if not p.is_constexpr)
        entry = _PARAMS[id(kernel)] = (kernel, operator.itemgetter(*const) if const else lambda args: (), runtime)
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
    _, constexprs, runtime = _params(kernel)
    return constexprs(args), tuple([_arg_key(args[i], specialize, align) for i, specialize, align in runtime])


def all_args(kernel, args, constexprs: dict) -> tuple:
    """Every parameter's value in order, as Triton's binder hands them to the launcher."""
    return (*args, *[constexprs[name] for name in kernel.arg_names[len(args):]])


def kept(table: dict, key, limit: int, build):
    """``table[key]``, made by ``build()`` the first time it is asked for; a table that reached ``limit`` entries
    is emptied first (eager decode widths grow with the context, so new keys keep coming)."""
    value = table.get(key)
    if value is None:
        if len(table) >= limit:
            table.clear()
        value = table[key] = build()
    return value


def tensor_key(t: torch.Tensor) -> tuple:
    """What a wrapper's per-layout plan depends on in a tensor (its address aside): read without any torch op."""
    return t.shape, t.stride(), t.dtype, t.device


_LASTING: dict = {}  # id(tensor) -> (tensor, tensor_key): see lasting_key
_LASTING_MAX = 256  # far more than a model's C4 layers and tables; a full table is emptied and filled again


def lasting_key(t: torch.Tensor) -> tuple:
    """:func:`tensor_key` of a tensor that keeps its layout and lives as long as the model does (a pool's cached
    page view, a RoPE table), read once and then found by identity: about 0.1 us where reading the layout takes
    0.5, paid per argument per C4 layer per eager step. The tensor is held, so its id is not another's while its
    key is kept. Not for activations: up to ``_LASTING_MAX`` of them would be kept alive."""
    hit = _LASTING.get(id(t))
    if hit is not None:
        return hit[1]
    if len(_LASTING) >= _LASTING_MAX:
        _LASTING.clear()
    key = tensor_key(t)
    _LASTING[id(t)] = (t, key)
    return key


def check_one_device(*tensors: torch.Tensor | None) -> None:
    """Raise unless the given tensors (None skipped) share one device: a plan's launches pass addresses, which the
    C launcher no longer asks the driver about, so a host tensor among device ones must be refused here."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"the indexer kernels read every tensor on one device; got {sorted(map(str, devices))}")


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b``, made from ``a`` by a wrapper's input normalization, is ``a`` or a view of it with its dtype: a
    kernel given ``b``'s strides may read ``a`` itself, so a plan can skip the normalization per call."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


def _idle(hook) -> bool:
    """Whether Triton's launcher would call nothing for this launch hook: none, or an empty chain (Triton 3.6 and
    3.8 keep each hook as a ``HookChain``, never None, which the C launcher calls on every launch)."""
    return hook is None or (type(hook) is _HOOK_CHAIN and not hook.calls)


def _aligned16(addresses) -> bool:
    """Whether every one of these addresses is a multiple of 16 (what Triton specializes a pointer on)."""
    return not functools.reduce(operator.or_, addresses, 0) & 15


def _picker(idx):
    """A getter of these positions that always returns a tuple (``itemgetter`` of one position does not)."""
    return operator.itemgetter(*idx) if len(idx) > 1 else lambda seq: tuple(seq[i] for i in idx)


class _Direct:
    """One compiled specialization on one device, launched as ``JITFunction.run`` launches it after its lookup.

    Triton's launcher (``CudaLauncher.__call__``, 3.6 and 3.8) allocates scratch memory where the kernel has any
    and calls its C ``launch`` with the launch metadata and both hook chains, which that calls. Where the kernel
    has no scratch, no sanitizer and no tensor descriptor (which the launcher's ``launch`` wraps), and no hook is
    set, ``launch`` is called here with the same arguments and ``None`` for the metadata and hooks.
    """

    def __init__(self, compiled: CompiledKernel, device):
        launcher = compiled.run  # loaded: Triton has launched it
        self.compiled, self.device, self.stream = compiled, device, driver.active.get_current_stream
        self.bare = None
        if (CudaLauncher is not None and isinstance(launcher, CudaLauncher) and not launcher.global_scratch_size
                and not launcher.profile_scratch_size and not getattr(launcher, "gsan_enabled", False)
                and not any("tensordesc" in str(ty) for ty in compiled.src.signature.values())):
            c, fn, coop, pdl = launcher.launch, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl
            if _VERSION == (3, 8):  # launch(grid, stream, function, coop, pdl, packed metadata, launch metadata,
                # enter hook, exit hook, global scratch, profile scratch, annotations, signature, args)
                head = (fn, coop, pdl, compiled.packed_metadata, None, None, None, None, None,
                        launcher.arg_annotations, launcher.kernel_signature)
                self.bare = lambda grid, stream, args: c(*grid, stream, *head, args)
            else:  # 3.6: launch(grid, stream, function, coop, pdl, global scratch, profile scratch, packed
                # metadata, launch metadata, enter hook, exit hook, *args)
                head = (fn, coop, pdl, None, None, compiled.packed_metadata, None, None, None)
                self.bare = lambda grid, stream, args: c(*grid, stream, *head, *args)

    def __call__(self, grid: tuple, args: tuple) -> None:
        """Launch on the current stream: ``grid`` has three entries, ``args`` every parameter in order (a pointer
        as a tensor or as its address)."""
        stream = self.stream(self.device)
        runtime = knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if self.bare is not None and _idle(enter) and _idle(leave):
            self.bare(grid, stream, args)
            return
        c = self.compiled
        c.run(*grid, stream, c.function, c.packed_metadata, c.launch_metadata(grid, stream, *args), enter, leave, *args)


@functools.cache
def _device_getter():
    """The current device's getter: ``torch._C._cuda_getDevice`` where the driver asks torch's ``current_device``
    (the same answer without its lazy-init check; asked only once a kernel ran, so CUDA is up)."""
    get = driver.active.get_current_device
    return getattr(torch._C, "_cuda_getDevice", get) if get is torch.cuda.current_device else get


def launch(kernel, grid, args, constexprs: dict, *, num_warps: int, num_stages: int):
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``; ``args`` are the runtime
    arguments in the kernel's order, ``constexprs`` the parameters after them, by name. Returns the launch's
    ``_Direct`` where later launches of its specialization take it, else None."""
    if not DIRECT or kernel.pre_run_hooks:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return None
    full = all_args(kernel, args, constexprs)
    device = driver.active.get_current_device()
    key = (id(kernel), device, num_warps, num_stages, specialization_key(kernel, full))
    direct = _LAUNCHES.get(key)
    if direct is None:
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if isinstance(compiled, CompiledKernel) and not kernel.used_global_vals:
            direct = _LAUNCHES[key] = _Direct(compiled, device)  # holds the kernel, so its id stays its own
        return direct
    direct((*grid, 1, 1)[:3], full)
    return direct


class Launch:
    """A wrapper's launch with its grid, scalars, constexprs and options fixed; a call gives only its tensors.

    ``scalars`` and ``constexprs`` name every parameter but the tensors, which a call passes in the kernel's
    order. ``views`` maps a tensor parameter to the view Triton is to see of what a call passes there (same
    memory, another dtype: a complex RoPE table read as fp32 pairs). Holds no tensor.

    A call made after a launch of this on the current device, whose tensors are 16-byte aligned where the
    kernel's specialization asks (every call the model makes), takes the kept ``_Direct`` with the tensors'
    addresses; any other goes through :func:`launch`. The C launcher asks the driver about a tensor's address
    (and refuses a host one) but takes an address as it is: the wrappers check one device per layout.
    """

    def __init__(self, kernel, grid, scalars: dict, constexprs: dict, *, num_warps: int, num_stages: int,
                 views: dict | None = None):
        names = kernel.arg_names
        runtime = names[:len(names) - len(constexprs)]  # the runtime parameters come first in every kernel here
        self.kernel, self.constexprs, self.options = kernel, constexprs, dict(num_warps=num_warps, num_stages=num_stages)
        self.grid, self.grid3 = grid, (*grid, 1, 1)[:3]
        self.slots = [i for i, name in enumerate(runtime) if name not in scalars]
        self.runtime = [scalars.get(name) for name in runtime]  # None at the tensors' places
        self.views = [(views or {}).get(runtime[i]) for i in self.slots]
        # a call's parameters are args((*addresses, *fixed)): the tensors' addresses go to their slots
        fixed = [scalars[name] for name in runtime if name in scalars] + [constexprs[name] for name in names[len(runtime):]]
        self.fixed = fixed
        rest = iter(range(len(self.slots), len(self.slots) + len(fixed)))
        at = {slot: k for k, slot in enumerate(self.slots)}
        self.args = _picker([at[i] if i in at else next(rest) for i in range(len(names))])
        aligned = {num for num, specialize, align in _params(kernel)[2] if specialize and align} \
            if hasattr(kernel, "params") else set()  # the interpreter's kernels have none, and launch no _Direct
        self.by_alignment = _picker([k for k, slot in enumerate(self.slots) if slot in aligned])
        self.direct: dict = {}  # device -> _Direct
        self.bindings: dict = {}  # given parameter names -> _Binding (see bind)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if self.direct and DIRECT:
            addresses = list(map(_DATA_PTR, tensors))
            if self._aligned(addresses):
                direct = self.direct.get(_device_getter()())
                if direct is not None:
                    direct(self.grid3, self.args(addresses + self.fixed))
                    return
        self._through_launch(tensors)

    def triton_args(self, tensors) -> list:
        """The runtime arguments of a call with these tensors as Triton's dispatch takes them."""
        args = list(self.runtime)
        for slot, view, t in zip(self.slots, self.views, tensors):
            args[slot] = t if view is None else view(t)
        return args

    def _through_launch(self, tensors) -> None:
        """The launch through :func:`launch` (Triton's dispatch the first time); keeps its ``_Direct`` when
        this call's tensors had the alignment later calls check for."""
        direct = launch(self.kernel, self.grid, self.triton_args(tensors), self.constexprs, **self.options)
        if direct is not None and self._aligned(list(map(_DATA_PTR, tensors))):
            self.direct[direct.device] = direct

    def _aligned(self, addresses: list) -> bool:
        """Whether the addresses that the kernel is specialized on are 16-byte aligned (as in every model call)."""
        return _aligned16(self.by_alignment(addresses))

    def bind(self, **given: torch.Tensor) -> "BoundLaunch":
        """This launch with the tensors of the parameters named in ``given`` fixed (see :class:`BoundLaunch`)."""
        names = tuple(given)
        binding = self.bindings.get(names)
        if binding is None:
            binding = self.bindings[names] = _Binding(self, names)
        return BoundLaunch(binding, given)


class _Binding:
    """Where a :class:`BoundLaunch`'s addresses go, for one set of given parameter names: worked out once per
    launch and names (a forward binds its buffers once, every forward the same names), holding no tensor."""

    def __init__(self, launch: Launch, given: tuple):
        names = [launch.kernel.arg_names[i] for i in launch.slots]  # the tensor parameters, in the kernel's order
        unknown = set(given) - set(names)
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not tensor parameters of {launch.kernel.__name__}")
        free = [k for k, name in enumerate(names) if name not in given]
        fixed = [k for k, name in enumerate(names) if name in given]
        self.launch, self.given = launch, [names[k] for k in fixed]
        # a direct call's addresses: the call's tensors', then the given ones', then the launch's scalars
        place = {k: n for n, k in enumerate(free + fixed)}
        at = {slot: k for k, slot in enumerate(launch.slots)}
        rest = iter(range(len(names), len(names) + len(launch.fixed)))
        self.args = _picker([place[at[i]] if i in at else next(rest) for i in range(len(launch.kernel.arg_names))])
        self.every = _picker([place[k] for k in range(len(names))])  # call's + given tensors -> the kernel's order
        checked = set(launch.by_alignment(range(len(names))))  # the tensor parameters specialized on alignment
        self.free_checked = _picker([n for n, k in enumerate(free) if k in checked])
        self.given_checked = _picker([n for n, k in enumerate(fixed) if k in checked])


class BoundLaunch:
    """A :class:`Launch` with some of its tensors given once: a forward's own buffers, the same at every layer
    (its positions, slots and output buffers), whose addresses and alignment are read when it is bound. A call
    passes the other tensors in the kernel's order and reads only their addresses; the direct path then takes
    the bound addresses as they were read. Made per forward and held with the tensors it binds (a
    :class:`Launch`, kept across forwards, holds none). A call that cannot take the direct path goes through
    the launch with every tensor, as an unbound call does.
    """

    __slots__ = ("launch", "binding", "given", "by_alignment", "tail")

    def __init__(self, binding: _Binding, given: dict):
        self.launch, self.binding, self.given = binding.launch, binding, [given[name] for name in binding.given]
        addresses = list(map(_DATA_PTR, self.given))
        # None where a given tensor is not aligned as the kernel's specialization asks: every call through the launch
        self.by_alignment = binding.free_checked if _aligned16(binding.given_checked(addresses)) else None
        self.tail = addresses + binding.launch.fixed

    def __call__(self, *tensors: torch.Tensor) -> None:
        binding, launch = self.binding, self.launch
        if launch.direct and DIRECT and self.by_alignment is not None:
            addresses = list(map(_DATA_PTR, tensors))
            if _aligned16(self.by_alignment(addresses)):
                direct = launch.direct.get(_device_getter()())
                if direct is not None:
                    direct(launch.grid3, binding.args(addresses + self.tail))
                    return
        launch(*binding.every((*tensors, *self.given)))

"""The package's eager launch path on a CPU, through Triton's real JIT and launcher, with only the GPU stood in.

Run by tests/kernels/test_launch.py in a fresh interpreter without ``TRITON_INTERPRET``; prints one
``RESULT {json}`` line. Stood in, because there is no GPU: Triton's active driver (the current device and stream,
loading a binary) and, below Triton's own ``CudaLauncher``, its C ``launch`` function, which records its
arguments instead of launching (Triton 3.8: the driver module's ``launch`` and its signature packer; Triton 3.6:
the per-kernel launcher module it would compile). Everything else is real: the kernels compile for sm_90 through
``JITFunction.run`` as on an H200, Triton's ``CudaLauncher`` packs its arguments, and the wrappers take their
per-layout plans and ``launch.Launch``'s direct path from the second call of a layout on.

For each wrapper the model calls per C4 layer per step, calls of one layout: the first through Triton's dispatch
(it compiles), the rest direct. Reported: the C launcher's arguments of the first two (pointers named by the
tensor they point into, so they must be the same call), how often ``JITFunction.run``, the plan builders and the
decode split search ran, the Python lines the third call executed in the package and Triton, the torch
operations of the fourth (TorchDispatchMode), the launch hooks' view of a fifth with a hook set, and, for the
logits, a call whose queries are not 16-byte aligned (Triton's own launch: another specialization).
"""

from __future__ import annotations

import collections
import json
import sys
import types

import torch
import triton.backends.nvidia.driver as nv
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from torch.utils._python_dispatch import TorchDispatchMode

LAUNCHES: list = []
RUNS: collections.Counter = collections.Counter()
PLANS: collections.Counter = collections.Counter()


def _record(*args):
    """The C launcher: records its arguments and, as it does, calls each hook set with the launch metadata."""
    LAUNCHES.append(args)
    metadata = next((a for a in args if type(a).__name__ == "LazyDict"), None)
    for hook in args:
        if isinstance(hook, knobs.HookChain):
            hook(metadata)


class _Utils:
    launch = staticmethod(_record)  # Triton 3.8's C launch; one object, as the real module's

    def load_binary(self, name, binary, shared, device):
        return 1, 2, 64, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448}

    def unload_module(self, module):
        pass

    def build_signature_metadata(self, kernel_signature):
        return ",".join(kernel_signature).encode()


class _Driver:
    utils, launcher_cls = _Utils(), nv.CudaLauncher

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _stand_in_c_launcher() -> None:
    """What ``CudaUtils`` (3.8) or ``CudaLauncher.__init__`` (3.6) would build by compiling C against libcuda."""
    if hasattr(nv, "make_launcher"):  # 3.6: a launcher module compiled per kernel signature
        nv.library_dirs = lambda: []
        nv.compile_module_from_src = lambda **kw: types.SimpleNamespace(launch=_record)
    else:  # 3.8: argument annotations are C objects of the driver module
        nv.PyKernelArg = lambda nested_tuple, type: (type, nested_tuple)
        nv.ARG_CONSTEXPR, nv.ARG_KERNEL, nv.ARG_TUPLE = "constexpr", "kernel", "tuple"


def _counting(counter, key, fn):
    def counted(*args, **kwargs):
        counter[key] += 1
        return fn(*args, **kwargs)
    return counted


def _comparable(arg, names: dict):
    """A launcher argument as JSON: a pointer (a tensor, or the address the direct path passes) by the name of
    the tensor it points into; no launch hook (an empty chain) and the launch metadata, which only hooks read,
    as None (no hook is set while these calls run)."""
    if isinstance(arg, torch.Tensor):
        return ["pointer", names[arg.data_ptr()]]
    if type(arg) is int and arg in names:
        return ["pointer", names[arg]]
    if isinstance(arg, (tuple, list)):
        return [_comparable(a, names) for a in arg]
    if arg is None or isinstance(arg, knobs.HookChain) and not arg.calls or type(arg).__name__ == "LazyDict":
        return None
    return repr(arg)


def _python_lines(call) -> dict:
    lines: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        name = frame.f_code.co_filename
        if "/triton/" not in name and "/dsv4_sm120/" not in name:
            return None
        if event == "line":
            lines[name[name.rfind("/triton/") + 1:] if "/triton/" in name else name[name.rfind("/dsv4_sm120/") + 1:]] += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return dict(lines)


class _TorchOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def main() -> None:
    _stand_in_c_launcher()
    driver.set_active(_Driver())
    JITFunction.run = _counting(RUNS, "triton", JITFunction.run)
    from dsv4_sm120.kernels import index_k_store, index_query, launch, mqa_logits, query_store

    for module, name in ((mqa_logits, "_logits_plan"), (index_query, "_query_plan"), (index_k_store, "_store_plan")):
        setattr(module, name, _counting(PLANS, module.__name__, getattr(module, name)))
    searches = []
    search = mqa_logits._search_splits
    mqa_logits._search_splits = lambda *a: searches.append(a) or search(*a)
    heads, tokens = 64, 8
    freqs = torch.polar(torch.ones(4096, 32), torch.rand(4096, 32))
    pages = torch.zeros(64, 64, 128, dtype=torch.bfloat16)
    q, w = torch.randn(tokens, heads, 128).to(torch.bfloat16), torch.randn(tokens, heads).to(torch.bfloat16)
    rotated, weights = torch.randn(tokens, heads, 128).to(torch.bfloat16), torch.rand(tokens, heads, 1)  # as the query returns
    seq_lens, table = torch.full((tokens,), 3000, dtype=torch.int32), torch.zeros(tokens, 4096, dtype=torch.int32)
    plan, kv, slots = torch.zeros(tokens, 16, dtype=torch.uint8), torch.randn(tokens, 128), torch.arange(tokens)
    positions, norm = torch.arange(tokens), torch.ones(128)
    logits = torch.empty(tokens, 262144)
    query_out = (torch.empty(tokens, heads, 128, dtype=torch.bfloat16), torch.empty(tokens, heads, 1))  # a forward's
    bound = mqa_logits.LogitsCall(seq_lens, table, 262144, logits)  # a forward's, as model.deepseek_v4.TopkInputs binds it
    one_launch = query_store.QueryStoreCall(positions, query_out, slots, plan, "decode")  # a forward's, likewise
    inputs = {  # as the model calls them each step (dsv4_sm120/model/deepseek_v4.py), at the capture width
        "index_query": (lambda: index_query.index_query_bf16(q, w, 0.01, freqs, positions),
                        dict(q=q, w=w, freqs=freqs, positions=positions)),
        "mqa_logits": (lambda: mqa_logits.bf16_paged_mqa_logits(rotated, pages, weights, seq_lens, table, 262144),
                       dict(q=rotated, pages=pages, weights=weights, seq_lens=seq_lens, table=table)),
        "index_query_out": (lambda: index_query.index_query_bf16(q, w, 0.01, freqs, positions, out=query_out),
                            dict(q=q, w=w, freqs=freqs, positions=positions)),
        "mqa_logits_bound": (lambda: bound(rotated, pages, weights),
                             dict(q=rotated, pages=pages, weights=weights, seq_lens=seq_lens, table=table, out=logits)),
        "index_k_store": (lambda: index_k_store.store_index_k_bf16(
            kv, pages, slots, norm_weight=norm, norm_eps=1e-6, freqs=freqs, mode="decode", plan=plan),
            dict(kv=kv, pages=pages, slots=slots, norm=norm, freqs=freqs, plan=plan)),
        "query_store": (lambda: one_launch(q, w, 0.01, freqs, kv, pages, norm_weight=norm, norm_eps=1e-6, k_freqs=freqs),
                        dict(q=q, w=w, freqs=freqs, positions=positions, kv=kv, pages=pages, slots=slots, norm=norm,
                             plan=plan)),
    }
    result = {"direct": launch.DIRECT}
    for name, (call, tensors) in inputs.items():
        LAUNCHES.clear()
        RUNS.clear()
        PLANS.clear()
        launcher_args = []
        for i in range(2):
            outs = call()
            names = {t.data_ptr(): n for n, t in tensors.items()}
            names.update({t.data_ptr(): f"out{k}" for k, t in enumerate(outs if isinstance(outs, tuple) else (outs,))
                          if t is not None})
            launcher_args.append(_comparable(LAUNCHES[i], names))
        lines = _python_lines(call)
        with _TorchOps() as ops:
            call()
        seen: list = []
        knobs.runtime.launch_enter_hook.add(hooked := lambda metadata: seen.append(sorted(metadata.get().items())))
        try:
            call()
        finally:
            knobs.runtime.launch_enter_hook.remove(hooked)
        result[name] = {"launcher_args": launcher_args, "triton_runs": RUNS["triton"], "launches": len(LAUNCHES),
                        "plans": sum(PLANS.values()), "lines": lines, "torch_ops": ops.ops,
                        "hook_saw": repr(seen)}
    RUNS.clear()
    misaligned = torch.zeros(tokens * heads * 128 + 8, dtype=torch.bfloat16)[1:1 + tokens * heads * 128].view(tokens, heads, 128)
    mqa_logits.bf16_paged_mqa_logits(misaligned, pages, weights, seq_lens, table, 262144)
    mqa_logits.bf16_paged_mqa_logits(rotated, pages, weights, seq_lens, table, 262144)
    result["misaligned_triton_runs"] = RUNS["triton"]  # the misaligned call only: the aligned one after is direct
    result["split_searches"] = len(searches)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

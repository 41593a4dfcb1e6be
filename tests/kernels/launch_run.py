"""The package's eager launch path on a CPU, through Triton's real JIT, with only the GPU driver stood in.

Run by tests/kernels/test_launch.py in a fresh interpreter without ``TRITON_INTERPRET``; prints one
``RESULT {json}`` line. Replaced, because there is no GPU: Triton's active driver (the current device and
stream, loading a binary, and the launcher, which records its arguments instead of launching). Everything
else is real: the kernels compile for sm_90 through ``JITFunction.run`` as on an H200, and
``launch.launch`` takes its direct path from the second launch of a specialization on.

For each wrapper the model calls per C4 layer per step, three calls of one shape: the first through Triton's
dispatch (it compiles), the second and third direct. Reported: the launcher arguments of the first two (they
must be the same call), how often ``JITFunction.run`` and the decode split search ran, and the Python-level
work of the third call: the lines executed in the package's and Triton's code (a count, not a time).
"""

from __future__ import annotations

import collections
import json
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

LAUNCHES: list = []
RUNS: collections.Counter = collections.Counter()


class _Launcher:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args):
        LAUNCHES.append(args)


class _Utils:
    def load_binary(self, name, binary, shared, device):
        return 1, 2, 64, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448}

    def unload_module(self, module):
        pass


class _Driver:
    utils, launcher_cls = _Utils(), _Launcher

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _counting(run):
    def counted(self, *args, **kwargs):
        RUNS[self.fn.__name__] += 1
        return run(self, *args, **kwargs)
    return counted


def _comparable(arg):
    if isinstance(arg, torch.Tensor):
        return ["tensor", str(arg.dtype), list(arg.shape), list(arg.stride())]
    if type(arg).__name__ == "LazyDict":  # launch metadata: name, function, stream
        return ["launch_metadata", repr(sorted(arg.get().items()))]
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


def main() -> None:
    driver.set_active(_Driver())
    JITFunction.run = _counting(JITFunction.run)
    from dsv4_sm120.kernels import index_k_store, index_query, launch, mqa_logits

    searches = []
    search = mqa_logits._search_splits
    mqa_logits._search_splits = lambda *a: searches.append(a) or search(*a)
    heads, tokens = 64, 8
    freqs = torch.polar(torch.ones(4096, 32), torch.rand(4096, 32))
    pages = torch.zeros(64, 64, 128, dtype=torch.bfloat16)
    q, w = torch.randn(tokens, heads, 128).to(torch.bfloat16), torch.randn(tokens, heads).to(torch.bfloat16)
    rotated, weights = torch.randn(tokens, heads, 128).to(torch.bfloat16), torch.rand(tokens, heads, 1)  # as the query returns
    seq_lens, table = torch.full((tokens,), 3000, dtype=torch.int32), torch.zeros(tokens, 4096, dtype=torch.int32)
    plan = torch.zeros(tokens, 16, dtype=torch.uint8)
    calls = {  # as the model calls them each step (dsv4_sm120/model/deepseek_v4.py), at the capture width
        "index_query": lambda: index_query.index_query_bf16(q, w, 0.01, freqs, torch.arange(tokens)),
        "mqa_logits": lambda: mqa_logits.bf16_paged_mqa_logits(rotated, pages, weights, seq_lens, table, 262144),
        "index_k_store": lambda: index_k_store.store_index_k_bf16(
            torch.randn(tokens, 128), pages, torch.arange(tokens), norm_weight=torch.ones(128), norm_eps=1e-6,
            freqs=freqs, mode="decode", plan=plan),
    }
    result = {"direct": launch.DIRECT}
    for name, call in calls.items():
        LAUNCHES.clear()
        RUNS.clear()
        call()
        call()
        lines = _python_lines(call)
        result[name] = {"launcher_args": [[_comparable(a) for a in args] for args in LAUNCHES[:2]],
                        "triton_runs": sum(RUNS.values()), "launches": len(LAUNCHES), "lines": lines}
    result["split_searches"] = len(searches)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Where does the host time of an eager decode step go?

For one request's decode step (1 x 4096 keys at the capture width), each piece of the model's three per-layer
calls, logits, query and key store, timed alone on the host (``eager_host_breakdown`` in the JSON;
``BREAKDOWN_FIELDS`` says what each piece is), with a check that the direct launch writes what Triton's own
dispatch writes. Part of the full run and of ``--eager-only``.
"""

from __future__ import annotations

import time

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import D, H, PAGE, SIZES, case, sync
from dsv4_sm120.kernels import launch as kernel_launch
from dsv4_sm120.kernels import mqa_logits
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits, decode_splits


def _host_us(fn, calls, rounds=5):
    """Host time of one call: wall clock of ``calls`` back-to-back calls from a sync to the return of the last
    (no sync after it: that many launches fit the launch queue, so no call waits for the GPU), over ``calls``;
    the median of ``rounds``."""
    fn()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return sorted(times)[len(times) // 2]


BREAKDOWN_FIELDS = {
    "whole_call": "the wrapper allocating its outputs, steady state (the model's call before the bound call)",
    "whole_call_out_given": "the wrapper with out= given (no allocation): the query as the model calls it",
    "bound_call": "logits only: as the model calls it, a LogitsCall with lengths, page table, width and output bound",
    "whole_call_new_layout": "logits only: a new width every call (max_seq_len grows in eager decode): a plan per call",
    "plan_launch": "the plan's Launch alone: addresses, alignment check, device, the cached launch",
    "torch_empty": "the outputs' torch.empty (the only torch op of a steady-state call)",
    "tensor_keys": "launch.tensor_key of each argument tensor: the reads that key the plan",
    "loop_overhead": "an empty lambda: the timing loop itself",
    "check_pages": "before the plans, per call: layout.check_pages",
    "normalize": "before the plans, per call: mqa_logits._normalize (a reshape of the [T, H, 1] weights)",
    "decode_splits_cached": "before the plans, per call: the cached decode split count",
    "specialization_key": "before the plans, per call: all_args + launch.specialization_key",
    "driver_device_stream": "before, per call: driver.active.get_current_device() + get_current_stream(device)",
    "cached_device_stream": "now: launch._device_getter()() + the _Direct's stream getter",
    "launch_metadata": "before, per call: CompiledKernel.launch_metadata (a dict for the never-None hook chains)",
    "triton_launcher": "before, per call: CompiledKernel.run, Triton's launcher, with launch_metadata (tensors)",
    "c_launch": "now: Triton's C launch function alone, arguments prepared (addresses)",
    "triton_dispatch": "kernel[grid](...): Triton's own dispatch and launch",
    "direct_matches_triton": "the direct path's output equals Triton's dispatch's, bit for bit (GPU runs)",
}


def _launch_pieces(launch, tensors) -> dict:
    """Host pieces of one Launch's call on the GPU (see BREAKDOWN_FIELDS)."""
    from triton import knobs
    from triton.runtime import driver

    args = launch.triton_args(tensors)
    full = kernel_launch.all_args(launch.kernel, args, launch.constexprs)
    direct = launch.direct.get(torch.cuda.current_device())
    if direct is None:  # no direct path on this Triton (kernels/launch.py): only Triton's dispatch to time
        return {"triton_dispatch": lambda: launch.kernel[launch.grid](*args, **launch.constexprs, **launch.options)}
    c = direct.compiled
    stream = direct.stream(direct.device)
    addresses = launch.args([t.data_ptr() for t in tensors] + launch.fixed)
    runtime = knobs.runtime
    return {
        "specialization_key": lambda: kernel_launch.specialization_key(
            launch.kernel, kernel_launch.all_args(launch.kernel, args, launch.constexprs)),
        "driver_device_stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "cached_device_stream": lambda: direct.stream(kernel_launch._device_getter()()),
        "launch_metadata": lambda: c.launch_metadata(launch.grid, stream, *full),
        "triton_launcher": lambda: c.run(*launch.grid3, stream, c.function, c.packed_metadata,
                                         c.launch_metadata(launch.grid, stream, *full), runtime.launch_enter_hook,
                                         runtime.launch_exit_hook, *full),
        "c_launch": (lambda: direct.bare(launch.grid3, stream, addresses)) if direct.bare else None,
        "triton_dispatch": lambda: launch.kernel[launch.grid](*args, **launch.constexprs, **launch.options),
    }


def _the_plan(module, call):
    """The one plan a call of ``module``'s wrapper builds (its plans emptied first)."""
    module._PLANS.clear()
    call()
    (plan,) = module._PLANS.values()
    return plan


def _direct_matches_triton(call, outputs) -> bool:
    """The wrapper's output through the direct path and through Triton's dispatch, compared bit for bit."""
    first = [t.clone() for t in outputs(call())]
    direct, kernel_launch.DIRECT = kernel_launch.DIRECT, False
    try:
        second = outputs(call())
    finally:
        kernel_launch.DIRECT = direct
    return all(torch.equal(a, b) for a, b in zip(first, second))


def host_breakdown(pool, gen):
    """Where an eager call's host time goes, one piece at a time, for the model's three per-layer
    calls at a decode step of one request (1 x 4096 keys at the capture width): each piece timed alone with
    ``_host_us`` (BREAKDOWN_FIELDS says what each is). Dry runs time the pieces that need no GPU."""
    live = SIZES["eager_live"][0]
    res = {"B": 1, "live": live, "width": SIZES["width"], "calls": SIZES["breakdown_calls"], "rounds": 5,
           "fields": BREAKDOWN_FIELDS}
    freqs = torch.polar(torch.ones(4096, 32, device=cases.DEV), torch.rand(4096, 32, generator=gen, device=cases.DEV))
    res["mqa_logits"] = _logits_pieces(pool, gen, live)
    res["index_query"] = _query_pieces(gen, freqs, live)
    res["store_index_k"] = _store_pieces(gen, freqs, live)
    print(f"\nHOST BREAKDOWN  B=1 live={live} width={res['width']}: us per call, host only "
          f"(median of {res['rounds']} x {res['calls']} calls)", flush=True)
    for name in ("mqa_logits", "index_query", "store_index_k"):
        print(f"  {name:<14} " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in res[name].items()), flush=True)
    return res


def _logits_pieces(pool, gen, live) -> dict:
    from dsv4_sm120.kernels.launch import tensor_key
    from dsv4_sm120.kernels.layout import check_pages

    width, stages = SIZES["width"], mqa_logits.DECODE_CONFIG["num_stages"]
    q, w, sl, pt = case(pool.shape[0], 1, [live], width, gen)
    w = w.unsqueeze(-1)  # as index_query_bf16 returns the head weights
    out = torch.empty((1, width), dtype=torch.float32, device=cases.DEV)
    call = lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width)  # noqa: E731
    plan = _the_plan(mqa_logits, call)
    bound = mqa_logits.LogitsCall(sl, pt, width, out)
    widths = iter(range(width, 0, -1))
    pieces = _time_pieces({
        "whole_call": call,
        "whole_call_out_given": lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width, out=out),
        "bound_call": lambda: bound(q, pool, w),
        "whole_call_new_layout": lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, next(widths)),
        "plan_launch": lambda: plan.launch(q, w, pool, sl, pt, out),
        "torch_empty": lambda: torch.empty((1, width), dtype=torch.float32, device=cases.DEV),
        "tensor_keys": lambda: [tensor_key(t) for t in (q, w, sl, pt, pool)],
        "loop_overhead": lambda: None,
        "check_pages": lambda: check_pages(pool),
        "normalize": lambda: mqa_logits._normalize(q, w, sl, pt),
        "decode_splits_cached": lambda: decode_splits(1, width, device=pool.device, num_stages=stages, heads=H),
    }, plan.launch, (q, w, pool, sl, pt, out), lambda: _direct_matches_triton(call, lambda o: [o[:, :live]]))
    mqa_logits._PLANS.clear()  # the new layouts'
    return pieces


def _query_pieces(gen, freqs, live) -> dict:
    from dsv4_sm120.kernels import index_query
    from dsv4_sm120.kernels.launch import tensor_key

    q = torch.randn((1, H, D), generator=gen, device=cases.DEV).to(torch.bfloat16)  # wq_b's bf16 output
    w = torch.randn((1, H), generator=gen, device=cases.DEV).to(torch.bfloat16)
    pos = torch.tensor([live - 1], device=cases.DEV)
    rotated, scaled = torch.empty_like(q), torch.empty((1, H, 1), dtype=torch.float32, device=cases.DEV)
    call = lambda: index_query.index_query_bf16(q, w, 0.0110485, freqs, pos)  # noqa: E731
    plan = _the_plan(index_query, call)
    return _time_pieces({
        "whole_call": call,
        "whole_call_out_given": lambda: index_query.index_query_bf16(q, w, 0.0110485, freqs, pos, out=(rotated, scaled)),
        "plan_launch": lambda: plan.launch(q, w, rotated, scaled, freqs, pos),
        "torch_empty": lambda: (torch.empty((1, H, D), dtype=torch.bfloat16, device=cases.DEV),
                                torch.empty((1, H, 1), dtype=torch.float32, device=cases.DEV)),
        "tensor_keys": lambda: [tensor_key(t) for t in (q, w, pos, freqs)],
        "loop_overhead": lambda: None,
    }, plan.launch, (q, w, rotated, scaled, freqs, pos), lambda: _direct_matches_triton(call, list))


def _store_pieces(gen, freqs, live) -> dict:
    from dsv4_sm120.kernels import index_k_store
    from dsv4_sm120.kernels.launch import tensor_key

    kv = torch.randn((1, D), generator=gen, device=cases.DEV)  # fp32, the compressor's output
    pages = torch.zeros((4, PAGE, D), dtype=torch.bfloat16, device=cases.DEV)
    slot, norm = torch.tensor([PAGE + 3], device=cases.DEV), torch.ones(D, device=cases.DEV)
    step = torch.tensor([[live, -1, -1, -1]], dtype=torch.int32, device=cases.DEV).view(torch.uint8)  # a DecodePlan row
    call = lambda: index_k_store.store_index_k_bf16(  # noqa: E731
        kv, pages, slot, norm_weight=norm, norm_eps=1e-6, freqs=freqs, mode="decode", plan=step)
    plan = _the_plan(index_k_store, call)
    return _time_pieces({
        "whole_call": call,
        "plan_launch": lambda: plan.launch(kv, step, slot, slot, norm, freqs, pages),
        "tensor_keys": lambda: [tensor_key(t) for t in (kv, pages, slot, norm, freqs, step)],
        "loop_overhead": lambda: None,
    }, plan.launch, (kv, step, slot, slot, norm, freqs, pages),
        lambda: _direct_matches_triton(lambda: (pages.zero_(), call())[0], lambda p: [p.clone()]))


def _time_pieces(pieces: dict, launch, tensors, check) -> dict:
    """Each piece's ``_host_us``, with the GPU-only pieces of ``launch`` on the GPU, and the direct path's check."""
    calls, dry = SIZES["breakdown_calls"], g._DRY["on"]
    if not dry:
        pieces.update(_launch_pieces(launch, tensors))
    out = {name: None if fn is None else _host_us(fn, calls) for name, fn in pieces.items()}
    out["direct_matches_triton"] = None if dry else check()
    return out

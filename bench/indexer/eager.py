"""What host time does an eager call of the bf16 indexer add to its kernels?

Decode B in {1, 8, 64} x {4k, 32k, 128k} keys at the capture width as eager calls (wall clock of back-to-back
calls, host included), with every host cache and as before the host caches, beside the CUDA-graph replay and the
kernel alone (``eager`` in the JSON; ``eager_section`` says what each field is), and the whole C4 layer, query,
key store and logits as the model calls them (``eager_layer``; ``layer_section``). The last lines (VERDICT,
``print_verdict``) set the host time an eager layer and an eager logits call add against the 20 us bar.
``--eager-only`` runs only these and ``breakdown`` (under a minute on the H200).
"""

from __future__ import annotations

import time

import torch

from bench import _gpu_common as g
from bench.indexer import cases
from bench.indexer.cases import D, H, PAGE, SIZES, capture, case, sync
from dsv4_sm120.kernels import launch as kernel_launch
from dsv4_sm120.kernels import mqa_logits
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits, decode_splits


def _eager_us(fn, calls, before_each=None, rounds=3):
    """Host-inclusive time of one eager call as a user meets it: wall clock of ``calls`` back-to-back calls from a
    sync to the sync after the last, over ``calls``; the median of ``rounds``."""
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            if before_each is not None:
                before_each()
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def _graph_us(fn, calls, rounds=3):
    """One CUDA graph of ``calls`` launches: wall clock of a replay from a sync to its sync, over ``calls``."""
    graph = capture([fn] * calls)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    del graph
    return sorted(times)[len(times) // 2]


def _kernels_us(fn, calls, names) -> float:
    """Summed duration per call of the kernels whose names contain one of ``names`` over ``calls`` eager calls,
    from the CUDA profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = [e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and any(n in e.name for n in names)]
    if not spans:
        raise RuntimeError(f"the profiler recorded no launch of {names}")
    return sum(spans) / calls


LAYER_KERNELS = ("_query_store_kernel", "_logits_kernel")
FLASH_C4_LAYERS = 21  # DeepSeek-V4-Flash: 43 layers, two sliding-window-only, then C4 and C128 alternating
# Eager decode steps between two widths of the logits: the width is the page table's columns times 64 compressed
# keys (sglang 0.5.23 PagedIndexerMetadata.max_compressed_seq_len), the page table has a column per 256 tokens of
# the batch's longest request (build_page_table_positions: req_to_token[:, :max_seq_len:page_size]), so the width
# and with it the logits' plan changes once every 256 steps, when the longest request starts a page.
STEPS_PER_WIDTH = 256


def layer_section(pool, gen):
    """One C4 layer's whole bf16 indexer in eager decode, as the model calls it on one stream: the query (into the
    forward's buffers) and the key store (upstream's DecodePlan, every row storing: the step that completes a
    compressed key) in one launch (the forward's bound ``QueryStoreCall``), then the logits (the forward's bound
    ``LogitsCall``), back to back for ``eager_calls`` layers.

    Per shape (rows x live keys at the capture width): ``eager_us`` a layer's wall clock with its host time
    (``eager_two_launches_us`` the same layer with the query and the store launched apart, as before),
    ``kernels_us`` its three kernels alone (CUPTI), ``host_added_us`` their difference; ``forward_us`` what every
    eager decode step pays once, its forward binding new calls (``TopkInputs``' ``LogitsCall`` and
    ``QueryStoreCall``) whose layouts' plans are kept, minus a layer; ``plan_us`` the same when the width changed
    (the logits' plans made too), ``plan_batch_us`` when the batch changed to a size not seen before (every plan);
    ``host_added_with_plan_us`` the per-layer figure with ``plan_us`` spread over Flash's ``FLASH_C4_LAYERS`` C4
    layers (a new width at every step: the bound), ``host_added_per_step_us`` with ``forward_us`` spread over them
    and ``plan_us`` once every ``STEPS_PER_WIDTH`` steps (what eager decode pays: the bar's figure)."""
    from dsv4_sm120.kernels import index_k_store, index_query, query_store

    rows_out = []
    calls, width, dry = SIZES["eager_calls"], SIZES["width"], g._DRY["on"]
    freqs = torch.polar(torch.ones(SIZES["max_pos"] * 4, 32, device=cases.DEV),
                        torch.rand(SIZES["max_pos"] * 4, 32, generator=gen, device=cases.DEV))
    for b in SIZES["eager_b"]:
        for live in SIZES["eager_live"]:
            q_in = torch.randn((b, H, D), generator=gen, device=cases.DEV).to(torch.bfloat16)  # wq_b's output
            w_in = torch.randn((b, H), generator=gen, device=cases.DEV).to(torch.bfloat16)
            pos = torch.full((b,), live - 1, device=cases.DEV)
            out = (torch.empty_like(q_in), torch.empty((b, H, 1), dtype=torch.float32, device=cases.DEV))
            kv = torch.randn((b, D), generator=gen, device=cases.DEV)  # the compressor's fp32 output
            slots = torch.arange(b, device=cases.DEV) * PAGE + 3
            step = torch.full((b, 4), -1, dtype=torch.int32, device=cases.DEV)
            step[:, 0] = live  # a multiple of 4: every row completes a compressed key
            step = step.view(torch.uint8)
            keys = torch.zeros((b + 1, PAGE, D), dtype=torch.bfloat16, device=cases.DEV)
            norm = torch.ones(D, device=cases.DEV)
            _, _, sl, pt = case(pool.shape[0], b, [live] * b, width, gen)
            scratch = torch.empty((b, width), dtype=torch.float32, device=cases.DEV)

            def forward():  # what a forward binds (model.deepseek_v4.TopkInputs)
                return (query_store.QueryStoreCall(pos, out, slots, step, "decode"),
                        mqa_logits.LogitsCall(sl, pt, width, scratch))

            def layer(bound):
                one_launch, logits = bound
                qr, wr = one_launch(q_in, w_in, 0.0110485, freqs, kv, keys, norm_weight=norm, norm_eps=1e-6,
                                    k_freqs=freqs)
                logits(qr, pool, wr)

            def two_launches(bound):  # the layer before the one launch: the query, then the store
                qr, wr = index_query.index_query_bf16(q_in, w_in, 0.0110485, freqs, pos, out=out)
                index_k_store.store_index_k_bf16(kv, keys, slots, norm_weight=norm, norm_eps=1e-6, freqs=freqs,
                                                 mode="decode", plan=step)
                bound[1](qr, pool, wr)

            bound = forward()
            layer(bound)
            two_launches(bound)
            res = {"shape": "eager_layer", "B": b, "live": live, "width": width, "calls": calls,
                   "eager_us": _eager_us(lambda: layer(bound), calls),
                   "eager_two_launches_us": _eager_us(lambda: two_launches(bound), calls)}

            def new_width():  # the logits' plan: every eager decode step (the width is the longest row)
                _forget_plans()
                layer(forward())

            def new_batch():  # every plan: a step whose batch changed
                index_query._PLANS.clear()
                index_k_store._PLANS.clear()
                query_store._PLANS.clear()
                new_width()

            plans = max(3, calls // 20)
            res["forward_us"] = _eager_us(lambda: layer(forward()), plans) - res["eager_us"]
            res["plan_us"] = _eager_us(new_width, plans) - res["eager_us"]
            res["plan_batch_us"] = _eager_us(new_batch, plans) - res["eager_us"]
            res["kernels_us"] = res["host_added_us"] = res["host_added_with_plan_us"] = None
            res["host_added_per_step_us"] = None
            if not dry:
                res["kernels_us"] = _kernels_us(lambda: layer(bound), calls, LAYER_KERNELS)
                res["host_added_us"] = res["eager_us"] - res["kernels_us"]
                res["host_added_with_plan_us"] = res["host_added_us"] + res["plan_us"] / FLASH_C4_LAYERS
                res["host_added_per_step_us"] = (res["host_added_us"] + res["forward_us"] / FLASH_C4_LAYERS
                                                 + res["plan_us"] / (FLASH_C4_LAYERS * STEPS_PER_WIDTH))
            rows_out.append(res)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
            del q_in, w_in, out, kv, keys, sl, pt, scratch
    return rows_out


def repeated_layer_section(pool, gen, repeats: int) -> list[dict]:
    """:func:`layer_section` ``repeats`` times, one sweep of every shape after the other. A host's speed moves
    from run to run (four runs on one H100, 1 x 4k: 18.3, 25.4, 32.6 and 45.6 us added per step,
    bench/results/kernels/indexer_h100_2026-12-06_eager_pin_3624797_run*.json, in git history), so one sweep's figure is a draw:
    each shape's row is the sweep with the median per-step figure, with every sweep's figure beside it
    (``host_added_per_step_us_runs``), which the verdict reads as the spread."""
    sweeps = [layer_section(pool, gen) for _ in range(max(1, repeats))]
    rows = []
    for runs in zip(*sweeps):
        figures = [r["host_added_per_step_us"] for r in runs]
        if None in figures:  # no kernel times: a dry run on the CPU
            middle = runs[0]
        else:  # the median sweep (of two middles, the upper)
            middle = sorted(runs, key=lambda r: r["host_added_per_step_us"])[len(runs) // 2]
        rows.append({**middle, "host_added_per_step_us_runs": figures})
    return rows


def _forget_plans():
    mqa_logits._SPLITS.clear()
    mqa_logits._PLANS.clear()


def eager_section(pool, gen):
    """Decode logits as eager calls, host time included, beside CUDA-graph replays and the kernel alone.

    Per shape (rows x live keys, width = the capture width, the same inputs every call, so keys may sit in L2:
    the decode section has the L2-cold kernel times): ``eager_us`` as the model calls it, with every host cache
    (split counts kept, direct launch): a ``LogitsCall`` with the lengths, page table, width and the forward's logits
    buffer bound (``model.deepseek_v4.TopkInputs``), given each layer's queries, weights and pool;
    ``eager_alloc_us`` the same call allocating its output, as a caller without a buffer meets it;
    ``eager_triton_dispatch_us`` with Triton's own dispatch instead of the direct launch;
    ``eager_before_us`` as before the host caches, the split search run before every call (its cache and the wrapper's
    plans emptied) and Triton's dispatch (the search itself now divides without ``triton.cdiv``, so this
    understates the old cost);
    ``graph_us`` per launch of a captured graph; ``kernel_us`` the kernel alone (CUPTI); ``host_added_us`` =
    eager minus kernel (``host_added_alloc_us`` for the allocating call). ``split_search_us`` is one search on the
    host. Dry runs time eager calls only.
    """
    rows_out = []
    calls, width, dry = SIZES["eager_calls"], SIZES["width"], g._DRY["on"]
    for b in SIZES["eager_b"]:
        for live in SIZES["eager_live"]:
            q, w, sl, pt = case(pool.shape[0], b, [live] * b, width, gen)
            w = w.unsqueeze(-1)  # as index_query_bf16 returns the head weights
            scratch = torch.empty((b, width), dtype=torch.float32, device=cases.DEV)
            bound = mqa_logits.LogitsCall(sl, pt, width, scratch)
            eager = lambda: bound(q, pool, w)  # noqa: E731  (as the model calls it)
            eager_alloc = lambda: bf16_paged_mqa_logits(q, pool, w, sl, pt, width)  # noqa: E731
            eager()
            eager_alloc()
            res = {"shape": "eager_decode", "B": b, "live": live, "width": width, "calls": calls,
                   "splits": decode_splits(b, width, device=pool.device, num_stages=mqa_logits.DECODE_CONFIG["num_stages"],
                                           heads=H)}
            res["eager_us"] = _eager_us(eager, calls)
            res["eager_alloc_us"] = _eager_us(eager_alloc, calls)
            direct, kernel_launch.DIRECT = kernel_launch.DIRECT, False
            try:
                res["eager_triton_dispatch_us"] = _eager_us(eager, calls)
                res["eager_before_us"] = _eager_us(eager_alloc, calls, before_each=_forget_plans)
            finally:
                kernel_launch.DIRECT = direct
            t0 = time.perf_counter()
            mqa_logits._SPLITS.clear()
            decode_splits(b, width, device=pool.device, num_stages=mqa_logits.DECODE_CONFIG["num_stages"], heads=H)
            res["split_search_us"] = (time.perf_counter() - t0) * 1e6
            res["graph_us"] = res["kernel_us"] = res["host_added_us"] = None
            if not dry:
                res["graph_us"] = _graph_us(eager, calls)
                try:
                    res["kernel_us"] = _kernels_us(eager, calls, ("_logits_kernel",))
                    res["host_added_us"] = res["eager_us"] - res["kernel_us"]
                    res["host_added_alloc_us"] = res["eager_alloc_us"] - res["kernel_us"]
                    res["host_added_before_us"] = res["eager_before_us"] - res["kernel_us"]
                except Exception as exc:  # no CUPTI: the graph time stands in for the kernel's
                    res["kernel_us_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows_out.append(res)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
            del q, w, sl, pt, scratch
    return rows_out


HOST_BAR_US = 20.0  # an eager call adds at most this much host time to its kernel


def print_verdict(result: dict) -> None:
    """One line per eager shape of one request: the host time an eager logits call adds against the bar."""
    for r in result.get("eager_layer", []):
        if r.get("host_added_per_step_us") is not None:
            verdict = "within" if r["host_added_per_step_us"] <= HOST_BAR_US else "OVER"
            runs = [v for v in r.get("host_added_per_step_us_runs", []) if v is not None]
            spread = f", {len(runs)} sweeps {min(runs):.1f}-{max(runs):.1f}" if len(runs) > 1 else ""
            print(f"VERDICT eager C4 layer B={r['B']} live={r['live']} (query + store + logits, a step's binding and "
                  f"its share of a new width spread): eager {r['eager_us']:.1f} us, kernels {r['kernels_us']:.1f} us, "
                  f"host added {r['host_added_per_step_us']:.1f} us{spread} (a new width every step: "
                  f"{r['host_added_with_plan_us']:.1f}): {verdict} the {HOST_BAR_US:.0f} us bar", flush=True)
    for r in result["eager"]:
        if r["B"] == 1 and r.get("host_added_us") is not None:
            verdict = "within" if r["host_added_us"] <= HOST_BAR_US else "OVER"
            print(f"VERDICT eager logits B=1 live={r['live']} (as the model calls it): eager {r['eager_us']:.1f} us, "
                  f"kernel {r['kernel_us']:.1f}"
                  f" us, host added {r['host_added_us']:.1f} us: {verdict} the {HOST_BAR_US:.0f} us bar", flush=True)

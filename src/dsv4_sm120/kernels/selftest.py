"""``dsv4-sm120 doctor --selftest``: compile and run every kernel once on this GPU against its torch reference.

CI compiles the kernels for sm_90 and sm_120 but has no GPU, and this project has no sm_120 card: a
user with one (an RTX PRO 6000) gets a real check in one command. Each kernel runs once at a small
shape with fresh random inputs, its output is compared with the plain torch reference, and one line
is printed per kernel: device, compute capability, pass/fail with the measured error, and the time
of the first call (compile included) and of a second one. Exit status 1 when any kernel fails.

torch + Triton only (no sglang), like the rest of ``kernels/``, so it also runs on a bare GPU image.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS

REL_ERR_LIMIT = 1e-5  # fp32 accumulation of exact bf16 products against the float64 reference
# Stage 1 of the two-stage indexer against its reference: Hopper's fp8 products keep fewer accumulator bits than
# fp32 (Triton's default on sm_90); a bound set without a GPU run, not a measured one.
FP8_REL_ERR_LIMIT = 1e-3
BF16_MISMATCH_LIMIT = 1e-3  # share of bf16 outputs allowed to differ by one rounding step (ties)


@dataclass
class Result:
    kernel: str
    device: str
    capability: str
    ok: bool
    detail: str
    first_ms: float
    second_ms: float

    def line(self) -> str:
        return (f"{self.kernel:<14} {self.device} sm_{self.capability.replace('.', '')}  "
                f"{'PASS' if self.ok else 'FAIL'}  {self.detail}  first {self.first_ms:.1f} ms, "
                f"then {self.second_ms:.3f} ms")


def _timed(fn) -> tuple[float, float]:
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], times[1]


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    differ = float((out.view(torch.int16) != ref.view(torch.int16)).float().mean())
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    return differ <= BF16_MISMATCH_LIMIT and err < 1e-2, f"rel err {err:.1e}, {differ:.1e} of values off by rounding"


def _check_store(gen) -> tuple[bool, str, object]:
    from dsv4_sm120.kernels.index_k_store import store_index_k_bf16, store_index_k_bf16_ref

    n, pool = 256, 8
    kv = torch.randn(n, HEAD_DIM, generator=gen, device="cuda")  # fp32 rows, as upstream's compressor hands them
    freqs = torch.polar(torch.ones(4096, 32, device="cuda"), torch.rand(4096, 32, generator=gen, device="cuda") * 6.28)
    kw = dict(norm_weight=1 + 0.1 * torch.randn(HEAD_DIM, generator=gen, device="cuda"), norm_eps=1e-6, freqs=freqs,
              positions=torch.randint(0, 4096, (n,), generator=gen, device="cuda"))
    slots = torch.randperm(pool * PAGE_SLOTS, generator=gen, device="cuda")[:n]
    out = torch.full((pool, PAGE_SLOTS, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = out.clone()
    run = lambda: store_index_k_bf16(kv, out, slots, **kw)  # noqa: E731
    store_index_k_bf16_ref(kv, ref, slots, **kw)
    run()
    written = ~ref.isnan()
    ok_mask = bool(torch.equal(written, ~out.isnan()))
    ok, detail = _bf16_close(out[written], ref[written])
    return ok and ok_mask, detail + ("" if ok_mask else "; wrong slots written"), run


def _check_query(gen) -> tuple[bool, str, object]:
    from dsv4_sm120.kernels.index_query import index_query_bf16, index_query_bf16_ref

    t, h = 64, 64
    q = torch.randn(t, h, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    freqs = torch.polar(torch.ones(4096, 32, device="cuda"), torch.rand(4096, 32, generator=gen, device="cuda") * 6.28)
    pos = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
    run = lambda: index_query_bf16(q, w, 0.011, freqs, pos)  # noqa: E731
    (a, wa), (b, wb) = run(), index_query_bf16_ref(q, w, 0.011, freqs, pos)
    ok, detail = _bf16_close(a, b)
    return ok and bool(torch.allclose(wa, wb)), detail, run


def _check_query_store(gen) -> tuple[bool, str, object]:
    """The query and the key store in one launch write exactly what the two kernels write apart."""
    from dsv4_sm120.kernels.index_k_store import store_index_k_bf16
    from dsv4_sm120.kernels.index_query import index_query_bf16
    from dsv4_sm120.kernels.query_store import QueryStoreCall

    t, h, n = 8, 64, 8
    q = torch.randn(t, h, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    freqs = torch.polar(torch.ones(4096, 32, device="cuda"), torch.rand(4096, 32, generator=gen, device="cuda") * 6.28)
    pos = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
    kv = torch.randn(n, HEAD_DIM, generator=gen, device="cuda")
    norm = torch.rand(HEAD_DIM, generator=gen, device="cuda") + 0.5
    slots = torch.randperm(4 * PAGE_SLOTS, generator=gen, device="cuda")[:n]
    plan = torch.full((n, 4), -1, dtype=torch.int32, device="cuda")
    plan[:, 0] = torch.randint(1, 1000, (n,), generator=gen, device="cuda") * 4  # every row closes a group of 4
    plan = plan.view(torch.uint8)
    apart = torch.zeros(4, PAGE_SLOTS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    together = apart.clone()
    store_index_k_bf16(kv, apart, slots, norm_weight=norm, norm_eps=1e-6, freqs=freqs, mode="decode", plan=plan)
    want = index_query_bf16(q, w, 0.011, freqs, pos)
    out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    call = QueryStoreCall(pos, out, slots, plan, "decode")
    run = lambda: call(q, w, 0.011, freqs, kv, together, norm_weight=norm, norm_eps=1e-6, k_freqs=freqs)  # noqa: E731
    run()
    same = bool(torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and torch.equal(together, apart))
    return same, "bit-exact against the two launches" if same else "differs from the two launches", run


def _check_logits(gen) -> tuple[bool, str, object]:
    """Decode rows of 1 to 4000 keys at width 8192: 4 rows (tl.store of the logits) and 16 rows (inline stores,
    ``INLINE_STORE_MIN_ROWS``), both paths the server takes."""
    from dsv4_sm120.kernels.mqa_logits import INLINE_STORE_MIN_ROWS, bf16_paged_mqa_logits, paged_mqa_logits_ref

    width, h = 8192, 64
    n_pages = width // PAGE_SLOTS
    worst, top_same, untouched, runs = 0.0, True, True, []
    for lens in ([1, 63, 513, 4000], [1, 63, 513, 4000] * (INLINE_STORE_MIN_ROWS // 4)):
        pages = torch.randn(len(lens) * n_pages, PAGE_SLOTS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        q = torch.randn(len(lens), h, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        w = torch.randn(len(lens), h, generator=gen, device="cuda")
        pt = torch.randperm(pages.shape[0], generator=gen, device="cuda").view(len(lens), n_pages).to(torch.int32)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = torch.full((len(lens), width), float("nan"), device="cuda")
        runs.append(lambda q=q, pages=pages, w=w, sl=sl, pt=pt, out=out:
                    bf16_paged_mqa_logits(q, pages, w, sl, pt, width, out=out))
        runs[-1]()
        ref = paged_mqa_logits_ref(q, pages, w, sl, pt, width, dtype=torch.float64)
        live = torch.isfinite(ref)
        err = float((out[live] - ref[live]).norm() / ref[live].norm())
        worst = max(worst, err if not bool(out[live].isnan().any()) else float("inf"))
        top_same &= all(set(torch.topk(out[r, :n], min(512, n)).indices.tolist())
                        == set(torch.topk(ref[r, :n], min(512, n)).indices.tolist()) for r, n in enumerate(lens))
        untouched &= bool(out[~live].isnan().all())
    ok = worst <= REL_ERR_LIMIT and top_same and untouched
    return ok, f"rel err {worst:.1e}, top-512 {'identical' if top_same else 'DIFFERENT'}, 4 and 16 rows" + (
        "" if untouched else "; wrote past a row's length"), runs[0]


def _check_two_stage(gen) -> tuple[bool, str, object]:
    """The two-stage indexer (not yet used by serving) on decode rows of 1 to 4000 keys at width 8192: stage 1
    against its fp8 reference, stage 2 against the bf16 one, and the selection (margin 512) against bf16's."""
    from dsv4_sm120.kernels.mqa_logits import paged_mqa_logits_ref
    from dsv4_sm120.kernels.two_stage_logits import (_candidates, _live_lengths, fp8_paged_mqa_logits,
                                                     fp8_paged_mqa_logits_ref, rescore_candidates,
                                                     rescore_candidates_ref, two_stage_topk)

    width, h, lens = 8192, 64, [1, 63, 513, 4000]
    n_pages = width // PAGE_SLOTS
    pages = torch.randn(len(lens) * n_pages, PAGE_SLOTS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(len(lens), h, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(len(lens), h, generator=gen, device="cuda")
    pt = torch.randperm(pages.shape[0], generator=gen, device="cuda").view(len(lens), n_pages).to(torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    args = (q, pages, w, sl, pt, width)
    stage1 = torch.full((len(lens), width), float("nan"), device="cuda")
    fp8_paged_mqa_logits(*args, out=stage1)
    ref1 = fp8_paged_mqa_logits_ref(*args)
    live = torch.isfinite(ref1)
    err1 = float((stage1[live] - ref1[live]).norm() / ref1[live].norm())
    err1 = float("inf") if stage1[live].isnan().any() else err1
    cand = _candidates(stage1, _live_lengths(sl, width), 1024)
    scores = rescore_candidates(q, pages, w, sl, pt, cand, width)
    ref2 = rescore_candidates_ref(q, pages, w, sl, pt, cand, width)
    scored = torch.isfinite(ref2)
    same_live = bool(torch.equal(torch.isfinite(scores), scored))
    err2 = float((scores[scored] - ref2[scored]).norm() / ref2[scored].norm())
    run = lambda: two_stage_topk(*args)  # noqa: E731
    sel = run()
    bf16 = paged_mqa_logits_ref(*args, dtype=torch.float64)
    same = all(set(sel[r][sel[r] >= 0].tolist()) == set(torch.topk(bf16[r, :n], min(512, n)).indices.tolist())
               for r, n in enumerate(lens))
    untouched = bool(stage1[~live].isnan().all())
    ok = err1 <= FP8_REL_ERR_LIMIT and err2 <= REL_ERR_LIMIT and same_live and same and untouched
    detail = (f"fp8 scan rel err {err1:.1e}, bf16 re-score rel err {err2:.1e}, "
              f"top-512 {'identical to bf16' if same else 'DIFFERENT from bf16'}")
    detail += ("" if untouched else "; wrote past a row's length") + ("" if same_live else "; wrong candidates scored")
    return ok, detail, run


def _check_checksum(gen) -> tuple[bool, str, object]:
    from dsv4_sm120.kernels.page_checksum import page_checksum, page_checksum_ref

    rows = torch.randint(0, 256, (64, 16384), generator=gen, device="cuda", dtype=torch.int64).to(torch.uint8)
    run = lambda: page_checksum(rows)  # noqa: E731
    same = bool(torch.equal(run(), page_checksum_ref(rows)))
    return same, "bit-exact" if same else "checksums differ from the reference", run


def _check_copy(gen) -> tuple[bool, str, object]:
    from dsv4_sm120.kernels.page_copy import copy_pages, copy_pages_ref

    src = torch.randint(-2**31, 2**31 - 1, (32, 4096), generator=gen, device="cuda", dtype=torch.int64).to(torch.int32)
    host = torch.zeros((32, 4096), dtype=torch.int32, pin_memory=True)
    ref = torch.zeros((32, 4096), dtype=torch.int32)
    si = torch.randperm(32, generator=gen, device="cuda")[:16].to(torch.int32)
    di = torch.randperm(32, generator=gen, device="cuda")[:16].to(torch.int32)
    run = lambda: copy_pages(src, host, si, di)  # noqa: E731
    run()
    torch.cuda.synchronize()
    copy_pages_ref(src, ref, si, di)
    same = bool(torch.equal(host, ref))
    return same, "bit-exact, device to pinned host" if same else "copied pages differ", run


CHECKS = (("index_k_store", _check_store), ("index_query", _check_query), ("query_store", _check_query_store),
          ("mqa_logits", _check_logits), ("two_stage", _check_two_stage),
          ("page_checksum", _check_checksum), ("page_copy", _check_copy))


def run_all() -> list[Result]:
    """Every kernel once on the current CUDA device; an exception counts as a failure of that kernel."""
    device = torch.cuda.get_device_name()
    cap = ".".join(map(str, torch.cuda.get_device_capability()))
    results = []
    for name, check in CHECKS:
        gen = torch.Generator(device="cuda").manual_seed(7)
        t0 = time.perf_counter()
        try:
            ok, detail, fn = check(gen)
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            second = _timed(fn)[1]
        except Exception as exc:  # a kernel that does not build or launch here is this check's answer
            ok, detail, first, second = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", 0.0, 0.0
        results.append(Result(name, device, cap, ok, detail, first, second))
    return results


def main(*, as_json: bool = False, require_gpu: bool = False) -> int:
    """Print one line per kernel (or a JSON list); 1 on any failure, and without a GPU only if required."""
    import json

    if not torch.cuda.is_available():
        msg = "no CUDA device: the kernel selftest needs a GPU (sm_90 or sm_120); nothing was run"
        print(json.dumps({"selftest": "not run", "reason": msg}) if as_json else msg)
        return 1 if require_gpu else 0
    import triton

    results = run_all()
    if as_json:
        print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                          "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(f"kernel selftest: torch {torch.__version__}, triton {triton.__version__}")
        for r in results:
            print(r.line())
    return 0 if all(r.ok for r in results) else 1


"""The two-stage indexer kernels (``kernels/two_stage_logits.py``) against their torch references, on the CPU
through Triton's interpreter (16 heads, rows of a few pages, top-k of 32 so that a margin can matter).

Under the interpreter stage 1 multiplies the e4m3 values in fp32 (``FP32_DOT``) and rounds them to e4m3 with
``e4m3_rne`` (the interpreter's float8e4nv cast truncates); the GPU path (fp8 tensor cores, the hardware
cast) is compiled for sm_90 and sm_120 by test_aot_compile.py and run only by ``doctor --selftest``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels.helpers import D, PAGE, logits_case

LENS = [1, 63, 64, 65, 200, 320]
TOPK = 32


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _near_tied_case(gen, lens=(320, 256, 200), heads=16):
    """Keys that fp8 cannot rank: one shared random key plus a perturbation of 3% of its size, well under
    e4m3's spacing (1/16 to 1/8 of a value) and over bf16's (1/256 to 1/128), so the keys' e4m3 copies
    are mostly equal and stage 1's order is close to arbitrary where bf16's is not."""
    q, w, pages, sl, pt = logits_case(list(lens), heads, gen)
    base = torch.randn(D, generator=gen)
    pages = (base + 0.03 * torch.randn(pages.shape, generator=gen)).to(torch.bfloat16)
    return q, w, pages, sl, pt


def _bf16_selection(kern, q, w, pages, sl, pt, width, topk=TOPK):
    """The single-stage selection: the bf16 reference's logits, then torch.topk, as sorted lists."""
    ref = kern.mqa_logits.paged_mqa_logits_ref(q, pages, w, sl, pt, width, dtype=torch.float64)
    return [sorted(torch.topk(ref[r, :n], min(topk, n)).indices.tolist())
            for r, n in enumerate(sl.clamp(max=width).tolist())]


def _as_lists(sel):
    return [row[row >= 0].tolist() for row in sel]


# --------------------------------------------------------------------------- stage 1
@triton.jit
def _quantize_tile_kernel(k_ptr, v_ptr, s_ptr, PAGE: tl.constexpr, D: tl.constexpr, quantize: tl.constexpr):
    offs = tl.arange(0, PAGE)
    tile = offs[:, None] * D + tl.arange(0, D)[None, :]
    k8, scale = quantize(tl.load(k_ptr + tile), True)
    tl.store(v_ptr + tile, k8)
    tl.store(s_ptr + offs, scale)


def test_key_tile_quantization_is_torchs_e4m3_bit_for_bit(kern):
    """The in-kernel key quantization (interpreter path) against torch's: heavy-tailed rows, a zero row, and
    rows of amax 448 (scale 1) whose bf16 values include every kind of e4m3 tie, normal and subnormal."""
    g = _gen(1)
    rows = torch.randn(PAGE, D, generator=g) * torch.exp(2 * torch.randn(PAGE, 1, generator=g))
    rows[0] = 0.0
    bits = torch.randint(0, 0x43E0, (16, D), generator=g, dtype=torch.int32)  # bf16 magnitudes up to 448
    exact = (bits | (torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) << 15)).to(torch.int16)
    rows[1:17] = exact.view(torch.bfloat16).float()
    rows[1:17, 0] = 448.0
    # ties: 1.0 | 1.125, 1.125 | 1.25, subnormal 2^-9 | 2^-8 twice, 2^-6 - 2^-10 (to 2^-6); then 416, 432
    rows[17] = 0.0
    rows[17, :7] = torch.tensor([1.0625, 1.1875, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-6 - 2.0**-10, 416.0, 432.0])
    rows[17, 8] = 448.0
    k = rows.to(torch.bfloat16)
    values, scales = torch.empty(PAGE, D), torch.empty(PAGE)
    ts = kern.two_stage_logits
    _quantize_tile_kernel[(1,)](k, values, scales, PAGE=PAGE, D=D, quantize=ts._quantize_keys)
    want, want_scale = ts.quantize_fp8_ref(k)
    assert torch.equal(scales, want_scale)
    assert torch.equal(values, want.float())
    assert values[17, :4].tolist() == [1.0, 1.25, 2.0**-8, 2.0**-8]  # ties to even


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_stage1_matches_its_fp8_reference(kern, rows_per_program):
    ts = kern.two_stage_logits
    q, w, pages, sl, pt = logits_case(LENS, 16, _gen(2))
    width = 330  # past the longest row, not a multiple of the page
    out = torch.full((len(LENS), width), float("nan"))
    ts.fp8_paged_mqa_logits(q, pages, w, sl, pt, width, out=out, rows_per_program=rows_per_program)
    ref = ts.fp8_paged_mqa_logits_ref(q, pages, w, sl, pt, width)
    live = torch.isfinite(ref)
    assert not out[live].isnan().any(), "every live key scored"
    assert out[~live].isnan().all(), "nothing written past a row's length"
    assert (out[live] - ref[live]).norm() / ref[live].norm() < 1e-6  # fp32 sums of exact e4m3 products
    bf16 = kern.mqa_logits.paged_mqa_logits_ref(q, pages, w, sl, pt, width)
    assert (out[live] - bf16[live]).norm() / bf16[live].norm() > 1e-4, "stage 1 is not the bf16 score"


def test_stage1_prefill_rows_of_two_requests_score_as_one_row_each(kern):
    """Groups of 4 rows whose page tables differ (a request boundary inside a group, a row with a page of its
    own, a short last group) score exactly as one row per program does."""
    ts = kern.two_stage_logits
    g = _gen(3)
    n, heads = 22, 16
    q = torch.randn(n, heads, D, generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g)
    pages = torch.randn(9, PAGE, D, generator=g).to(torch.bfloat16)
    perm = torch.randperm(9, generator=g).to(torch.int32)
    pt = perm[:2][None].expand(n, -1).contiguous()
    pt[9:] = perm[2:4]
    pt[13, 0] = perm[5]
    sl = torch.tensor([40 + 4 * r if r < 9 else 70 + 3 * r for r in range(n)], dtype=torch.int32)
    a, b = torch.full((n, 128), float("nan")), torch.full((n, 128), float("nan"))
    ts.fp8_paged_mqa_logits(q, pages, w, sl, pt, 128, out=a, rows_per_program=4)
    ts.fp8_paged_mqa_logits(q, pages, w, sl, pt, 128, out=b, rows_per_program=1, splits=2)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# --------------------------------------------------------------------------- stage 2
def test_stage2_scores_are_the_bf16_scores_of_the_candidates(kern):
    """Candidates anywhere (-1, past a row's length, repeated) get the bf16 reference's score, -inf where they
    are no live key; under the interpreter bit for bit the single-stage kernel's logits at those keys."""
    ts = kern.two_stage_logits
    g = _gen(4)
    q, w, pages, sl, pt = logits_case(LENS, 16, g)
    width = 320
    cand = torch.randint(-1, width + 10, (len(LENS), 100), generator=g, dtype=torch.int32)
    scores = ts.rescore_candidates(q, pages, w, sl, pt, cand, width)
    ref = ts.rescore_candidates_ref(q, pages, w, sl, pt, cand, width)
    live = torch.isfinite(ref)
    assert live.any() and (~live).any()
    assert torch.equal(torch.isfinite(scores), live) and (scores[~live] == float("-inf")).all()
    assert (scores[live] - ref[live]).norm() / ref[live].norm() < 1e-5
    single = torch.full((len(LENS), width), float("nan"))
    kern.mqa_logits.bf16_paged_mqa_logits(q, pages, w, sl, pt, width, out=single)
    assert torch.equal(scores[live], single.gather(1, cand.long().clamp(0, width - 1))[live])


# --------------------------------------------------------------------------- the selection
@pytest.mark.parametrize("case", ["random", "near_tied"])
def test_two_stage_selects_what_bf16_selects_when_the_margin_covers_the_keys(kern, case):
    ts = kern.two_stage_logits
    q, w, pages, sl, pt = logits_case(LENS, 16, _gen(5)) if case == "random" else _near_tied_case(_gen(6))
    width = int(sl.max())
    sel = ts.two_stage_topk(q, pages, w, sl, pt, width, topk=TOPK, margin=width - TOPK)
    assert _as_lists(sel) == _bf16_selection(kern, q, w, pages, sl, pt, width)


def test_two_stage_with_a_margin_of_the_topk_selects_what_bf16_selects_on_random_keys(kern):
    ts = kern.two_stage_logits
    q, w, pages, sl, pt = logits_case(LENS, 16, _gen(7))
    sel = ts.two_stage_topk(q, pages, w, sl, pt, 320, topk=TOPK, margin=TOPK)
    assert _as_lists(sel) == _bf16_selection(kern, q, w, pages, sl, pt, 320)
    assert torch.equal(sel, ts.two_stage_topk_ref(q, pages, w, sl, pt, 320, topk=TOPK, margin=TOPK))


def test_a_margin_of_0_misses_bf16s_selection_where_fp8_cannot_rank_the_keys(kern):
    """The case above that only the re-score gets right: with no margin stage 2 can only reorder stage 1's
    top-k, which is not bf16's, so this test fails if stage 1 ranked as bf16 does (and the margin tests would
    then show nothing)."""
    ts = kern.two_stage_logits
    q, w, pages, sl, pt = _near_tied_case(_gen(6))
    width = int(sl.max())
    want = _bf16_selection(kern, q, w, pages, sl, pt, width)
    got = _as_lists(ts.two_stage_topk(q, pages, w, sl, pt, width, topk=TOPK, margin=0))
    assert all(a != b for a, b in zip(got, want))
    overlap = [len(set(a) & set(b)) / TOPK for a, b in zip(got, want)]
    assert max(overlap) < 0.9, overlap


@pytest.mark.parametrize("margin", [0, 8, 1000])
def test_serving_logits_lead_upstreams_transform_to_the_two_stage_selection(kern, margin):
    """What serving hands upstream's top-k transform: candidates at their bf16 scores, every other key -inf, so
    the transform's best top-k (torch.topk here, as upstream's torch backend) is :func:`two_stage_topk`'s
    selection. Near-tied keys, where stage 1's scores of the keys left out would outrank re-scored
    candidates if they stayed in the logits."""
    ts = kern.two_stage_logits
    q, w, pages, sl, pt = _near_tied_case(_gen(6), lens=(320, 256, 200, 30))
    width = 288
    out = torch.full((len(sl), width), 7.0)  # the forward's buffer, holding another layer's logits
    logits = ts.two_stage_paged_mqa_logits(q, pages, w, sl, pt, width, out=out, topk=TOPK, margin=margin)
    assert logits is out
    live = sl.clamp(max=width).tolist()
    got = [sorted(torch.topk(logits[r, :n], min(TOPK, n)).indices.tolist()) for r, n in enumerate(live)]
    assert got == _as_lists(ts.two_stage_topk(q, pages, w, sl, pt, width, topk=TOPK, margin=margin))
    finite = torch.isfinite(logits).sum(1).tolist()
    assert finite == [min(n, TOPK + margin) for n in live]  # the candidates' scores only
    ref = kern.mqa_logits.paged_mqa_logits_ref(q, pages, w, sl, pt, width, dtype=torch.float64)
    assert torch.allclose(logits[3, :30], ref[3, :30].float(), rtol=1e-3, atol=1e-3)  # a short row: all exact


def test_two_stage_output_contract(kern):
    """int32 [rows, topk]: ascending live key indices, -1 after; a row of at most topk keys gets 0 .. n - 1 (as
    upstream's transform), an empty row only -1, a row longer than the width only keys under the width."""
    ts = kern.two_stage_logits
    lens = [0, 5, TOPK, 200, 400]
    q, w, pages, sl, pt = logits_case(lens, 16, _gen(8))
    width = 256
    sel = ts.two_stage_topk(q, pages, w, sl, pt, width, topk=TOPK, margin=16)
    assert sel.dtype == torch.int32 and tuple(sel.shape) == (len(lens), TOPK)
    assert sel[0].tolist() == [-1] * TOPK
    assert sel[1].tolist() == list(range(5)) + [-1] * (TOPK - 5)
    assert sel[2].tolist() == list(range(TOPK))
    for row in sel[3:]:
        assert (row >= 0).all() and (row < width).all() and (row.diff() > 0).all()
    assert torch.equal(sel, ts.two_stage_topk_ref(q, pages, w, sl, pt, width, topk=TOPK, margin=16))
    assert tuple(ts.two_stage_topk(q, pages, w, sl, pt, width).shape) == (len(lens), ts.TOPK)  # 512 of at most 256


def test_two_stage_bad_input(kern):
    ts = kern.two_stage_logits
    q, w, pages, sl, pt = logits_case([70, 9], 16, _gen(9))
    with pytest.raises(ValueError, match="rows_per_program"):
        ts.fp8_paged_mqa_logits(q, pages, w, sl, pt, 80, rows_per_program=2)
    with pytest.raises(ValueError, match="cand"):
        ts.rescore_candidates(q, pages, w, sl, pt, torch.zeros(3, 4, dtype=torch.int32), 80)
    with pytest.raises(ValueError, match="margin"):
        ts.two_stage_topk(q, pages, w, sl, pt, 80, margin=-1)
    with pytest.raises(ValueError, match="bf16"):
        ts.two_stage_topk(q.float(), pages, w, sl, pt, 80)

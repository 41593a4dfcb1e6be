"""bench/indexer/precision.py on tiny shapes: its reference is its own, the fp8 scorer is upstream's formula, the
two-stage path selects exactly what bf16 does once its margin covers every key, and a two-stage path with its
re-scoring skipped (a planted fault) fails the equality that the table reports."""

from __future__ import annotations

import pytest
import torch

from bench.indexer import precision as p

KEYS, ROWS = 4096, 8


@pytest.fixture(scope="module", params=sorted(p.GENERATORS))
def scored(request):
    draw = p.Draw(p.GENERATORS[request.param], KEYS, torch.Generator().manual_seed(7))
    return draw, p.score_all(draw, ROWS, KEYS)


def test_the_reference_recalls_itself_and_bf16_equals_itself(scored):
    draw, _ = scored
    table, _ = p.measure(draw, ROWS, KEYS)
    by = {r["scorer"]: r for r in table}
    assert by["fp64"]["recall_worst"] == 1.0
    assert by["bf16"]["equal_to_bf16"] == 1.0
    assert by["bf16"]["recall_mean"] < 1.0  # bf16 rounding moves some keys across rank 512 at all


def test_a_margin_over_every_key_selects_the_bf16_keys(scored):
    _, s = scored
    bf16 = p.top_k(s["bf16"])
    sel = p.two_stage(s["stage1_fp8_from_bf16"], s["bf16"], margins=(KEYS - p.TOPK,))[KEYS - p.TOPK]
    assert bool(p.same_rows(sel, bf16).all())


def test_equality_at_a_margin_is_the_margin_needed(scored):
    _, s = scored
    bf16 = p.top_k(s["bf16"])
    need = p.margin_needed(s["stage1_fp8_from_bf16"], bf16)
    for m, sel in p.two_stage(s["stage1_fp8_from_bf16"], s["bf16"]).items():
        assert torch.equal(p.same_rows(sel, bf16), need <= m), m


def test_skipping_the_rescore_fails_the_equality(scored):
    """The planted fault: stage 2 keeps stage 1's order, so its selection is the fp8 one whatever the margin."""
    _, s = scored
    bf16, m = p.top_k(s["bf16"]), KEYS - p.TOPK
    faulty = p.two_stage(s["stage1_fp8_from_bf16"], s["bf16"], margins=(m,), rescore=False)[m]
    assert float(p.same_rows(faulty, bf16).double().mean()) < 0.5
    assert p.smallest_margin([{"scorer": f"two_stage m={mm}", "equal_to_bf16": 0.0} for mm in p.MARGINS]) is None


def test_fp8_quantization_is_upstreams():
    x = torch.tensor([[3.0, -1.5, 0.001] + [0.0] * 125, [0.0] * 128])
    q, scale = p.quantize_fp8(x)
    assert torch.equal(scale, torch.tensor([3.0 / 448, 1e-4 / 448]))  # amax / 448; a zero row keeps 1e-4 / 448
    assert q[0, 0] == 448 and q[0, 1] == -224  # the row's amax lands on e4m3's largest value
    assert q[0, 2] == torch.tensor(0.001 * 448 / 3).to(torch.float8_e4m3fn).float()
    assert not bool(q[1].any())


def test_fp8_scorer_matches_upstreams_torch_logits():
    """Upstream's own torch fp8 logits (bf16 products) on a page cache holding the same fp8 keys and scales."""
    indexer = pytest.importorskip("sglang.srt.layers.attention.dsv4.indexer")
    gen = torch.Generator().manual_seed(3)
    n, rows = 256, 3
    k8, k_scale = p.quantize_fp8(torch.randn((n, p.D), generator=gen))
    q8, q_scale = p.quantize_fp8(torch.randn((rows, p.H, p.D), generator=gen))
    w = torch.randn((rows, p.H), generator=gen) * p.WEIGHT_SCALE * q_scale
    pages = torch.cat((k8.to(torch.float8_e4m3fn).view(torch.uint8).view(n // 64, 64 * p.D),
                       k_scale.view(torch.uint8).view(n // 64, 64 * 4)), 1).view(n // 64, 64, 1, p.D + 4)
    theirs = indexer.fp8_paged_mqa_logits_torch(
        q8.to(torch.float8_e4m3fn)[:, None], pages, w, torch.full((rows,), n), torch.arange(n // 64).repeat(rows, 1),
        None, n, clean_logits=False)
    ours = p.logits(q8, k8, w, k_scale)
    assert float((theirs - ours).norm() / ours.norm()) < 1e-2  # theirs rounds each head's product to bf16

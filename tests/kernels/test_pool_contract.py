"""Store and logits kernels agree with the memory pool on the bf16 page layout.

Write through one, read through the other: the real DSV4 pool is built by
upstream's ``configure()`` on the CPU (the memory area's harness,
tests/index_k/pool_harness.py, fixture ``kv`` in conftest.py), with ``--model-impl dsv4`` and bf16 index keys;
the kernels run through Triton's interpreter (no GPU here).
"""

from __future__ import annotations

import torch

from tests.kernels.helpers import D, PAGE, freqs_cis

C4_LAYER = 0  # tiny checkpoint: compress ratios [4, 128, 4, 128]


def test_kernel_constants_are_the_pool_contract(kern):
    from dsv4_sm120.index_k import layout as pool_layout

    k = kern.layout
    assert (k.PAGE_SLOTS, k.HEAD_DIM, k.ROW_BYTES, k.PAGE_BYTES) == (
        pool_layout.SLOTS_PER_PAGE, pool_layout.INDEX_HEAD_DIM, pool_layout.BF16_BYTES_PER_TOKEN,
        pool_layout.BF16_PAGE_ROW_BYTES)


def test_store_kernel_writes_what_the_pool_reads(kv, kern):
    from dsv4_sm120.index_k import layout as pool_layout

    g = torch.Generator().manual_seed(21)
    pages = kv.index_k_pages_bf16(C4_LAYER)
    n_slots = pages.shape[0] * PAGE
    slots = torch.tensor([0, 1, 63, 64, 65, 127, 128, n_slots - 1], dtype=torch.int64)
    x = torch.randn(len(slots), D, generator=g).to(torch.bfloat16)
    kw = dict(norm_weight=torch.ones(D), norm_eps=1e-6, freqs=freqs_cis(256, g),
              positions=torch.arange(len(slots)) * 4)
    kern.index_k_store.store_index_k_bf16(x, pages, slots, **kw)
    expect = torch.zeros((1 + n_slots // PAGE, PAGE, D), dtype=torch.bfloat16)
    kern.index_k_store.store_index_k_bf16_ref(x, expect, slots, **kw)
    rows = kv.index_k_page_rows(C4_LAYER)  # the uint8 page rows PD registers and HiCache mirrors
    for slot in slots.tolist():
        page, offset = pool_layout.slot_address(slot)
        want = expect[slot // PAGE, slot % PAGE]
        assert torch.equal(rows[page, offset : offset + 256], want.view(torch.uint8)), f"slot {slot}"


def test_logits_kernel_reads_what_the_pool_wrote(kv, kern):
    g = torch.Generator().manual_seed(22)
    pages = kv.index_k_pages_bf16(C4_LAYER)
    n_pages = pages.shape[0]
    # one request of 150 compressed keys spread over 3 non-adjacent pages
    table = torch.tensor([n_pages - 1, 2, 0], dtype=torch.int32)
    positions = torch.arange(150)
    slots = table.long()[positions // PAGE] * PAGE + positions % PAGE
    keys = torch.randn(150, D, generator=g).to(torch.bfloat16)
    kv.set_index_k_bf16(C4_LAYER, slots, keys)
    q = torch.randn(1, 16, D, generator=g).to(torch.bfloat16)
    w = torch.randn(1, 16, generator=g)
    out = torch.full((1, 192), float("nan"))
    kern.mqa_logits.bf16_paged_mqa_logits(q, kv.index_k_pages_bf16(C4_LAYER), w,
                                          torch.tensor([150], dtype=torch.int32), table[None], 192, out=out)
    want = ((keys.double() @ q[0].double().T).clamp_min(0) * w[0].double()).sum(-1)
    torch.testing.assert_close(out[0, :150].double(), want, rtol=1e-5, atol=1e-5)
    assert out[0, 150:].isnan().all(), "nothing written past the request's 150 keys"

"""The kernels on a real GPU at serving shapes (``-m gpu``; the H200 run of bench/ records the same checks).

Run on a CUDA machine: ``python -m pytest tests/kernels/test_gpu.py -m gpu -q``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_device")]

PAGE, D, H = 64, 128, 64


def _case(lens, gen, max_len):
    n_pages_row = -(-max_len // PAGE)
    pool = len(lens) * n_pages_row + 5
    pages = torch.randn(pool, PAGE, D, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(len(lens), H, D, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(len(lens), H, generator=gen, device="cuda")
    pt = torch.randperm(pool, generator=gen, device="cuda")[: len(lens) * n_pages_row].view(len(lens), -1)
    return q, w, pages, torch.tensor(lens, dtype=torch.int32, device="cuda"), pt.to(torch.int32)


@pytest.mark.parametrize("inline_store", [False, True])  # the few-rows default and the inline stores from 16 rows on
def test_logits_decode_shape_matches_fp32_reference(inline_store):
    from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits, paged_mqa_logits_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [32768] * 8 + [1, 511, 513, 70001]
    q, w, pages, sl, pt = _case(lens, gen, 70016)
    out = torch.full((len(lens), 70016), float("nan"), device="cuda")
    bf16_paged_mqa_logits(q, pages, w, sl, pt, 70016, out=out, inline_store=inline_store)
    ref = paged_mqa_logits_ref(q, pages, w, sl, pt, 70016, rows_per_chunk=2)
    fin = torch.isfinite(ref)
    assert not out[fin].isnan().any(), "every live element written"
    assert out[~fin].isnan().all(), "nothing written past a row's length"
    assert ((out[fin] - ref[fin]).norm() / ref[fin].norm()) < 1e-5
    for r, n in enumerate(lens):
        k = min(512, n)
        a = set(torch.topk(out[r, :n], k).indices.tolist())
        b = set(torch.topk(ref[r, :n], k).indices.tolist())
        assert len(a & b) / k >= 0.995


def test_layers_sharing_a_bound_logits_call_match_the_wrapper_eager_and_in_a_cuda_graph():
    # the C4 layers of a forward share one LogitsCall (lengths, page table, width, output bound) and
    # its buffer; each layer's logits are read before the next layer writes (here: copied out), in eager calls and
    # when the whole step is one captured graph, and equal the allocating wrapper's bit for bit
    from dsv4_sm120.kernels.mqa_logits import LogitsCall, bf16_paged_mqa_logits

    gen = torch.Generator(device="cuda").manual_seed(1)
    lens, width = [4096, 300, 70001], 70016
    q1, w1, pages1, sl, pt = _case(lens, gen, width)
    q2, w2 = torch.randn_like(q1, dtype=torch.float32).to(torch.bfloat16), torch.randn_like(w1)
    pages2 = torch.randn_like(pages1, dtype=torch.float32).to(torch.bfloat16)
    w1, w2 = w1.unsqueeze(-1), w2.unsqueeze(-1)  # [T, H, 1], as the query returns the head weights
    want = [bf16_paged_mqa_logits(q, p, w, sl, pt, width) for q, p, w in ((q1, pages1, w1), (q2, pages2, w2))]
    out = torch.empty(len(lens), width, device="cuda")
    bound = LogitsCall(sl, pt, width, out)
    seen = [torch.empty_like(out), torch.empty_like(out)]

    def step():
        for layer, (q, p, w) in enumerate(((q1, pages1, w1), (q2, pages2, w2))):
            seen[layer].copy_(bound(q, p, w))

    def check():
        for got, ref in zip(seen, want):
            for r, n in enumerate(lens):
                assert torch.equal(got[r, :n], ref[r, :n])

    step()
    torch.cuda.synchronize()
    check()
    for t in seen:
        t.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in seen:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check()


def test_layers_sharing_a_query_store_call_write_what_the_query_and_the_store_write():
    # a forward's C4 layers share one QueryStoreCall, its positions, slots, plan rows and query buffers bound to
    # the launch once (launch.BoundLaunch): the first layer goes through Triton's launch, the next ones take the
    # direct launch with the bound addresses; every layer's queries, head weights and stored keys equal those of
    # the query's and the store's own calls bit for bit
    from dsv4_sm120.kernels import index_k_store, index_query
    from dsv4_sm120.kernels.query_store import QueryStoreCall
    from tests.kernels.helpers import decode_plan, freqs_cis

    gen = torch.Generator().manual_seed(2)
    seq_lens = [8, 105, 312, 1004, 2047, 8, 64, 4000]  # a key completes where the length is a multiple of 4
    tokens = len(seq_lens)
    qf, kf = freqs_cis(4096, gen).cuda(), freqs_cis(4096, gen).cuda()
    pos = torch.tensor([n - 1 for n in seq_lens], device="cuda")
    out_loc, plan = torch.arange(tokens, device="cuda") * 3 + 1, decode_plan(seq_lens).cuda()
    out = (torch.empty(tokens, H, D, dtype=torch.bfloat16, device="cuda"), torch.empty(tokens, H, 1, device="cuda"))
    call = QueryStoreCall(pos, out, out_loc, plan, "decode")
    for layer in range(3):
        q = torch.randn(tokens, H, D, generator=gen).to(torch.bfloat16).cuda()
        w = torch.randn(tokens, H, generator=gen).to(torch.bfloat16).cuda()
        kv, norm = torch.randn(tokens, D, generator=gen).cuda(), (1 + 0.1 * torch.randn(D, generator=gen)).cuda()
        pool, want_pool = (torch.full((2, PAGE, D), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2))
        index_k_store.store_index_k_bf16(kv, want_pool, out_loc, norm_weight=norm, norm_eps=1e-6, freqs=kf,
                                         mode="decode", plan=plan)
        want = index_query.index_query_bf16(q, w, 0.0110485, qf, pos)
        assert call(q, w, 0.0110485, qf, kv, pool, norm_weight=norm, norm_eps=1e-6, k_freqs=kf) is out
        torch.cuda.synchronize()
        assert torch.equal(out[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(out[1], want[1]), layer
        assert torch.equal(pool.view(torch.int16), want_pool.view(torch.int16)), layer
    assert len(call._plans) == 1


def test_checksum_kernel_is_bitwise_the_reference():
    from dsv4_sm120.kernels.page_checksum import page_checksum, page_checksum_ref

    rows = torch.randint(0, 256, (4096, 16384), dtype=torch.uint8, device="cuda")
    assert torch.equal(page_checksum(rows), page_checksum_ref(rows))


def test_page_copy_between_pinned_host_and_device():
    from dsv4_sm120.kernels.page_copy import copy_pages

    host = torch.randn(256, PAGE, D).to(torch.bfloat16).pin_memory()
    dev = torch.zeros(512, PAGE, D, dtype=torch.bfloat16, device="cuda")
    src = torch.randperm(256, device="cuda")[:100].to(torch.int32)
    dst = torch.randperm(512, device="cuda")[:100].to(torch.int32)
    copy_pages(host, dev, src, dst)
    torch.cuda.synchronize()
    assert torch.equal(dev[dst.long()].cpu(), host[src.long().cpu()])
    back = torch.zeros(256, PAGE, D, dtype=torch.bfloat16).pin_memory()
    copy_pages(dev, back, dst, src)
    torch.cuda.synchronize()
    assert torch.equal(back[src.long().cpu()], host[src.long().cpu()])


def _registered_vram(pages: torch.Tensor):
    """What ``pd_integrity`` reads of a registered VRAM buffer: the NIXL manager's kv_args, by pointer."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_item_lens=[pages.shape[1]], kv_data_ptrs=[pages.data_ptr()],
                           kv_data_lens=[pages.numel()], kv_data_mem_kinds=["VRAM"], gpu_id=pages.device.index or 0)


def test_pd_checksum_reads_registered_vram_pages_by_pointer():
    """The PD integrity check's device path (no sglang needed): rows viewed at the registered
    pointer through ``__cuda_array_interface__``, selected by page index, summed by the kernel,
    equal to the CPU reference of the same bytes; one flipped bit moves exactly that page's sum."""
    import numpy as np

    from dsv4_sm120.index_k import pd_integrity
    from dsv4_sm120.kernels.page_checksum import page_checksum_ref

    pages = torch.randint(0, 256, (300, 16384), dtype=torch.uint8, device="cuda")
    kv_args = _registered_vram(pages)
    order = np.array([5, 0, 299, 17, 128])
    got = pd_integrity._queue_sums(kv_args, [0], order, order).value()[0]
    assert np.array_equal(got, page_checksum_ref(pages.cpu()[torch.as_tensor(order)]).numpy())
    pages[17, 1234] ^= 1
    moved = pd_integrity._queue_sums(kv_args, [0], order, order).value()[0] != got
    assert moved.tolist() == [False, False, False, True, False]


def test_pd_checksum_waits_for_an_early_send_event():
    """An early send is queued before the forward that writes its pages has finished: the prefill's
    checksum must wait on the send's event and see the final bytes."""
    import numpy as np

    from dsv4_sm120.index_k import pd_integrity
    from dsv4_sm120.kernels.page_checksum import page_checksum_ref

    pages = torch.zeros(64, 16384, dtype=torch.uint8, device="cuda")
    kv_args = _registered_vram(pages)
    first = np.array([0])
    pd_integrity._queue_sums(kv_args, [0], first, first).value()  # compile the kernel before the race, not during it
    torch.cuda.synchronize()
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time before the write lands
        pages[7].fill_(9)
        done = torch.cuda.Event()
        done.record(forward)
    got = pd_integrity._queue_sums(kv_args, [0], np.array([7]), np.array([7]), wait_event=done).value()[0]
    final = torch.full((1, 16384), 9, dtype=torch.uint8)
    assert np.array_equal(got, page_checksum_ref(final).numpy())


def test_warmup_leaves_no_compile_for_requests():
    """After compile_for_serving, new request shapes launch only kernels Triton already holds."""
    from dsv4_sm120.kernels import index_k_store, index_query, mqa_logits, page_checksum, query_store, warmup

    first = warmup.compile_for_serving("cuda", heads=H, checksum=True)
    assert first["variants"] == warmup.SERVING_VARIANTS + 1
    assert warmup.compile_for_serving("cuda", heads=H, checksum=True)["compiled"] == 0
    kernels = (mqa_logits._logits_kernel, index_k_store._store_kernel, index_query._query_kernel,
               query_store._query_store_kernel, page_checksum._checksum_kernel)
    before = sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows, width in ((3, 1000), (17, 4097), (1100, 333)):
        q, w, pages, sl, pt = _case([width] * rows, gen, width)
        mqa_logits.bf16_paged_mqa_logits(q, pages, w, sl, pt, width)
    torch.cuda.synchronize()
    assert sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels) == before

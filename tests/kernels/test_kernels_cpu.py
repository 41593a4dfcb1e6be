"""Every kernel against its torch reference, on the CPU through Triton's interpreter (small shapes).

The interpreter's bf16 ``tl.dot`` is wrong on the CPU (Triton 3.8), so the
logits kernel upcasts its exact bf16 operands to fp32 there (``FP32_DOT``);
the products are the same, only the tensor-core path differs, which the H200
run covers (bench/results/kernels/indexer_h200_*.json).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import D, PAGE, check_logits, compress_plan, decode_plan, freqs_cis, heavy_tailed, logits_case, topk_sets


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# --------------------------------------------------------------------------- store
def _store_both(kern, kv, pages_pool, out_loc, **kw):
    a = pages_pool.clone()
    b = pages_pool.clone()
    kern.index_k_store.store_index_k_bf16(kv, a, out_loc, **kw)
    kern.index_k_store.store_index_k_bf16_ref(kv, b, out_loc, **kw)
    return a, b


def _assert_same_bf16(a, b):
    # fp32 kernel vs float64 reference: equal after bf16 rounding except at rare ties
    mismatched = (a.view(torch.int16) != b.view(torch.int16)) & ~(a.isnan() & b.isnan())
    assert mismatched.float().mean() <= 1e-3
    both = ~(a.isnan() | b.isnan())
    assert torch.equal(a.isnan(), b.isnan())
    diff = (a.float() - b.float()).abs()[both]
    assert diff.max() <= 2.0**-7 * b.float()[both].abs().max()


def test_store_rows_writes_exactly_the_addressed_slots(kern):
    g = _gen(1)
    n, pool = 40, 3
    kv = heavy_tailed((n, D), g).to(torch.bfloat16)
    slots = torch.randperm(pool * PAGE, generator=g)[:n]
    slots[[3, 17]] = -1  # skipped
    poison = torch.full((pool, PAGE, D), float("nan"), dtype=torch.bfloat16)
    a, b = _store_both(kern, kv, poison, slots, norm_weight=1 + 0.1 * torch.randn(D, generator=g), norm_eps=1e-6,
                       freqs=freqs_cis(512, g), positions=torch.randint(0, 512, (n,), generator=g))
    _assert_same_bf16(a, b)
    written = torch.zeros(pool * PAGE, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = a.view(-1, D)
    assert not flat[written].isnan().any(), "every addressed slot written"
    assert flat[~written].isnan().all(), "nothing else touched"


def test_store_extend_plan_follows_upstream_addressing(kern):
    g = _gen(2)
    # rows: (seq_len, ragged_id); position = seq_len - 4, slot = out_loc[ragged_id]; -1 = invalid row
    plan_rows = [(4, 0), (8, 5), (-1, 1), (12, 2), (400, 7)]
    out_loc = torch.tensor([10, 3, 64, -1, 0, 129, 5, 77], dtype=torch.int64)
    kv = torch.randn(len(plan_rows), D, generator=g).to(torch.bfloat16)
    poison = torch.full((3, PAGE, D), float("nan"), dtype=torch.bfloat16)
    kw = dict(norm_weight=torch.ones(D), norm_eps=1e-6, freqs=freqs_cis(512, g), mode="extend",
              plan=compress_plan(plan_rows))
    a, b = _store_both(kern, kv, poison, out_loc, **kw)
    _assert_same_bf16(a, b)
    flat = a.view(-1, D)
    # row 0 -> out_loc[0] = 10, row 1 -> out_loc[5] = 129, row 2 invalid, row 3 -> out_loc[2] = 64,
    # row 4 -> out_loc[7] = 77
    assert [int(s) for s in torch.nonzero(~flat.isnan().all(-1)).flatten()] == [10, 64, 77, 129]


def test_store_decode_plan_skips_rows_between_boundaries(kern):
    g = _gen(3)
    seq = [4, 5, 8, 7, 12]
    out_loc = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64)
    kv = torch.randn(len(seq), D, generator=g).to(torch.bfloat16)
    poison = torch.full((1, PAGE, D), float("nan"), dtype=torch.bfloat16)
    a, b = _store_both(kern, kv, poison, out_loc, norm_weight=torch.ones(D), norm_eps=1e-6, freqs=freqs_cis(64, g),
                       mode="decode", plan=decode_plan(seq))
    _assert_same_bf16(a, b)
    assert [int(s) for s in torch.nonzero(~a.view(-1, D).isnan().all(-1)).flatten()] == [1, 3, 5]


def test_store_rejects_a_wrong_pool(kern):
    kv = torch.zeros(2, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 index-K pool"):
        kern.index_k_store.store_index_k_bf16(kv, torch.zeros(2, 64, 132, dtype=torch.uint8), torch.zeros(2),
                                              norm_weight=torch.ones(D), norm_eps=1e-6,
                                              freqs=torch.zeros(8, 64), positions=torch.zeros(2))


# --------------------------------------------------------------------------- query
def test_query_rope_hadamard_matches_ref(kern):
    g = _gen(4)
    q = heavy_tailed((5, 16, D), g).to(torch.bfloat16)
    w = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 63, 200, 511])
    f = freqs_cis(512, g)
    a, wa = kern.index_query.index_query_bf16(q, w, 0.0110485, f, pos)
    b, wb = kern.index_query.index_query_bf16_ref(q, w, 0.0110485, f, pos)
    _assert_same_bf16(a, b)
    assert wa.shape == (5, 16, 1) and wa.dtype == torch.float32
    torch.testing.assert_close(wa, wb)


def test_query_writes_the_buffers_it_is_given_and_refuses_wrong_ones(kern):
    # a forward's C4 layers hand the query their shared buffers; a wrong buffer is refused, clearly
    g = _gen(5)
    q = torch.randn(3, 16, D, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    pos, f = torch.tensor([0, 5, 9]), freqs_cis(64, g)
    want = kern.index_query.index_query_bf16(q, w, 0.0110485, f, pos)
    out = (torch.full((3, 16, D), float("nan")).to(torch.bfloat16), torch.full((3, 16, 1), float("nan")))
    got = kern.index_query.index_query_bf16(q, w, 0.0110485, f, pos, out=out)
    assert got is out and torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    for bad in ((out[0].float(), out[1]), (out[0], out[1][:, :8]), (out[0].transpose(0, 1), out[1])):
        with pytest.raises(ValueError, match="out must be contiguous"):
            kern.index_query.index_query_bf16(q, w, 0.0110485, f, pos, out=bad)


# --------------------------------------------------------------------------- query and store, one launch
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_one_launch_writes_what_the_query_and_the_store_write(kern, mode, monkeypatch):
    g = _gen(6)
    tokens, heads = 5, 16
    q = heavy_tailed((tokens, heads, D), g).to(torch.bfloat16)
    w = torch.randn(tokens, heads, generator=g).to(torch.bfloat16)
    pos = torch.tensor([3, 8, 63, 200, 511])
    qf, kf = freqs_cis(512, g), freqs_cis(512, g)
    kv = heavy_tailed((tokens, D), g).float()
    norm = (1 + 0.1 * torch.randn(D, generator=g)).float()
    out_loc = torch.tensor([1, 70, 3, 130, 5], dtype=torch.int64)
    plan = decode_plan([4, 5, 8, 7, 12]) if mode == "decode" else compress_plan([(4, 0), (8, 3), (-1, 1), (12, 2), (400, 4)])
    pool = torch.full((3, PAGE, D), float("nan"), dtype=torch.bfloat16)

    want_pages = pool.clone()
    kern.index_k_store.store_index_k_bf16(kv, want_pages, out_loc, norm_weight=norm, norm_eps=1e-6, freqs=kf, mode=mode,
                                          plan=plan)
    want = kern.index_query.index_query_bf16(q, w, 0.0110485, qf, pos)

    launched = []
    launch = kern.query_store.Launch.__call__
    monkeypatch.setattr(kern.query_store.Launch, "__call__", lambda self, *t: launched.append(self.kernel) or launch(self, *t))
    out = (torch.full((tokens, heads, D), float("nan")).to(torch.bfloat16), torch.full((tokens, heads, 1), float("nan")))
    call = kern.query_store.QueryStoreCall(pos, out, out_loc, plan, mode)
    got = call(q, w, 0.0110485, qf, kv, pool, norm_weight=norm, norm_eps=1e-6, k_freqs=kf)
    assert got is out and launched == [kern.query_store._query_store_kernel]
    assert torch.equal(out[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(out[1], want[1])
    assert torch.equal(pool.view(torch.int16), want_pages.view(torch.int16))  # NaN slots untouched in both


def test_a_layers_one_launch_reads_only_its_own_tensors_addresses(kern, monkeypatch):
    """A forward binds its buffers (positions, slots, plan rows, the query's outputs) once; a C4 layer's call then
    reads the addresses of its own seven tensors and no layout of those that last (pool view, norm weight, RoPE
    tables), and hands the direct launch every address in the kernel's order, the bound ones as first read; the
    next forward binds through the same binding (where each address goes, worked out once)."""
    from dsv4_sm120.kernels import launch

    g = _gen(8)
    tokens, heads = 2, 16
    qf = kf = freqs_cis(64, g)
    pos, out_loc, plan = torch.tensor([4, 9]), torch.tensor([0, 1]), decode_plan([4, 8])
    pool, norm = torch.zeros(1, PAGE, D, dtype=torch.bfloat16), torch.ones(D)
    out = (torch.empty(tokens, heads, D, dtype=torch.bfloat16), torch.empty(tokens, heads, 1))
    call = kern.query_store.QueryStoreCall(pos, out, out_loc, plan, "decode")

    def layer():  # a layer's own activations: new tensors of one layout
        return (torch.randn(tokens, heads, D, generator=g).to(torch.bfloat16),
                torch.randn(tokens, heads, generator=g).to(torch.bfloat16), torch.randn(tokens, D, generator=g))

    q, w, kv = layer()
    call(q, w, 0.5, qf, kv, pool, norm_weight=norm, norm_eps=1e-6, k_freqs=kf)  # the forward's first layer: its plan
    (bound,) = call._plans.values()
    launched, reads, layouts = [], [], []
    bound.launch.direct["here"] = lambda grid, args: launched.append(args)
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch, "_device_getter", lambda: lambda: "here")
    monkeypatch.setattr(launch, "_DATA_PTR", lambda t: reads.append(t) or t.data_ptr())
    for module in (launch, kern.query_store):
        monkeypatch.setattr(module, "tensor_key", lambda t: layouts.append(t) or (t.shape, t.stride(), t.dtype, t.device))
    q, w, kv = layer()
    call(q, w, 0.5, qf, kv, pool, norm_weight=norm, norm_eps=1e-6, k_freqs=kf)
    assert [id(t) for t in reads] == [id(t) for t in (q, w, qf, kv, norm, kf, pool)] and not layouts
    every = (q, w, out[0], out[1], qf, pos, kv, plan, out_loc, out_loc, norm, kf, pool)  # the kernel's order
    assert launched == [bound.launch.args([t.data_ptr() for t in every] + bound.launch.fixed)]
    # the next forward binds its own buffers through the binding worked out once for the launch and these names
    out2 = (torch.empty_like(out[0]), torch.empty_like(out[1]))
    following = kern.query_store.QueryStoreCall(pos, out2, out_loc, plan, "decode")
    following(q, w, 0.5, qf, kv, pool, norm_weight=norm, norm_eps=1e-6, k_freqs=kf)
    (bound2,) = following._plans.values()
    every = (q, w, out2[0], out2[1], qf, pos, kv, plan, out_loc, out_loc, norm, kf, pool)
    assert bound2.binding is bound.binding and len(bound.launch.bindings) == 1
    assert launched[-1] == bound.launch.args([t.data_ptr() for t in every] + bound.launch.fixed)


def test_a_layout_the_one_launch_does_not_take_makes_the_two_calls(kern):
    g = _gen(7)
    q = torch.randn(2, 16, D, generator=g).to(torch.bfloat16)
    w = torch.randn(2, 16, generator=g).to(torch.bfloat16)
    pos, f = torch.tensor([4, 9]), freqs_cis(64, g)
    kv = torch.randn(2, D, generator=g).to(torch.bfloat16)  # bf16 rows, fp32 norm weight: the store casts per call
    out_loc, plan = torch.tensor([0, 1]), decode_plan([4, 8])
    pool_a, pool_b = (torch.zeros(1, PAGE, D, dtype=torch.bfloat16) for _ in range(2))
    out = (torch.empty(2, 16, D, dtype=torch.bfloat16), torch.empty(2, 16, 1))
    call = kern.query_store.QueryStoreCall(pos, out, out_loc, plan, "decode")
    call(q, w, 0.5, f, kv, pool_a, norm_weight=torch.ones(D), norm_eps=1e-6, k_freqs=f)
    kern.index_k_store.store_index_k_bf16(kv, pool_b, out_loc, norm_weight=torch.ones(D), norm_eps=1e-6, freqs=f,
                                          mode="decode", plan=plan)
    want = kern.index_query.index_query_bf16(q, w, 0.5, f, pos)
    assert torch.equal(pool_a, pool_b) and torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert list(call._plans.values()) == [None]


def test_hadamard_is_orthonormal_so_logits_are_preserved(kern):
    h = kern._common.hadamard_matrix(128)
    torch.testing.assert_close(h @ h.T, torch.eye(128, dtype=torch.float64))


# --------------------------------------------------------------------------- logits
LENS = [1, 63, 64, 65, 100, 511, 512, 513, 700]


def _logits_both(kern, q, w, pages, sl, pt, max_len, **kw):
    out = torch.full((q.shape[0], max_len), float("nan"))
    kern.mqa_logits.bf16_paged_mqa_logits(q, pages, w, sl, pt, max_len, out=out, **kw)
    ref = kern.mqa_logits.paged_mqa_logits_ref(q, pages, w, sl, pt, max_len, dtype=torch.float64)
    return out, ref


@pytest.mark.parametrize("splits,min_tiles", [(3, 1), (1, 4), (None, 4), (40, 1)])
def test_logits_ragged_lengths_and_page_boundaries(kern, splits, min_tiles):
    q, w, pages, sl, pt = logits_case(LENS, 16, _gen(5))
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 704, splits=splits, min_tiles=min_tiles)
    check_logits(out, ref, LENS)


def test_logits_at_capture_width_touch_only_live_keys(kern):
    # decode at the CUDA-graph capture width: 300 live keys in a row 16384 wide
    lens = [300, 64]
    q, w, pages, sl, pt = logits_case(lens, 16, _gen(11), extra_pages=0)
    pt = torch.cat([pt, torch.full((2, 256 - pt.shape[1]), 10**6, dtype=torch.int32)], 1)  # unused pages: absurd ids
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 16384)
    check_logits(out, ref, lens)


def test_logits_width_not_a_multiple_of_the_page(kern):
    lens = [5, 130]
    q, w, pages, sl, pt = logits_case(lens, 16, _gen(6))
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 131)
    check_logits(out, ref, lens)


def test_logits_64k_plus_keys(kern):
    lens = [65601]
    q, w, pages, sl, pt = logits_case(lens, 16, _gen(7), extra_pages=0)
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 65601)
    check_logits(out, ref, lens)


def test_logits_top512_on_heavy_tailed_data(kern):
    lens = [4096, 2000]
    q, w, pages, sl, pt = logits_case(lens, 64, _gen(8), heavy=True)
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 4096)
    for a, b in zip(topk_sets(out, lens), topk_sets(ref, lens)):
        assert len(a & b) / len(b) >= 0.995


def test_logits_accepts_upstream_shapes(kern):
    # upstream passes q [B, 1, H, D], weights [B, H], seq_lens [B, 1]
    q, w, pages, sl, pt = logits_case([70, 9], 16, _gen(9))
    a, b = torch.full((2, 80), float("nan")), torch.full((2, 80), float("nan"))
    kern.mqa_logits.bf16_paged_mqa_logits(q.unsqueeze(1), pages, w, sl.unsqueeze(1), pt, 80, out=a)
    kern.mqa_logits.bf16_paged_mqa_logits(q, pages, w.unsqueeze(-1), sl, pt, 80, out=b)
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


def _prefill_case(gen, n=70, heads=16, boundary=37, odd_row=41):
    """Causal rows of two requests (the second from row ``boundary``, inside a group of 4), one row with a
    page of its own mid-table, and a last group cut short (70 rows)."""
    q = torch.randn(n, heads, D, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=gen)
    pages = torch.randn(9, PAGE, D, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(9, generator=gen).to(torch.int32)
    pt = perm[:2][None].expand(n, -1).contiguous()
    pt[boundary:] = perm[2:4]
    pt[odd_row, 0] = perm[5]
    lens = [r + 1 if r < boundary else r - boundary + 40 for r in range(n)]
    return q, w, pages, torch.tensor(lens, dtype=torch.int32), pt, lens


@pytest.mark.parametrize("rows_per_program", [2, 4])
@pytest.mark.parametrize("odd_row", [41, 42])  # a row with a page of its own in either half of its group of 4
def test_logits_prefill_rows_per_program_match_one_row(kern, rows_per_program, odd_row):
    q, w, pages, sl, pt, lens = _prefill_case(_gen(12), odd_row=odd_row)
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 128, rows_per_program=rows_per_program)
    check_logits(out, ref, lens)
    one, _ = _logits_both(kern, q, w, pages, sl, pt, 128, rows_per_program=1)
    live = torch.isfinite(ref)
    assert ((out[live] - one[live]).norm() / one[live].norm()) < 1e-6


def test_logits_prefill_path_is_the_default_from_prefill_rows(kern, monkeypatch):
    q, w, pages, sl, pt, lens = _prefill_case(_gen(13), n=13, boundary=6, odd_row=9)
    monkeypatch.setattr(kern.mqa_logits, "PREFILL_ROWS", 8)
    monkeypatch.setattr(kern.mqa_logits, "_PLANS", {})  # plans are kept per layout; this changes what they do
    calls = []
    real = kern.mqa_logits._logits_kernel

    class Spy:
        arg_names = real.arg_names

        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append((grid, kw["R"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kern.mqa_logits, "_logits_kernel", Spy())
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 64)
    check_logits(out, ref, lens)
    assert calls == [((4, 1), kern.mqa_logits.ROWS_PER_PROGRAM)]


@pytest.mark.parametrize("splits,min_tiles", [(4, 1), (3, 2), (40, 1)])
def test_logits_decode_split_counts_agree(kern, splits, min_tiles):
    q, w, pages, sl, pt = logits_case(LENS, 16, _gen(14))
    out, ref = _logits_both(kern, q, w, pages, sl, pt, 704, splits=splits, min_tiles=min_tiles)
    check_logits(out, ref, LENS)


def test_decode_splits_fill_whole_waves(kern):
    split = lambda rows, width, ns=6: kern.mqa_logits.decode_splits(  # noqa: E731
        rows, width, device=torch.device("cpu"), num_stages=ns)
    slots = 3 * 132  # 3 programs per multiprocessor at 6 stages, 132 on the H200 (the CPU stand-in)
    assert split(1, 262144) == slots
    assert split(1, 4096) == 64  # never more programs than the width has pages
    assert split(8, 262144) == slots // 8
    assert split(256, 262144) == 3  # 768 programs in two full waves, not 512 in 1.3
    for rows in (1, 3, 8, 17, 64, 100, 256, 1000):
        sp = split(rows, 262144)
        assert 1 <= sp and rows * sp <= 4 * slots


def _scan_splits(rows, max_splits, slots):
    """The split search tried count by count: every split count up to about 4 waves, the first best kept."""
    upper = min(max_splits, max(1, (4 * slots) // rows))
    best, best_score = 1, -1.0
    for sp in range(1, upper + 1):
        waves = -(-rows * sp // slots)
        score = rows * sp / (waves * slots) - 0.1 * (waves - 1)
        if score > best_score + 1e-9:
            best, best_score = sp, score
    return best


def test_decode_split_search_tries_one_count_per_wave_and_agrees_with_the_scan(kern, monkeypatch):
    ml = kern.mqa_logits
    for slots in (132, 188, 264, 376, 396, 528):
        for rows in (*range(1, 70), 96, 100, 127, 128, 200, 256, 263, 264, 265, 500, 1000, 4096):
            for max_splits in (1, 2, 7, 16, 64, 100, 512, 4096):
                assert ml._search_splits(rows, max_splits, slots) == _scan_splits(rows, max_splits, slots), \
                    (rows, max_splits, slots)
    # an eager decode step of one request meets the search whenever its batch or width changes: it must try a
    # split count per wave, not every one (1,056 of them for one row on an H200)
    tried = []
    monkeypatch.setattr(ml, "cdiv", lambda a, b: tried.append(a) or -(-a // b))
    assert ml._search_splits(1, 4096, 264) == 264
    assert len(tried) <= 12


def test_decode_residency_follows_the_gpus_shared_memory(kern, monkeypatch):
    ml = kern.mqa_logits
    # the H200 figures the decode tunes were taken with (bench/results/kernels/indexer_h200_2026-12-01_tune_*.json)
    assert {ns: ml.resident_programs(ml._HOPPER_132_SM, ns) for ns in range(2, 9)} == {2: 6, 3: 6, 4: 4, 5: 4, 6: 3, 7: 3, 8: 2}
    # sm_120 (RTX PRO 6000: 188 multiprocessors, 100 KiB of shared memory each; its build keeps the queries in
    # registers): one 8-stage program a multiprocessor, so one wave is 188 programs, not 376
    sm120 = dict(major=12, multi_processor_count=188, shared_memory_per_multiprocessor=102400,
                 max_threads_per_multi_processor=1536)
    assert [ml.resident_programs(sm120, ns) for ns in (4, 6, 8)] == [2, 2, 1]
    monkeypatch.setattr(ml, "_device_props", lambda device: sm120)
    monkeypatch.setattr(ml, "_SPLITS", {})  # answers are kept per device; this swaps the device's properties
    assert ml.decode_splits(1, 262144, device=torch.device("cpu"), num_stages=8) == 188
    assert ml.decode_splits(8, 262144, device=torch.device("cpu"), num_stages=8) == 188 // 8


def test_logits_bad_input(kern):
    q, w, pages, sl, pt = logits_case([70], 16, _gen(10))
    with pytest.raises(ValueError, match="q must be bf16"):
        kern.mqa_logits.bf16_paged_mqa_logits(q.float(), pages, w, sl, pt, 80)
    with pytest.raises(ValueError, match="must match"):
        kern.mqa_logits.bf16_paged_mqa_logits(q, pages, w, torch.tensor([1, 2]), pt, 80)


# --------------------------------------------------------------------------- checksum and copy
@pytest.mark.parametrize("row_bytes", [1, 3, 4095, 4096, 4100, 16384])
def test_checksum_kernel_matches_ref_bit_for_bit(kern, row_bytes):
    g = _gen(11)
    rows = torch.randint(0, 256, (4, row_bytes), dtype=torch.uint8, generator=g)
    assert torch.equal(kern.page_checksum.page_checksum_triton(rows), kern.page_checksum.page_checksum_ref(rows))


def test_checksum_catches_flips_swaps_and_stale_slots(kern):
    g = _gen(12)
    page = torch.randint(0, 256, (16384,), dtype=torch.uint8, generator=g)
    variants = []
    for pos in (0, 1, 8191, 16383):  # one byte
        v = page.clone()
        v[pos] ^= 0x01
        variants.append(v)
    v = page.clone()
    a, b = 10, 9000
    if v[a] == v[b]:
        v[a] ^= 0x80
    v[a], v[b] = page[b], page[a]
    variants.append(v)  # swap
    v = page.clone()
    v[256:512] = torch.roll(page[256:512], 1)
    variants.append(v)  # a stale 256-byte slot
    rows = torch.stack([page] + variants)
    sums = kern.page_checksum.page_checksum_triton(rows)
    assert len(set(sums.tolist())) == len(rows)


def test_checksum_on_cpu_uses_the_reference(kern):
    rows = torch.randint(0, 256, (3, 300), dtype=torch.uint8)
    assert torch.equal(kern.page_checksum.page_checksum(rows), kern.page_checksum.page_checksum_ref(rows))
    with pytest.raises(ValueError, match="uint8 rows"):
        kern.page_checksum.page_checksum(rows.float())


def _ledger_state(g, layers=3, host_pages=12):
    expected = torch.randint(-(1 << 62), 1 << 62, (layers, host_pages), dtype=torch.int64, generator=g)
    recorded = torch.randint(0, 2, (layers, host_pages), dtype=torch.uint8, generator=g)
    verified = torch.randint(0, 2, (layers, host_pages), dtype=torch.uint8, generator=g)
    return expected, recorded, verified


def test_ledger_record_and_check_kernels_match_their_references(kern):
    """Record at backup, then the read's report (a page as backed up, one changed, one never recorded, one
    verified before): the Triton kernels and the torch references agree on the report and the ledger state."""
    ledger = kern.page_ledger
    g = _gen(14)
    rows = torch.randint(0, 256, (9, 16384), dtype=torch.uint8, generator=g)
    base = _ledger_state(g)
    base[1][1, 11] = 0  # host page 11: never backed up
    states = [tuple(t.clone() for t in base) for _ in range(2)]
    for kernel, (expected, recorded, verified) in zip((True, False), states):
        ledger.record_pages(rows, torch.tensor([2, 5, 7]), torch.tensor([1, 4, 9]), expected, recorded, verified, 1,
                            kernel=kernel)
    assert all(torch.equal(a, b) for a, b in zip(*states))
    assert states[0][1][1, [1, 4, 9]].tolist() == [1, 1, 1] and states[0][2][1, [1, 4, 9]].tolist() == [0, 0, 0]
    rows[5, 100] ^= 0x10  # host page 4's device page changed after its backup
    spp = 4
    device = cpu_slots([2, 5, 7, 3], spp)
    host = cpu_slots([1, 4, 9, 11], spp)
    reports = [ledger.check_pages(rows, device, host, spp, *state, 1, kernel=kernel)
               for kernel, state in zip((True, False), states)]
    assert torch.equal(reports[0], reports[1])
    assert all(torch.equal(a, b) for a, b in zip(*states))
    verdicts = reports[0][:, 2].tolist()
    assert verdicts[:3] == [0, 1, 0] and reports[0][:, :2].tolist()[:3] == [[1, 2], [4, 5], [9, 7]]
    assert reports[0][:3, 3].tolist() == [1, 1, 1]  # just recorded: their first check
    assert verdicts[3] == 2 and reports[0][3, 3] == 0  # no checksum on record: not a check


def cpu_slots(pages, spp):
    return (torch.tensor(pages)[:, None] * spp + torch.arange(spp)).flatten()


def test_ledger_key_kernels_match_their_references_and_find_a_lost_key(kern):
    ledger = kern.page_ledger
    g = _gen(15)
    keys = torch.randint(0, 256, (64 * 4, 256), dtype=torch.uint8, generator=g)
    slots = torch.tensor([3, -1, 70, 200, 201])
    sums = ledger.key_sums(keys, slots, kernel=True)
    assert torch.equal(sums, ledger.key_sums(keys, slots, kernel=False))
    keys[200, 7] ^= 0x01  # a load landed on slot 200's page (page 3) after the store
    lost = ledger.lost_keys(keys, slots, sums, 64, kernel=True)
    assert torch.equal(lost, ledger.lost_keys(keys, slots, sums, 64, kernel=False))
    assert lost.tolist() == [-1, -2, -1, 3, -1]


def test_page_copy_kernel_matches_ref(kern):
    g = _gen(13)
    src = torch.randn(6, PAGE, D, generator=g).to(torch.bfloat16)
    a, b = torch.zeros_like(src), torch.zeros_like(src)
    si = torch.tensor([3, 1, 0], dtype=torch.int32)
    di = torch.tensor([0, 5, 2], dtype=torch.int32)
    # the CPU pools are not pinned: call the kernel directly (the wrapper insists on pinned host memory)
    pc = kern.page_copy
    pc._copy_pages_kernel[(3, 4)](pc._words(src), pc._words(a), si, di, PAGE_WORDS=4096, BLOCK=pc.BLOCK)
    pc.copy_pages_ref(src, b, si, di)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="pinned"):
        pc.copy_pages(src, a, si, di)


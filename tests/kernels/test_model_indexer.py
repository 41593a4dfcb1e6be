"""The package's model class wires the bf16 kernels into the C4 indexer.

Real parts: the DSV4 pool with bf16 keys (upstream's configure() on the CPU),
upstream's ``PagedIndexerMetadata``, ``DSATopKBackend`` and its torch top-k
transform, upstream's ``CompressorDecodePlan``, and the Triton kernels (CPU
interpreter). Replaced, because they cannot run here: the indexer's linear
layers (a real ``C4Indexer`` needs a published model runtime and weights; the
stand-ins keep the ``(out, bias)`` call contract), the attention backend object
(only the attributes the indexer reads), and upstream's ``compress_forward``
(a CUDA JIT kernel; the stand-in returns given compressed rows).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import D, PAGE, decode_plan, freqs_cis

C4_LAYER = 0
HEADS = 16


class _Linear(torch.nn.Module):
    """Stand-in for sglang's ReplicatedLinear: returns (x @ W^T, None)."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return (x.float() @ self.w.float().T).to(torch.bfloat16), None


def _indexer(cls, gen, use_fp4=False):
    ind = object.__new__(cls)
    torch.nn.Module.__init__(ind)
    ind.layer_id, ind.n_heads, ind.n_local_heads, ind.head_dim, ind.index_topk = C4_LAYER, HEADS, HEADS, D, 512
    ind.use_fp4_indexer = use_fp4
    ind.weight_scale = D**-0.5 * HEADS**-0.5
    ind.freqs_cis = freqs_cis(4096, gen)
    ind.wq_b = _Linear(torch.randn(HEADS * D, 32, generator=gen) / 6)
    ind.weights_proj = _Linear(torch.randn(HEADS, 48, generator=gen))
    return ind


@pytest.fixture
def env_torch_logits():
    # PagedIndexerMetadata builds DeepGEMM schedules unless upstream's torch-logits switch is on
    old = os.environ.get("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH")
    os.environ["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] = "1"
    yield
    if old is None:
        os.environ.pop("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH")
    else:
        os.environ["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] = old


def test_model_switches_every_c4_indexer(kern):
    from sglang.srt.layers.attention.dsv4.indexer import C4Indexer

    from dsv4_sm120.model.deepseek_v4 import BF16C4Indexer, BF16IndexerUnsupported, use_bf16_indexers

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList([_indexer(C4Indexer, gen), torch.nn.Linear(2, 2), _indexer(C4Indexer, gen)])
    assert use_bf16_indexers(model) == 2
    assert all(type(m) is BF16C4Indexer for m in (model[0], model[2]))
    with pytest.raises(BF16IndexerUnsupported, match="fp4"):
        use_bf16_indexers(torch.nn.ModuleList([_indexer(C4Indexer, gen, use_fp4=True)]))


def _decode_case(kv, seed, *, query_rows=2, chunk_rows=None):
    """Two decode rows, 700 compressed keys (a real top-512) and 300 (fewer than 512), on the real bf16 pool.

    ``query_rows`` > 2 gives x one padding row more than q_lora and positions (graph capture pads so);
    ``chunk_rows`` sets the metadata's ``rows_per_chunk`` as upstream's DeepGEMM path decides it (with the
    torch-logits switch that path is off, so it is set here by hand).
    """
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata

    from dsv4_sm120.model.deepseek_v4 import BF16C4Indexer

    gen = torch.Generator().manual_seed(seed)
    ind = _indexer(BF16C4Indexer, gen)
    pages = kv.index_k_pages_bf16(C4_LAYER)
    lens = [700, 300]
    table = torch.tensor([[5, 1, 9, 2, 7, 0, 3, 4, 6, 8, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]],
                         dtype=torch.int32)
    assert int(table.max()) < pages.shape[0]
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[r].long()[pos // PAGE] * PAGE + pos % PAGE
        kv.set_index_k_bf16(C4_LAYER, slots, torch.randn(n, D, generator=gen).to(torch.bfloat16))
    im = PagedIndexerMetadata(page_size=256, compressed_page_size=PAGE, page_table=table,
                              compressed_seq_lens=torch.tensor(lens, dtype=torch.int32), use_topk_v2=False)
    im.rows_per_chunk = chunk_rows
    out_pages = torch.full((2, 512), -7, dtype=torch.int32)
    core = SimpleNamespace(positions=torch.tensor([2800, 1200]), c4_sparse_page_indices=out_pages,
                           c4_sparse_raw_indices=None)
    backend = SimpleNamespace(token_to_kv_pool=kv, dsa_topk_backend=DSATopKBackend.TORCH,
                              forward_metadata=SimpleNamespace(indexer_metadata=im, core_metadata=core))
    x = torch.randn(query_rows, 48, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(2, 32, generator=gen).to(torch.bfloat16)
    return SimpleNamespace(ind=ind, pages=pages, lens=lens, table=table, im=im, core=core, backend=backend,
                           x=x, q_lora=q_lora, out_pages=out_pages)


def _no_keys(c):
    """A step's compressed keys of which none closes a group of 4 tokens: the store writes nothing."""
    from dsv4_sm120.model.deepseek_v4 import CompressedKeys

    return CompressedKeys(torch.zeros(2, D), c.pages, torch.tensor([0, 1]), decode_plan([5, 6]), "decode",
                          SimpleNamespace(weight=torch.ones(D), variance_epsilon=1e-6), c.ind.freqs_cis)


def _with_compressor(c, seq, out_loc, compressed, monkeypatch):
    """The case's indexer and backend with a compressor whose upstream kernel returns ``compressed``, the
    decode plan of these sequence lengths and these slots."""
    from sglang.kernels.ops.attention.dsv4 import compress as upstream_compress
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    gen = torch.Generator().manual_seed(11)
    monkeypatch.setattr(upstream_compress, "compress_forward", lambda **kw: compressed)
    c.ind.compressor = SimpleNamespace(
        head_dim=D, ape=torch.zeros(4, 2 * D), freqs_cis=freqs_cis(4096, gen),
        norm=SimpleNamespace(weight=1 + 0.1 * torch.randn(D, generator=gen), variance_epsilon=1e-6),
        compute_kv_score=lambda x, fb: x,
        get_state_pool=lambda backend: SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=torch.zeros(8, 4, 512))),
    )
    plan = CompressorDecodePlan(4, decode_plan(seq))
    c.backend._get_paged_compress_metadata = lambda ratio: plan
    c.backend._get_out_loc = lambda ratio: out_loc
    return c


def test_a_layer_on_one_stream_queries_and_stores_its_keys_in_one_launch(kv, kern, env_torch_logits, monkeypatch):
    """Outside a captured multi-stream decode, the query and the bf16 key store are one launch (eager decode's host
    time per C4 layer), and select and store what the two launches do."""
    from dsv4_sm120.kernels import launch as kernel_launch
    from dsv4_sm120.kernels import query_store

    slots = torch.tensor([30 * PAGE + 1, 31 * PAGE + 63], dtype=torch.int64)
    compressed = torch.randn(2, D, generator=torch.Generator().manual_seed(12))
    runs = {}
    for fused in (True, False):
        c = _with_compressor(_decode_case(kv, 7), [8, 12], slots, compressed, monkeypatch)
        c.pages[30:32] = float("nan")
        launched = []
        real = kernel_launch.launch
        monkeypatch.setattr(kernel_launch, "launch", lambda kernel, *a, **kw: launched.append(kernel) or real(kernel, *a, **kw))
        if not fused:
            monkeypatch.setattr(query_store.QueryStoreCall, "_plan", lambda self, *a: query_store._Plan(None))
        _forward(c)
        runs[fused] = (c.out_pages.clone(), c.pages[30:32].clone(), launched)
        monkeypatch.undo()
    (sel, keys, launched), (sel2, keys2, launched2) = runs[True], runs[False]
    assert torch.equal(sel, sel2) and torch.equal(keys.view(torch.int16), keys2.view(torch.int16))
    assert not keys.view(-1, D)[[1, 127]].isnan().any(), "both closed groups stored"
    names = [k.fn.__name__ if hasattr(k, "fn") else k.__name__ for k in launched]
    assert "_query_store_kernel" in names and "_query_kernel" not in names and "_store_kernel" not in names, names


def _forward(c, mode=None, **kw):
    from sglang.srt.layers.attention.dsv4 import indexer as upstream_indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE if mode is None else mode)
    old = upstream_indexer.get_global_indexer_capturer
    upstream_indexer.get_global_indexer_capturer = lambda: None  # no runtime resources published in this process
    try:
        c.ind.forward(c.x, c.q_lora, fb, c.backend, **kw)
    finally:
        upstream_indexer.get_global_indexer_capturer = old


@pytest.mark.parametrize("chunk_rows", [None, 1])
def test_bf16_indexer_selects_the_reference_top512(kv, kern, env_torch_logits, chunk_rows):
    c = _decode_case(kv, 1, chunk_rows=chunk_rows)
    _forward(c, skip_compressor=True)

    # reference: float64 scores from the same bf16 query and keys, top-512 per row, mapped to pool slots
    w, _ = c.ind.weights_proj(c.x)
    q, wq = kern.index_query.index_query_bf16_ref(c.ind.wq_b(c.q_lora)[0].view(2, HEADS, D), w, c.ind.weight_scale,
                                                  c.ind.freqs_cis, c.core.positions)
    ref = kern.mqa_logits.paged_mqa_logits_ref(q, c.pages, wq, c.im.compressed_seq_lens, c.table, 768,
                                               dtype=torch.float64)
    for r, n in enumerate(c.lens):
        k = min(512, n)
        raw = torch.topk(ref[r, :n], k).indices
        want = set((c.table[r].long()[raw // PAGE] * PAGE + raw % PAGE).tolist())
        got = c.out_pages[r]
        assert set(got[:k].tolist()) == want
        assert (got[k:] == -1).all()


def test_two_stage_switch_selects_in_two_stages_where_a_chunk_is_a_prefill(kv, kern, env_torch_logits, monkeypatch):
    """``DSV4_SM120_INDEX_K_SELECT=two_stage``: a chunk of prefill shape over more keys than the re-score takes
    selects what ``two_stage_topk`` selects, through upstream's transform. Near-tied keys (stage 1 cannot rank
    them), so that the single-stage selection differs and the test shows which path ran. The prefill shape
    starts at 2 rows here (PREFILL_ROWS is 1024: too many rows for the interpreter)."""
    from dsv4_sm120.model import deepseek_v4

    c = _decode_case(kv, 3)
    gen = torch.Generator().manual_seed(4)
    lens, table = [1300, 300], torch.zeros(2, 21, dtype=torch.int32)
    table[0], table[1, :5] = torch.arange(21), torch.arange(21, 26)
    base = torch.randn(D, generator=gen)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[r].long()[pos // PAGE] * PAGE + pos % PAGE
        kv.set_index_k_bf16(C4_LAYER, slots, (base + 0.03 * torch.randn(n, D, generator=gen)).to(torch.bfloat16))
    c.im.page_table, c.im.compressed_seq_lens = table, torch.tensor(lens, dtype=torch.int32)
    monkeypatch.setattr(deepseek_v4, "PREFILL_ROWS", 2)
    selections = {}
    for two_stage in (True, False):
        c.ind.two_stage = two_stage
        _forward(c, skip_compressor=True)
        selections[two_stage] = [set(row[row >= 0].tolist()) for row in c.out_pages]
    w, _ = c.ind.weights_proj(c.x)
    q, wq = kern.index_query.index_query_bf16_ref(c.ind.wq_b(c.q_lora)[0].view(2, HEADS, D), w, c.ind.weight_scale,
                                                  c.ind.freqs_cis, c.core.positions)
    sel = kern.two_stage_logits.two_stage_topk(q, c.pages, wq, c.im.compressed_seq_lens, table, 1300)
    want = [set((table[r].long()[row[row >= 0].long() // PAGE] * PAGE + row[row >= 0] % PAGE).tolist())
            for r, row in enumerate(sel)]
    assert selections[True] == want
    assert selections[False][0] != want[0], "stage 1 ranked these keys as bf16 does: the case shows nothing"
    assert selections[False][1] == want[1]  # 300 keys: all re-scored, as the single stage scores them


@pytest.mark.parametrize("chunk_rows", [None, 1])
def test_the_layers_of_a_forward_share_its_topk_inputs(kv, kern, env_torch_logits, monkeypatch, chunk_rows):
    # the C4 layers of a forward share the metadata cut to their rows, the query's and the logits'
    # buffers, and with one chunk a logits call with all of it bound: an eager layer's indexer calls allocate nothing
    from dsv4_sm120.model import deepseek_v4

    outs = []
    real = deepseek_v4.bf16_paged_mqa_logits

    def spy(*args, **kw):
        outs.append(kw.get("out"))
        return real(*args, **kw)

    monkeypatch.setattr(deepseek_v4, "bf16_paged_mqa_logits", spy)
    queries = []
    real_query = deepseek_v4.index_query_bf16
    monkeypatch.setattr(deepseek_v4, "index_query_bf16",
                        lambda *a, out=None: queries.append(out) or real_query(*a, out=out))
    c = _decode_case(kv, 5, chunk_rows=chunk_rows)
    _forward(c, skip_compressor=True)
    inputs = getattr(c.im, deepseek_v4.TOPK_INPUTS)
    first = c.out_pages.clone()
    c.out_pages.fill_(-7)
    _forward(c, skip_compressor=True)  # the next C4 layer of the same forward
    assert torch.equal(c.out_pages, first)
    assert getattr(c.im, deepseek_v4.TOPK_INPUTS) is inputs, "the second layer must take the first one's inputs"
    assert inputs.query is not None and all(out is inputs.query for out in queries) and len(queries) == 2, \
        "each layer's query must be written into the forward's buffers"
    assert inputs.logits.shape == (chunk_rows or 2, c.im.max_compressed_seq_len)
    if chunk_rows is None:
        assert inputs.call is not None and outs == [], "one chunk: the bound call, not the wrapper"
    else:
        assert inputs.call is None and len(outs) == 4
        assert all(o is not None and o.data_ptr() == inputs.logits.data_ptr() for o in outs)
    # metadata that meets other rows (one fewer here) gets inputs of its own
    other = deepseek_v4.topk_inputs(c.im, c.core, 1, 1, c.pages.device)
    assert other is not inputs and other.logits.shape == (1, c.im.max_compressed_seq_len)
    # metadata of fewer rows than the queries is padded: copies, which no later layer takes over
    padded = deepseek_v4.topk_inputs(c.im, c.core, 3, 3, c.pages.device)
    assert padded.padded and deepseek_v4.topk_inputs(c.im, c.core, 3, 3, c.pages.device) is not padded


class _Stream:
    """A CUDA stream as the indexer's multi-stream split uses it, logging each wait and event (no CUDA here)."""

    def __init__(self, name: str, log: list, active: list):
        self.name, self.log, self.active = name, log, active

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event))

    def record_event(self):
        self.log.append((self.name, "records", f"{self.name} event"))
        return f"{self.name} event"


def test_a_captured_decode_keeps_upstreams_multi_stream_split(kv, kern, env_torch_logits, monkeypatch):
    # upstream computes the head weights and the query on two side streams while the keys are
    # compressed and stored; run on one stream, an H200 decode step took 3.7% longer than upstream's
    import contextlib

    from dsv4_sm120.model import deepseek_v4

    log, active = [], []
    current = _Stream("indexer", log, active)
    side = [_Stream("query", log, active), _Stream("weights", log, active)]

    @contextlib.contextmanager
    def on(stream):
        active.append(stream)
        try:
            yield
        finally:
            active.pop()

    def spy(what, fn):
        def run(*a, **kw):
            log.append(((active or [current])[-1].name, "runs", what))
            return fn(*a, **kw)
        return run

    # the compression and bf16 store are upstream's kernel and the package's (tested above); here only where they run
    monkeypatch.setattr(deepseek_v4, "store_index_keys", spy("compression", lambda *a: None))
    single = _decode_case(kv, 6)
    monkeypatch.setattr(deepseek_v4, "compressed_keys", lambda ind, backend, x, fb: _no_keys(single))
    _forward(single)
    want = single.out_pages.clone()
    log.clear()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: (active or [current])[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(deepseek_v4, "index_query_bf16", spy("query", deepseek_v4.index_query_bf16))
    monkeypatch.setattr(deepseek_v4, "run_topk_transform", spy("top-k", deepseek_v4.run_topk_transform))
    real_weights = deepseek_v4.BF16C4Indexer.compute_weights
    monkeypatch.setattr(deepseek_v4.BF16C4Indexer, "compute_weights", spy("weights", real_weights))
    c = _decode_case(kv, 6)
    c.ind.alt_streams = side
    _forward(c, enable_multi_stream=True, q_lora_ready="q_lora ready")
    assert torch.equal(c.out_pages, want), "the split must select what one stream selects"

    ran = {what: stream for stream, verb, what in log if verb == "runs"}
    assert ran == {"weights": "weights", "query": "query", "compression": "indexer", "top-k": "indexer"}, ran
    assert ("query", "waits for", "q_lora ready") in log and ("query", "waits for", "weights event") in log
    assert ("indexer", "waits for", "q_lora ready") not in log, "the compression must not wait for q_lora"
    joined = log.index(("indexer", "waits for", "query"))
    assert log.index(("query", "runs", "query")) < joined < log.index(("indexer", "runs", "top-k"))


def test_compressor_gets_only_the_query_rows(kv, kern, env_torch_logits, monkeypatch):
    # x carries one padding row more than q_lora and positions; upstream trims all three before the compressor
    from dsv4_sm120.model import deepseek_v4

    seen = []
    c = _decode_case(kv, 3, query_rows=3)
    monkeypatch.setattr(deepseek_v4, "compressed_keys",
                        lambda ind, backend, x, fb: seen.append(x.shape[0]) or _no_keys(c))
    _forward(c)
    assert seen == [2], "the compressor must see the rows the query and the metadata have"


def test_chunked_metadata_for_other_rows_is_refused(kv, kern, env_torch_logits):
    # the per-chunk top-k plans were built for the metadata's rows; scoring other rows would misalign them
    c = _decode_case(kv, 4, chunk_rows=1)
    c.im.compressed_seq_lens = torch.tensor([700, 300, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="chunked for 3 query rows but this forward has 2"):
        _forward(c, skip_compressor=True)


def test_bf16_store_path_writes_the_decode_plan_slots(kv, kern, monkeypatch):
    from sglang.kernels.ops.attention.dsv4 import compress as upstream_compress
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dsv4_sm120.model.deepseek_v4 import BF16C4Indexer, store_index_keys

    gen = torch.Generator().manual_seed(2)
    ind = _indexer(BF16C4Indexer, gen)
    seq = [8, 9, 12]  # rows 0 and 2 close a group of 4 tokens; row 1 does not
    out_loc = torch.tensor([3 * PAGE + 1, 3 * PAGE + 2, 4 * PAGE + 63], dtype=torch.int64)
    compressed = torch.randn(3, D, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(upstream_compress, "compress_forward", lambda **kw: compressed)
    comp = SimpleNamespace(
        head_dim=D, ape=torch.zeros(4, 2 * D), freqs_cis=ind.freqs_cis,
        norm=SimpleNamespace(weight=1 + 0.1 * torch.randn(D, generator=gen), variance_epsilon=1e-6),
        compute_kv_score=lambda x, fb: x,
        get_state_pool=lambda backend: SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=torch.zeros(8, 4, 512))),
    )
    ind.compressor = comp
    plan = CompressorDecodePlan(4, decode_plan(seq))
    backend = SimpleNamespace(token_to_kv_pool=kv, _get_paged_compress_metadata=lambda ratio: plan,
                              _get_out_loc=lambda ratio: out_loc)
    pages = kv.index_k_pages_bf16(C4_LAYER)
    pages[3:5] = float("nan")
    store_index_keys(ind, backend, torch.zeros(3, 8), SimpleNamespace(forward_mode=ForwardMode.DECODE))
    expect = torch.full((5, PAGE, D), float("nan"), dtype=torch.bfloat16)
    kern.index_k_store.store_index_k_bf16_ref(compressed, expect, out_loc, norm_weight=comp.norm.weight,
                                              norm_eps=1e-6, freqs=ind.freqs_cis, mode="decode",
                                              plan=decode_plan(seq))
    flat, want = pages.view(-1, D), expect.view(-1, D)
    for slot in (3 * PAGE + 1, 4 * PAGE + 63):
        assert torch.equal(flat[slot], want[slot])
    assert flat[3 * PAGE + 2].isnan().all(), "a row that closes no group is not stored"


def test_integrity_mode_checks_the_pages_the_indexer_reads_just_before_its_logits(kv, kern, env_torch_logits,
                                                                                   monkeypatch):
    """The reader-side check runs where the C4 indexer reads its layer: on the pages it reads, after the load
    fence, before the logits kernel, on the same stream (the test records the order of the calls)."""
    from dsv4_sm120.index_k import integrity
    from dsv4_sm120.model import deepseek_v4

    calls = []

    class Ledger:  # stands in for the process's PageLedger: records what the indexer hands it
        def check_reads(self, layer, rows):
            calls.append(("check", layer, rows.data_ptr(), tuple(rows.shape)))

        def note_writes(self, layer, rows, slots):
            calls.append(("writes", layer))

    real = deepseek_v4.bf16_paged_mqa_logits
    monkeypatch.setattr(deepseek_v4, "bf16_paged_mqa_logits",
                        lambda *a, **k: calls.append(("logits",)) or real(*a, **k))
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.setattr(integrity, "LEDGER", Ledger())
    c = _decode_case(kv, 4, chunk_rows=1)
    _forward(c, ForwardMode.EXTEND, skip_compressor=True)
    layer = kv.layer_mapping[C4_LAYER].compress_layer_id
    assert calls[0] == ("check", layer, c.pages.data_ptr(), (c.pages.shape[0], 64 * 256))
    assert [k[0] for k in calls[1:]] == ["logits", "logits"]  # one per chunk, after the check


def test_integrity_mode_leaves_decode_and_verify_steps_alone(kv, kern, env_torch_logits, monkeypatch):
    """A decode or verify step consumes no HiCache load of its own, but names the load slot of the prefill batch
    its running batch started as (upstream keeps it): the ledger is handed nothing by such a step."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dsv4_sm120.index_k import integrity

    handed = []
    ledger = SimpleNamespace(check_reads=lambda *a: handed.append(a), note_writes=lambda *a: handed.append(a))
    monkeypatch.setattr(integrity, "LEDGER", ledger)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        _forward(_decode_case(kv, 5), mode, skip_compressor=True)
    assert handed == []
    _forward(_decode_case(kv, 5), ForwardMode.EXTEND, skip_compressor=True)
    assert handed  # the control: a prefill's reads are checked


def test_a_loader_that_skips_load_weights_still_gets_upstreams_mhc_prewarm(monkeypatch):
    """The dummy, sharded and remote loaders reach the model's ``post_load_weights`` through sglang's own helper,
    with no arguments, and never the mHC prewarm that ``load_weights`` ends with (a dummy-weight prefill on an
    H100 compiled it inside two serving batches of 16 and 17 s); ``load_weights`` passes its weight names and
    prewarms by itself after this call, so the class adds nothing there."""
    from sglang.srt.model_loader import loader
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    from dsv4_sm120.model.deepseek_v4 import DeepseekV4ForCausalLMSM120

    calls = []
    monkeypatch.setattr(DeepseekV4ForCausalLM, "post_load_weights",
                        lambda self, is_nextn=False, weight_names=None: calls.append(("fix-up", weight_names)))
    monkeypatch.setattr(DeepseekV4ForCausalLM, "_prewarm_mhc_kernels", lambda self: calls.append("prewarm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = object.__new__(DeepseekV4ForCausalLMSM120)
    loader.post_load_weights(model)
    assert calls == [("fix-up", None), "prewarm"]
    calls.clear()
    model.post_load_weights(is_nextn=False, weight_names=["model.layers.0.hc_attn_fn"])
    assert calls == [("fix-up", ["model.layers.0.hc_attn_fn"])]

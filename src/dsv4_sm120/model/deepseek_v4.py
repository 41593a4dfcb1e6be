"""The model class that ``--model-impl dsv4`` resolves to.

A subclass of upstream's ``DeepseekV4ForCausalLM`` so that everything upstream
keys on the checkpoint's architecture (``is_deepseek_v4``, the DSV4 KV pool and
planner, PD and HiCache wiring) still applies; the package's index-key changes
hang off this class and the pools built for it.

With bf16 index keys (``DSV4_SM120_INDEX_K_DTYPE=bf16``, the default) every C4
lightning indexer of the model becomes a :class:`BF16C4Indexer`: its keys are
stored, its queries rotated and its logits scored by the package's Triton
kernels (``dsv4_sm120.kernels``, the same on sm_120 and sm_90) against the bf16
pool's ``index_k_pages_bf16``. Upstream's compression kernel, metadata and top-k
transforms (``--dsa-topk-backend``) are used as they are. Features the bf16
indexer does not carry (hisparse, the fp4 indexer) are refused when the model is
built. With ``fp8`` the model is upstream's, indexer included.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.dsv4 import indexer as upstream_indexer
from sglang.srt.layers.attention.dsv4.indexer import C4Indexer
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.runtime_context import get_memory

from dsv4_sm120.index_k import gate, integrity
from dsv4_sm120.kernels.index_k_store import store_index_k_bf16
from dsv4_sm120.kernels.index_query import index_query_bf16
from dsv4_sm120.kernels.mqa_logits import PREFILL_ROWS, LogitsCall, bf16_paged_mqa_logits
from dsv4_sm120.kernels.two_stage_logits import MARGIN, TOPK, two_stage_paged_mqa_logits
from dsv4_sm120.kernels.query_store import QueryStoreCall

C4_RATIO = 4
logger = logging.getLogger("dsv4_sm120.model")


class BF16IndexerUnsupported(RuntimeError):
    """A feature upstream's fp8 indexer has that the bf16 indexer does not carry."""


class BF16C4Indexer(C4Indexer):
    """C4 indexer over bf16 index keys; the weights and modules are upstream's, unchanged."""

    two_stage = False  # DSV4_SM120_INDEX_K_SELECT=two_stage: long prefill chunks select in two stages

    def compute_q(self, q_lora, positions, weight, q_lora_quant=None, out=None):
        """bf16 query (RoPE + Hadamard, no fp8) and head weights scaled by ``weight_scale``, fp32 [T, H, 1];
        written into ``out`` (the forward's buffers, :meth:`TopkInputs.query_out`) where given."""
        return index_query_bf16(self.query_rows(q_lora, q_lora_quant), weight, self.weight_scale, self.freqs_cis,
                                positions, out=out)

    def query_rows(self, q_lora, q_lora_quant) -> torch.Tensor:
        """Upstream's ``wq_b`` rows as the query kernel reads them: [T, heads, head_dim]."""
        q, _ = self.wq_b(q_lora if q_lora_quant is None else q_lora_quant)
        return q.view(-1, self.n_local_heads, self.head_dim)

    def forward(self, x, q_lora, forward_batch, attn_backend, enable_multi_stream=False, q_lora_ready=None,
                skip_compressor=False, q_lora_quant=None):
        if forward_batch.forward_mode.is_idle():
            return
        positions = attn_backend.forward_metadata.core_metadata.positions
        x, q_lora, q_lora_quant, positions = common_rows(x, q_lora, q_lora_quant, positions)
        inputs = forward_topk_inputs(attn_backend, q_lora)
        streams = self.alt_streams if enable_multi_stream else None
        if streams is not None and len(streams) >= 2:
            q, weights = self.query_beside_compressor(x, q_lora, positions, q_lora_quant, forward_batch, attn_backend,
                                                      inputs, streams, q_lora_ready, skip_compressor)
        else:
            if q_lora_ready is not None:  # produced on another stream; everything here runs on the current one
                torch.cuda.current_stream().wait_event(q_lora_ready)
            if skip_compressor:
                q, weights = self.query(q_lora, positions, self.compute_weights(x, skip_scale=True), q_lora_quant,
                                        inputs)
            else:
                q, weights = self.query_and_store(x, q_lora, positions, q_lora_quant, forward_batch, attn_backend,
                                                  inputs)
        select_topk(self, attn_backend, inputs, q, weights, checked=reads_checked(forward_batch))

    def query_and_store(self, x, q_lora, positions, q_lora_quant, forward_batch, attn_backend,
                        inputs: "TopkInputs") -> tuple:
        """On one stream: the key compression (upstream's kernel), then the query and the bf16 key store in one
        launch (kernels/query_store.py: two launches back to back were most of an eager layer's host time)."""
        keys = compressed_keys(self, attn_backend, x, forward_batch)
        weights = self.compute_weights(x, skip_scale=True)
        call = inputs.query_store_call(positions, keys, self.n_local_heads, self.head_dim)
        out = call(self.query_rows(q_lora, q_lora_quant), weights, self.weight_scale, self.freqs_cis, keys.kv,
                   keys.pages, norm_weight=keys.norm.weight, norm_eps=keys.norm.variance_epsilon, k_freqs=keys.freqs)
        note_key_writes(attn_backend, self, keys, forward_batch)
        return out

    def query(self, q_lora, positions, weights, q_lora_quant, inputs: "TopkInputs") -> tuple:
        """The layer's rotated bf16 queries and its head ``weights`` scaled, written into the forward's buffers."""
        return self.compute_q(q_lora, positions, weights, q_lora_quant,
                              out=inputs.query_out(self.n_local_heads, self.head_dim))

    def query_beside_compressor(self, x, q_lora, positions, q_lora_quant, forward_batch, attn_backend,
                                inputs: "TopkInputs", streams, q_lora_ready, skip_compressor: bool) -> tuple:
        """Upstream's multi-stream split of the indexer, kept: the head weights on one side stream, the query on
        another once its ``q_lora`` and the weights are ready, the key compression and bf16 store on the current
        stream beside both, which then waits for the query.

        Upstream asks for it while capturing a decode CUDA graph of up to 64 rows (128 on Blackwell). Run on one
        stream, the compression waited for ``q_lora`` and the query for the compression: on a Hopper GPU the decode
        step of a 12-layer model of DeepSeek-V4-Flash's dimensions took 3.7% longer than upstream's with TileLang,
        at the same kernels and kernel time.
        """
        current = torch.cuda.current_stream()
        on_query, on_weights = streams[0], streams[1]
        on_query.wait_stream(current)
        on_weights.wait_stream(current)
        with torch.cuda.stream(on_weights):
            weights = self.compute_weights(x, skip_scale=True)
            weights_ready = on_weights.record_event()
        with torch.cuda.stream(on_query):
            if q_lora_ready is not None:
                on_query.wait_event(q_lora_ready)
            on_query.wait_event(weights_ready)
            q, weights = self.query(q_lora, positions, weights, q_lora_quant, inputs)
        if not skip_compressor:
            store_index_keys(self, attn_backend, x, forward_batch)
        current.wait_stream(on_query)
        return q, weights


def common_rows(x, q_lora, q_lora_quant, positions):
    """x, q_lora and positions cut to their common row count before anything reads them, as upstream does.

    Under graph capture and DP padding the three can differ; the compressor's decode kernel needs its
    kv rows to equal the plan's rows, and the query rows must match the metadata's.
    """
    n = min(x.shape[0], q_lora.shape[0], positions.shape[0])
    if q_lora.shape[0] != n:
        q_lora, q_lora_quant = q_lora[:n], None
    return x[:n], q_lora, q_lora_quant, positions[:n]


class CompressedKeys(NamedTuple):
    """A C4 layer's compressed keys of this step and where the bf16 store puts them."""

    kv: torch.Tensor  # upstream's compressor output, [rows, 128]
    pages: torch.Tensor  # the layer's bf16 pool, behind the HiCache load fence
    out_loc: torch.Tensor
    plan: torch.Tensor  # upstream's 16-byte plan rows
    mode: str  # "decode" or "extend"
    norm: torch.nn.Module  # the compressor's RMSNorm
    freqs: torch.Tensor  # the compressor's RoPE table


def compressed_keys(indexer: C4Indexer, backend, x: torch.Tensor, forward_batch) -> CompressedKeys:
    """Compress this step's indexer keys with upstream's kernel; what the bf16 store needs to put them."""
    from sglang.kernels.ops.attention.dsv4.compress import compress_forward
    from sglang.srt.layers.attention.dsv4.compressor_v2 import is_overlap_compress

    comp = indexer.compressor
    kv_score_input = comp.compute_kv_score(x, forward_batch)
    state = comp.get_state_pool(backend).kv_score_buffer.kv_score
    coff = 2 if is_overlap_compress(C4_RATIO) else 1
    plan = backend._get_paged_compress_metadata(C4_RATIO)
    kv = compress_forward(
        kv_score_buffer=state.view(-1, C4_RATIO, 2 * comp.head_dim * coff),
        kv_score_input=kv_score_input,
        ape=comp.ape.view(-1, comp.head_dim),
        plan=plan,
        head_dim=comp.head_dim,
        compress_ratio=C4_RATIO,
    )
    pages = backend.token_to_kv_pool.index_k_pages_bf16(indexer.layer_id)  # behind the HiCache load fence
    return CompressedKeys(kv, pages, backend._get_out_loc(C4_RATIO), plan[1], "decode" if plan.is_decode else "extend",
                          comp.norm, comp.freqs_cis)


def store_index_keys(indexer: C4Indexer, backend, x: torch.Tensor, forward_batch) -> None:
    """Compress this step's indexer keys (upstream's kernel) and store them bf16 (RMSNorm, RoPE, Hadamard)."""
    keys = compressed_keys(indexer, backend, x, forward_batch)
    store_index_k_bf16(keys.kv, keys.pages, keys.out_loc, norm_weight=keys.norm.weight,
                       norm_eps=keys.norm.variance_epsilon, freqs=keys.freqs, mode=keys.mode, plan=keys.plan,
                       compress_ratio=C4_RATIO)
    note_key_writes(backend, indexer, keys, forward_batch)


def reads_checked(forward_batch) -> bool:
    """Whether integrity mode checks this forward's key stores and reads: a forward that may consume a HiCache
    load, which only a prefill (extend) batch starts. A decode or verify step consumes none of its own, yet
    names one: upstream's running batch is the first prefill batch it merged, load slot included, and every step
    sets that slot as the consumer (sglang 0.5.23 ``Scheduler.get_next_batch_to_run``: ``running_batch =
    last_batch``), so an eager decode step would check and count under a slot another forward has since taken."""
    if integrity.LEDGER is None:
        return False
    mode = forward_batch.forward_mode
    return not (mode.is_decode() or mode.is_target_verify() or mode.is_idle())


def note_key_writes(backend, indexer: C4Indexer, keys: CompressedKeys, forward_batch) -> None:
    """Integrity mode: what was stored must still be there at the read."""
    if reads_checked(forward_batch):
        integrity.note_writes(backend.token_to_kv_pool, indexer.layer_id, keys.pages.view(torch.uint8).flatten(1),
                              keys.out_loc)


def _rows(tensor: torch.Tensor, rows: int, value) -> torch.Tensor:
    """Metadata cut or padded to the query rows, as upstream's indexer does (a view when cut)."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, rows - tensor.shape[0]), value=value)


TOPK_INPUTS = "dsv4_sm120_topk_inputs"  # the attribute of a forward's indexer metadata that holds its TopkInputs


class TopkInputs:
    """What the C4 layers of one forward share in :func:`select_topk`, worked out by the first of them.

    The metadata cut or padded to the query rows (three views or copies a layer made before), the buffers of the
    rotated queries and head weights, one fp32 logits buffer ``[rows or the chunk's rows, width]`` and, where the
    rows are one chunk (decode, short extends), the logits call with all of it bound (:class:`LogitsCall`). Each
    layer's queries and logits are read by its own kernels before the next layer's are written on the same stream
    (or on upstream's indexer stream, joined every layer), so one set of buffers serves them all, and an eager
    layer's indexer calls allocate nothing and its logits call reads the layout of three tensors instead of six
    (on a Hopper host the outputs' ``torch.empty`` were 6.3 of the logits call's 29 us of host time
    and 12.2 of the query call's 28.5).

    Kept on the forward's metadata, so it lives as long as the forward does; metadata that outlives its forward
    (a CUDA-graph capture's may) and meets other tensors or rows gets new inputs. Views only: where the metadata
    has fewer rows than the queries (padded copies), each layer makes its inputs as before.
    """

    __slots__ = ("source", "rows", "step", "width", "padded", "seq_lens", "page_table", "out_pages", "logits", "call",
                 "query", "query_store")

    def __init__(self, im, core, rows: int, step: int, device: torch.device):
        self.source = (im.compressed_seq_lens, im.page_table, core.c4_sparse_page_indices)
        self.rows, self.step, self.width = rows, step, im.max_compressed_seq_len
        # metadata of fewer rows than the queries is padded: copies, not views, made anew by each layer (a copy
        # kept from one CUDA graph's capture would not be refreshed by another graph's replay)
        self.padded = any(t.shape[0] < rows for t in self.source)
        self.seq_lens = _rows(im.compressed_seq_lens, rows, 1).reshape(-1)
        self.page_table = _rows(im.page_table, rows, 0)
        self.out_pages = _rows(core.c4_sparse_page_indices, rows, -1)
        one_chunk = 0 < rows <= step
        self.logits = torch.empty((rows if one_chunk else step, self.width), dtype=torch.float32, device=device)
        self.call = LogitsCall(self.seq_lens, self.page_table, self.width, self.logits) if one_chunk else None
        self.query = None  # the rotated queries' and head weights' buffers, made by the first layer's query
        self.query_store = None  # the query and key store's bound call, made by the first layer that stores keys

    def query_out(self, heads: int, head_dim: int) -> tuple:
        """The forward's buffers of ``index_query_bf16``'s outputs: bf16 [rows, heads, dim], fp32 [rows, heads, 1]."""
        if self.query is None or self.query[0].shape[1:] != (heads, head_dim):
            device = self.logits.device
            self.query = (torch.empty((self.rows, heads, head_dim), dtype=torch.bfloat16, device=device),
                          torch.empty((self.rows, heads, 1), dtype=torch.float32, device=device))
        return self.query

    def query_store_call(self, positions: torch.Tensor, keys: "CompressedKeys", heads: int, head_dim: int) -> QueryStoreCall:
        """The forward's bound query-and-store call (:class:`QueryStoreCall`) for these positions and store
        targets: made by the first layer, checked by each (its positions are a new view of the same rows)."""
        call = self.query_store
        if (call is None or call.out_loc is not keys.out_loc or call.plan is not keys.plan or call.mode != keys.mode
                or call.positions.data_ptr() != positions.data_ptr() or call.positions.shape != positions.shape
                or call.out is not self.query_out(heads, head_dim)):
            call = self.query_store = QueryStoreCall(positions, self.query_out(heads, head_dim), keys.out_loc,
                                                     keys.plan, keys.mode, C4_RATIO)
        return call

    def serves(self, im, core, rows: int, step: int) -> bool:
        """Whether these inputs were made from this metadata's tensors for these rows."""
        seq_lens, page_table, out_pages = self.source
        return (not self.padded and seq_lens is im.compressed_seq_lens and page_table is im.page_table
                and out_pages is core.c4_sparse_page_indices and rows == self.rows and step == self.step)


def topk_inputs(im, core, rows: int, step: int, device: torch.device) -> TopkInputs:
    """The forward's :class:`TopkInputs`, made by its first C4 layer and kept on its indexer metadata ``im``."""
    inputs = getattr(im, TOPK_INPUTS, None)
    if inputs is None or not inputs.serves(im, core, rows, step):
        inputs = TopkInputs(im, core, rows, step, device)
        setattr(im, TOPK_INPUTS, inputs)
    return inputs


def forward_topk_inputs(backend, q_lora: torch.Tensor) -> TopkInputs:
    """The forward's shared top-k inputs for this layer's query rows (``q_lora``'s, cut to the common rows)."""
    meta = backend.forward_metadata
    im, core = meta.indexer_metadata, meta.core_metadata
    rows = q_lora.shape[0]  # the query rows (wq_b maps rows one to one)
    step = im.rows_per_chunk or rows
    if step < rows and rows != im.compressed_seq_lens.shape[0]:
        raise RuntimeError(
            f"the indexer metadata was chunked for {im.compressed_seq_lens.shape[0]} query rows but this "
            f"forward has {rows}: the per-chunk top-k plans would not line up with the rows they score"
        )
    return topk_inputs(im, core, rows, step, q_lora.device)


def select_topk(indexer: C4Indexer, backend, inputs: TopkInputs, q: torch.Tensor, weights: torch.Tensor, *,
                checked: bool = False) -> None:
    """Score every query row against its request's bf16 keys and write the top-k pool slots upstream reads;
    ``checked`` (:func:`reads_checked`): integrity mode checks the layer's loaded pages first."""
    im, core = backend.forward_metadata.indexer_metadata, backend.forward_metadata.core_metadata
    rows, step = inputs.rows, inputs.step
    capturer = upstream_indexer.get_global_indexer_capturer()
    raw = core.c4_sparse_raw_indices
    if raw is None and capturer is not None:
        raw = torch.empty_like(inputs.out_pages)
    pages = backend.token_to_kv_pool.index_k_pages_bf16(indexer.layer_id)  # behind the HiCache load fence
    if checked:  # integrity mode: this layer's loaded pages, as this read finds them
        integrity.check_reads(backend.token_to_kv_pool, indexer.layer_id, pages.view(torch.uint8).flatten(1))
    two_stage = indexer.two_stage and two_stage_chunk(min(rows, step), inputs.width)
    if inputs.call is not None and not two_stage:  # one chunk: all but this layer's queries, weights, pool bound
        logits = inputs.call(q, pages, weights)
        run_topk_transform(backend, im, logits, inputs.seq_lens, inputs.page_table, inputs.out_pages, raw, whole=True)
    else:
        whole = inputs.call is not None  # one chunk (two-stage): the forward's own top-k plan
        chunk_plans = getattr(im, "topk_metadata_chunks", None)
        seq_lens, page_table, out_pages, buffer = inputs.seq_lens, inputs.page_table, inputs.out_pages, inputs.logits
        for i, start in enumerate(range(0, rows, max(1, step))):
            r = slice(start, min(rows, start + step))
            n = r.stop - start
            score = two_stage_paged_mqa_logits if two_stage and two_stage_chunk(n, inputs.width) \
                else bf16_paged_mqa_logits
            logits = score(q[r], pages, weights[r], seq_lens[r], page_table[r], inputs.width,
                           out=buffer if n == buffer.shape[0] else buffer[:n])
            run_topk_transform(backend, im, logits, seq_lens[r], page_table[r], out_pages[r],
                               None if raw is None else raw[r], whole=whole,
                               plan=None if whole or chunk_plans is None else chunk_plans[i])
    if capturer is not None:
        layer = backend.token_to_kv_pool.layer_mapping[indexer.layer_id].compress_layer_id
        capturer.capture(layer, raw)


def two_stage_chunk(rows: int, width: int) -> bool:
    """Whether a chunk of ``rows`` query rows over ``width`` keys selects in two stages (under
    ``DSV4_SM120_INDEX_K_SELECT=two_stage``): a prefill chunk (the logits kernel's prefill shape, from
    ``PREFILL_ROWS`` rows) whose rows can have more keys than the re-score takes. Only there is the fp8-rate scan
    worth its top-k pass: scoring is compute-bound in a long prefill, while a decode step reads the same bf16
    bytes in either form."""
    return rows >= PREFILL_ROWS and width > TOPK + MARGIN


def run_topk_transform(backend, im, logits, seq_lens, page_table, out_pages, raw, *, whole: bool, plan=None):
    """Upstream's top-k transform for the configured ``--dsa-topk-backend``, on fp32 logits."""
    kind = backend.dsa_topk_backend
    page_size = im.compressed_page_size
    if kind.is_torch():
        upstream_indexer.topk_transform_pytorch_vectorized(logits, seq_lens, page_table, out_pages, page_size, raw)
    elif kind.is_flashinfer():
        backend.flashinfer_topk_transform(logits, seq_lens, page_table, out_pages, page_size, raw)
    elif kind.should_use_topk_v2():
        if plan is None:
            plan = im.topk_metadata if whole else upstream_indexer.plan_topk_v2(seq_lens)
        upstream_indexer.topk_transform_paged_v2(logits, seq_lens, page_table, out_pages, page_size, plan, raw)
    else:
        upstream_indexer.topk_transform_paged(logits, seq_lens, page_table, out_pages, page_size, raw)


def use_bf16_indexers(model: torch.nn.Module, *, hisparse: bool = False, two_stage: bool = False) -> int:
    """Switch every upstream C4 indexer in ``model`` to :class:`BF16C4Indexer` (``two_stage``: long prefill
    chunks select in two stages, ``DSV4_SM120_INDEX_K_SELECT``); returns how many.

    Features the bf16 indexer does not carry are refused here, at model build, before any pool or
    CUDA graph exists, rather than in the first forward.
    """
    if hisparse:
        raise BF16IndexerUnsupported(
            "--enable-hisparse (hierarchical sparse attention) and bf16 index keys exclude each other; "
            "drop the flag or set DSV4_SM120_INDEX_K_DTYPE=fp8"
        )
    count = 0
    for module in model.modules():
        if type(module) is C4Indexer:
            if module.use_fp4_indexer:
                raise BF16IndexerUnsupported(
                    "--enable-deepseek-v4-fp4-indexer and bf16 index keys exclude each other; "
                    "drop the flag or set DSV4_SM120_INDEX_K_DTYPE=fp8"
                )
            module.__class__ = BF16C4Indexer
            module.two_stage = two_stage
            count += 1
    return count


class DeepseekV4ForCausalLMSM120(DeepseekV4ForCausalLM):
    """DeepSeek-V4 with the dsv4-sm120 indexer path (bf16 index keys when configured)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = gate.switches()
        self.index_k_dtype = cfg.index_k_dtype
        self.kernels_ready = {"variants": 0}
        if self.index_k_dtype == "bf16":
            two_stage = cfg.index_k_select == "two_stage"
            self.bf16_indexers = use_bf16_indexers(self, hisparse=bool(get_memory().enable_hisparse),
                                                   two_stage=two_stage)
            self.kernels_ready = compile_kernels(self, checksum=cfg.index_k_checksum, two_stage=two_stage)
        else:
            self.bf16_indexers = 0
        logger.info(built_line(self))

    def post_load_weights(self, is_nextn=False, weight_names=None):
        """Upstream's fix-up after the weights, then, for a loader that skipped ``load_weights``, upstream's mHC
        prewarm that ``load_weights`` ends with.

        ``load_weights`` compiles the mHC pre-norm kernels (a DeepGEMM GEMM and a TileLang kernel, one of each per
        split count, which follows a batch's token count) for every count up to a prefill chunk before any
        forward. The loaders that bypass it (dummy, sharded state, remote) call this method with no arguments
        and never reach that prewarm, so each new split count compiled inside a serving batch: on a Hopper GPU a
        dummy-weight PD prefill's two batches took 16 and 17 s and its ``/health`` timed out at the router.
        ``load_weights`` always passes its weight names, so a call without them is a bypassing loader's."""
        super().post_load_weights(is_nextn=is_nextn, weight_names=weight_names)
        if weight_names is None and not is_nextn and torch.cuda.is_available():
            self._prewarm_mhc_kernels()  # upstream's own; it returns at once where upstream does not use TileLang


def compile_kernels(model: torch.nn.Module, *, checksum: bool, two_stage: bool = False) -> dict:
    """Every variant of the package's kernels compiled (or loaded from Triton's cache) while the server
    starts, so that no request waits for a compile (it stalled the first request of a new shape 1.3-2.1 s)."""
    from dsv4_sm120.kernels.warmup import compile_for_serving

    heads = next((m.n_local_heads for m in model.modules() if type(m) is BF16C4Indexer), 0)
    if not heads:
        return {"variants": 0}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return compile_for_serving(device, heads=heads, checksum=checksum, two_stage=two_stage)  # nothing off CUDA


def built_line(model: torch.nn.Module) -> str:
    """The one line a server logs when it builds the model: which class, which index keys, which indexers,
    and how many kernel variants were made ready before serving.

    It is the operator's proof, at the default log level, that ``--model-impl dsv4`` took effect and how.
    """
    c4 = [m for m in model.modules() if isinstance(m, C4Indexer)]
    bf16 = sum(type(m) is BF16C4Indexer for m in c4)
    line = (f"dsv4-sm120: built {type(model).__name__} with {model.index_k_dtype} index keys: "
            f"{bf16} of {len(c4)} C4 indexers replaced by BF16C4Indexer, {len(c4) - bf16} upstream C4Indexer left")
    if any(type(m) is BF16C4Indexer and m.two_stage for m in c4):
        line += " (long prefill chunks select in two stages)"
    ready = model.kernels_ready
    if ready["variants"]:
        line += f"; {ready['variants']} kernel variants ready in {ready['seconds']:.1f} s ({ready['compiled']} compiled)"
    return line

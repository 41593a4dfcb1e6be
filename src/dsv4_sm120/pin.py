"""The sglang pin and the manifest of every upstream symbol this package touches.

A pin bump must fail loudly, not silently: ``dsv4-sm120 doctor`` resolves each
manifest entry on the installed sglang, and :func:`dsv4_sm120.hooks.hook`
refuses to register a target that is not listed here. Each entry says how the
package touches the symbol and which fix owns it.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from importlib import metadata

SGLANG_PIN = "0.5.23"
PIN_OVERRIDE_ENV = "DSV4_SM120_ALLOW_PIN_MISMATCH"


@dataclass(frozen=True)
class Touch:
    target: str  # dotted path on the installed sglang
    how: str  # "around", "before", "after", "replace" (HookRegistry), "subclass", "patch", "calls"
    fix: str  # model | index_k | hicache | nixl | guard | metrics
    why: str


HOOK_KINDS = ("around", "before", "after", "replace")

MANIFEST: tuple[Touch, ...] = (
    # --- model: --model-impl dsv4 ---------------------------------------------------------
    Touch(
        "sglang.srt.model_loader.utils.get_model_architecture",
        "around",
        "model",
        "--model-impl dsv4 resolves to the package's DeepSeek-V4 class; other impls pass through.",
    ),
    Touch(
        "sglang.srt.entrypoints.warmup.execute_warmups",
        "before",
        "model",
        "Puts dsv4_shapes in upstream's warmup registry, so --warmups dsv4_shapes serves each shape before /health.",
    ),
    Touch("sglang.srt.entrypoints.warmup._warmup_registry", "calls", "model",
          "The registry --warmups names are looked up in; dsv4_shapes is added to it."),
    Touch("sglang.srt.managers.io_struct.GenerateReqInput", "calls", "model",
          "The warmup's requests, as upstream's own warmups build them."),
    Touch("sglang.srt.entrypoints.http_server._global_state", "calls", "model",
          "The KV pool's size the scheduler reported (scheduler_info), which bounds the warmup's longest prompt."),
    Touch(
        "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM",
        "subclass",
        "model",
        "The package's model class extends upstream's and swaps in the bf16 indexer.",
    ),
    Touch("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.post_load_weights", "calls", "model",
          "The package's class runs upstream's fix-up, then, for a loader that bypassed load_weights (it calls "
          "this with no weight names), the mHC prewarm load_weights ends with."),
    Touch("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM._prewarm_mhc_kernels", "calls", "model",
          "Upstream's compile of the mHC pre-norm kernels for every split count before serving."),
    Touch("sglang.srt.model_loader.loader.post_load_weights", "calls", "model",
          "How the dummy, sharded and remote loaders reach the model's post_load_weights: with no arguments."),
    Touch(
        "sglang.srt.configs.model_config.is_deepseek_v4",
        "calls",
        "model",
        "Decides whether a checkpoint is DeepSeek-V4, as upstream does.",
    ),
    Touch(
        "sglang.srt.configs.model_config.ModelConfig",
        "calls",
        "model",
        "doctor --model-path reads the checkpoint's config as the server does (V4.1 verdict).",
    ),
    # --- model + kernels: bf16 C4 indexer ---
    Touch("sglang.srt.layers.attention.dsv4.indexer.C4Indexer", "subclass", "model",
          "BF16C4Indexer replaces compute_q/forward: bf16 store, query and logits kernels (the query and the store "
          "one launch on one stream); in a captured decode it keeps upstream's split over the indexer's "
          "alt_streams (weights, query beside the compression)."),
    Touch("sglang.srt.layers.attention.dsv4.indexer.topk_transform_pytorch_vectorized", "calls", "model",
          "--dsa-topk-backend torch on the bf16 indexer's fp32 logits."),
    Touch("sglang.srt.layers.attention.dsv4.indexer.topk_transform_paged", "calls", "model",
          "--dsa-topk-backend sgl-kernel (v1) on the bf16 indexer's fp32 logits."),
    Touch("sglang.srt.layers.attention.dsv4.indexer.topk_transform_paged_v2", "calls", "model",
          "--dsa-topk-backend sgl-kernel with top-k v2."),
    Touch("sglang.srt.layers.attention.dsv4.indexer.plan_topk_v2", "calls", "model",
          "Top-k v2 plan for a row chunk of the bf16 indexer."),
    Touch("sglang.srt.layers.attention.dsv4.metadata.PagedIndexerMetadata", "calls", "model",
          "A forward's indexer metadata: the bf16 indexer reads its page table, lengths and chunking, and keeps the "
          "forward's top-k inputs and logits buffer on it (model.deepseek_v4.TopkInputs)."),
    Touch("sglang.srt.layers.attention.dsv4.indexer.get_global_indexer_capturer", "calls", "model",
          "Indexer top-k capture keeps working with bf16 keys."),
    Touch("sglang.srt.runtime_context.get_memory", "calls", "model",
          "The model class reads --enable-hisparse at build and refuses it with bf16 keys."),
    Touch("sglang.kernels.ops.attention.dsv4.compress.compress_forward", "calls", "kernels",
          "Upstream's C4 compression runs first; the bf16 store kernel replaces only norm/rope/hadamard/store."),
    Touch("sglang.srt.layers.attention.dsv4.compressor_v2.is_overlap_compress", "calls", "kernels",
          "Shape of the C4 indexer compressor's state buffer."),
    Touch("sglang.srt.layers.attention.dsv4.compressor_v2.CompressorBackendMixin._get_paged_compress_metadata",
          "calls", "kernels", "The compress plan (upstream's 16-byte rows) the bf16 store kernel addresses by."),
    Touch("sglang.srt.layers.attention.dsv4.compressor_v2.CompressorBackendMixin._get_out_loc", "calls", "kernels",
          "Compressed slots the bf16 store kernel writes."),
    # --- metrics: every fix's counters on /metrics ---
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.init_metrics_collector",
        "after",
        "metrics",
        "Creates the sglang:dsv4_* collectors in each scheduler process when --enable-metrics is on.",
    ),
    Touch(
        "sglang.srt.runtime_context.get_parallel",
        "calls",
        "metrics",
        "The scheduler process's TP rank, the tp_rank label of every sglang:dsv4_* series.",
    ),
    # --- nixl: NIXL bootstrap hardening ---
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread",
        "around",
        "nixl",
        "Starts the hardened bootstrap loop instead of the closure that dies on the first bad frame.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager.transfer_worker",
        "around",
        "nixl",
        "Hands each transfer worker a progress-watching queue so a dead or stuck worker fails health.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager.update_status",
        "around",
        "nixl",
        "A sender opened for a room the decode already aborted starts Failed (tombstone).",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVSender.__init__",
        "after",
        "nixl",
        "Records which rooms a live prefill sender holds, so an aborted room nobody holds is dropped, not leaked.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager._await_handles",
        "around",
        "nixl",
        "Handles it gave up waiting for are parked in the write ledger and polled until they settle.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager._send_abort_ack",
        "around",
        "nixl",
        "An abort is acknowledged to the decode only when no write of the room can still land.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager.register_deferred_ack_target",
        "after",
        "nixl",
        "The write ledger remembers every acknowledgement target, so one upstream drops is sent once the room drains.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager.poison_deferred_ack_room",
        "after",
        "nixl",
        "A room poisoned for a refused post is never acknowledged; one poisoned for unsettled handles is, once they settle.",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.resolve_deferred_releases",
        "around",
        "nixl",
        "An aborted room's decode pages past the release timeout without a drain acknowledgement stay quarantined.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.conn.CommonKVManager._handle_node_failure",
        "after",
        "nixl",
        "A prefill the decode's heartbeat lost can no longer write: the rooms it quarantined are released.",
    ),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "around",
        "index_k",
        "Integrity mode on a decode: re-reads the due requests' received pages before each decode forward (late writes).",
    ),
    Touch("sglang.srt.environ.envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "calls", "nixl",
          "How long a decode waits for a room: after it and the bootstrap timeout, a room no request claimed is released."),
    Touch("sglang.srt.disaggregation.common.conn.CommonKVManager._room_notify_targets", "calls", "nixl",
          "The decode endpoints of a room the prefill failed on its own, to tell them (tell_decode)."),
    Touch("sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_failure", "calls", "nixl",
          "Fails a room with its reason and sends upstream's Failed status to its decode (tell_decode)."),
    Touch("sglang.srt.disaggregation.common.conn.CommonKVManager.send_kv_status_message", "calls", "nixl",
          "Answers a late transfer info for a room the prefill already failed, with the reason."),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
        "around",
        "nixl",
        "Health-check requests go unanswered while a NIXL prefill thread is dead or stuck.",
    ),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.maybe_send_health_check_signal",
        "around",
        "nixl",
        "A busy scheduler must not answer health checks for a broken NIXL side.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager._handle_abort_notification",
        "calls",
        "nixl",
        "The hardened loop hands ABORT frames to upstream's own abort handler.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVManager._add_remote_peer",
        "calls",
        "nixl",
        "The hardened loop registers decode peers with upstream's code, rolling back on error.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.KVArgsRegisterInfo.from_zmq",
        "calls",
        "nixl",
        "Parses a decode registration frame; its errors become counted rejections.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.TransferInfo.from_zmq",
        "calls",
        "nixl",
        "Parses a decode transfer-info frame; its errors become counted rejections.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.GUARD",
        "calls",
        "nixl",
        "The tag of registration and transfer-info frames.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.conn.ABORT_TAG",
        "calls",
        "nixl",
        "The tag of decode ABORT frames.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.conn.AbortNotification.from_zmq",
        "calls",
        "nixl",
        "Parses ABORT frames to bury the room before upstream handles it.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.conn.CommonKVManager.resolve_kv_replica_factor",
        "calls",
        "nixl",
        "Run when a room's transfer infos are complete, as upstream's loop does.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.staging_handler.handle_watermark_msg",
        "calls",
        "nixl",
        "WATERMARK frames go to upstream's staging handler.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.staging_handler.handle_staging_rsp",
        "calls",
        "nixl",
        "STAGING_RSP frames go to upstream's staging handler.",
    ),
    Touch(
        "sglang.srt.managers.utils.is_health_check_generate_req",
        "calls",
        "nixl",
        "Tells a health-check request from a real one.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVSender",
        "calls",
        "nixl",
        "Loopback harness: the pin's real prefill-side sender.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVReceiver",
        "calls",
        "nixl",
        "Loopback harness: the pin's real decode-side receiver.",
    ),
    Touch(
        "sglang.srt.disaggregation.nixl.conn.NixlKVBootstrapServer",
        "calls",
        "nixl",
        "Loopback harness: the pin's real bootstrap server on 127.0.0.1.",
    ),
    Touch(
        "sglang.srt.runtime_context.publish",
        "calls",
        "nixl",
        "Loopback harness: publishes a CPU ServerArgs the NIXL managers read.",
    ),
    Touch(
        "sglang.srt.disaggregation.base.conn.KVArgs",
        "calls",
        "nixl",
        "Loopback harness: KV/aux buffer description of DRAM CPU tensors.",
    ),
    # --- index_k: bf16 index keys, memory layer ---
    Touch(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsv4_kv_pool",
        "around",
        "index_k",
        "Under --model-impl dsv4 the DSV4 pool builder builds the package's pool subclass.",
    ),
    Touch(
        "sglang.srt.mem_cache.kv_cache_configurator.DeepSeekV4TokenToKVPool",
        "patch",
        "index_k",
        "The builder's module-global pool class, rebound to the subclass for one dsv4 build only.",
    ),
    Touch(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool",
        "subclass",
        "index_k",
        "DSV4SM120TokenToKVPool: bf16 indexer pool via _make_indexer_pool, PD tag, bf16 accessors.",
    ),
    Touch(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool._make_indexer_pool",
        "subclass",
        "index_k",
        "Upstream's override point for the C4 indexer pool.",
    ),
    Touch(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.pd_kv_layout",
        "subclass",
        "index_k",
        "The PD layout string gains index_k:bf16 when the keys are bf16.",
    ),
    Touch(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.wait_layer_transfer",
        "calls",
        "index_k",
        "HiCache's per-layer load fence, taken by every bf16 index-K reader and writer.",
    ),
    Touch(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool",
        "subclass",
        "index_k",
        "BF16IndexKPool: upstream's indexer pool with 256 B/token page rows and no scales.",
    ),
    Touch(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token",
        "around",
        "index_k",
        "The memory planner sizes the C4 indexer at 256 B/token with bf16 keys.",
    ),
    Touch(
        "sglang.srt.model_executor.pool_configurator.get_dsv4_indexer_bytes_per_token",
        "calls",
        "index_k",
        "The planner's own binding of the function above; HookRegistry re-points it.",
    ),
    Touch(
        "sglang.srt.runtime_context.get_model",
        "calls",
        "index_k",
        "The planner hook reads --model-impl from the published server args.",
    ),
    Touch(
        "sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
        "around",
        "index_k",
        "A bf16/fp8 index-K PD layout mismatch is refused with both layouts and the switch to fix it.",
    ),
    # --- index_k: PD integrity mode (DSV4_SM120_INDEX_K_CHECKSUM=1), hooks registered only when on ---
    Touch("sglang.srt.disaggregation.nixl.conn.NixlKVManager.add_transfer_request", "around", "index_k",
          "Prefill checksums a chunk's bf16 index-K source rows when it is queued."),
    Touch("sglang.srt.disaggregation.nixl.conn.NixlKVManager._encode_kv_status_message", "around", "index_k",
          "A room's Success status carries its index-K checksums as one extra frame."),
    Touch("sglang.srt.disaggregation.nixl.conn.NixlKVManager.parse_kv_status_message", "around", "index_k",
          "Decode keeps the checksum frame of a room's Success status (upstream reads frames 0-3 only)."),
    Touch("sglang.srt.disaggregation.nixl.conn.NixlKVReceiver.send_metadata", "around", "index_k",
          "Decode remembers the destination pages the prefill addresses by position."),
    Touch("sglang.srt.disaggregation.nixl.conn.NixlKVReceiver.poll", "around", "index_k",
          "Decode verifies the received index-K rows when the room turns Success; Failed on a mismatch."),
    Touch("sglang.srt.disaggregation.common.conn.CommonKVManager.record_failure", "calls", "index_k",
          "A PD index-K mismatch becomes the room's failure reason, read by the decode's abort path."),
    Touch("sglang.srt.disaggregation.base.conn.KVPoll", "calls", "index_k",
          "Room states the PD integrity hooks compare and answer."),
    Touch("sglang.srt.mem_cache.common.release_kv_cache", "around", "index_k",
          "A request failed for a late write enters the decode's hold list instead of freeing its KV. The guard "
          "calls it to free the KV of a request held by some TP ranks only, or of a disagreeing batch's request."),
    Touch("sglang.srt.disaggregation.decode.DecodeTransferQueue._do_release", "around", "index_k",
          "A held late-write request gives back its KV only: its transfer's metadata slot went back long ago."),
    Touch("sglang.srt.disaggregation.decode.DecodeRequest", "calls", "index_k",
          "A request failed for a late write enters the hold list as one, its receiver answering whether it drained."),
    # --- hicache: bf16 index-K host mirror ---
    Touch(
        "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.register_stack_strategy",
        "calls",
        "hicache",
        "Prepends the bf16 index-K HiCache strategy.",
    ),
    Touch(
        "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler._DeepSeekV4Strategy",
        "subclass",
        "hicache",
        "The bf16 strategy builds upstream's DSV4 stack, then makes the index-K mirror page-aligned only.",
    ),
    Touch(
        "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool",
        "subclass",
        "hicache",
        "BF16IndexKHostPool: the built bf16 index-K mirror (16384 B items), adopted after upstream builds it.",
    ),
    Touch(
        "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool.backup_from_device_all_layer",
        "subclass",
        "hicache",
        "Integrity mode checksums each index-K page row before its backup copy is issued.",
    ),
    Touch(
        "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool.load_to_device_per_layer",
        "subclass",
        "hicache",
        "Integrity mode notes each index-K load for the forward that reads it (checked at the C4 indexer's read).",
    ),
    Touch("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._all_reduce_attn_groups", "calls", "hicache",
          "Integrity mode MAX-reduces each request's verdict over the groups HiCache reduces its load counts on, "
          "so every TP rank fails the same requests."),
    Touch(
        "sglang.srt.mem_cache.hicache_storage.PoolName.DEEPSEEK_V4_C4_INDEXER",
        "calls",
        "hicache",
        "Finds the index-K host pool in the built stack.",
    ),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
        "around",
        "hicache",
        "Integrity mode fails the requests whose prefix reads an index-K page that came back corrupt.",
    ),
    Touch(
        "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
        ".process_batch_result_prefill",
        "around",
        "hicache",
        "Integrity mode fails the requests whose forward read an index-K page unlike its backup, before upstream "
        "commits that forward's output.",
    ),
    Touch(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.copy",
        "around",
        "hicache",
        "The copy the overlap scheduler keeps for result processing carries the batch's HiCache load slot, by "
        "which integrity mode collects that forward's verdicts.",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
        "around",
        "hicache",
        "The same on a PD prefill: the request is failed instead of sent to its decode.",
    ),
    Touch(
        "sglang.srt.managers.cache_controller.LayerDoneCounter",
        "calls",
        "hicache",
        "A load's producer slot and a forward's consumer slot tie each index-K load to the forward that checks it.",
    ),
    Touch(
        "sglang.srt.managers.schedule_batch.FINISH_ABORT",
        "calls",
        "hicache",
        "The failed request's discard_output_reason (upstream's path for KV that never landed).",
    ),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.process_pending_chunked_abort",
        "calls",
        "hicache",
        "Relied on: a chunked request failed by integrity mode is set as _pending_chunked_abort_req.",
    ),
    # --- guard: overlap-loop collective guard (patches/ + dsv4_sm120.guard) ---
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.event_loop_overlap_disagg_prefill",
        "patch",
        "guard",
        "Calls the guard once per iteration before the first rank-local collective (patches/collective_guard_prefill.diff).",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.event_loop_overlap_disagg_decode",
        "patch",
        "guard",
        "Calls the guard once per iteration before the first rank-local collective (patches/collective_guard_decode.diff).",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.event_loop_normal_disagg_prefill",
        "patch",
        "guard",
        "The same call in the loop --disable-overlap-schedule runs (patches/collective_guard_prefill.diff).",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.event_loop_normal_disagg_decode",
        "patch",
        "guard",
        "The same call in the loop --disable-overlap-schedule runs (patches/collective_guard_decode.diff).",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run",
        "around",
        "guard",
        "Second agreement: the TP ranks run the formed prefill batch only if every rank formed the same one.",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
        "around",
        "guard",
        "Second agreement: the TP ranks run the formed decode batch only if every rank formed the same one.",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.resolve_waiting_queue_bootstrap",
        "around",
        "guard",
        "Agrees on the waiting queue before its poll is reduced (it can change after the top-of-iteration check).",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
        "around",
        "guard",
        "Agrees on the in-flight queue before its poll is reduced (batch results change it mid-iteration).",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._update_handshake_waiters",
        "around",
        "guard",
        "Agrees on the decode preallocation queue before its poll is reduced.",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred",
        "around",
        "guard",
        "Agrees on the decode transfer queue before its poll and failure-hold flags are reduced.",
    ),
    Touch(
        "sglang.srt.managers.schedule_batch.Req.reset_for_retract",
        "calls",
        "guard",
        "Resets the prefix state of a prefill request whose disagreeing batch went back to the waiting queue.",
    ),
    Touch(
        "sglang.srt.disaggregation.utils.MetadataBuffers.clear_slot",
        "calls",
        "guard",
        "Clears the metadata slot of a decode transfer-queue request the guard retired.",
    ),
    Touch(
        "sglang.srt.disaggregation.utils.ReqToMetadataIdxAllocator.free",
        "calls",
        "guard",
        "Frees the metadata slot index of a decode transfer-queue request the guard retired.",
    ),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.init_disaggregation",
        "after",
        "guard",
        "Warns loudly at PD scheduler startup when the guard patch is not in the loaded loops.",
    ),
    Touch(
        "sglang.srt.disaggregation.utils._all_reduce_polls",
        "around",
        "guard",
        "MIN-reduces transfer polls through the guard's shared memory on groups the guard set up on one host.",
    ),
    Touch(
        "sglang.srt.managers.scheduler.Scheduler.send_abort_output",
        "calls",
        "guard",
        "Tells each client whose request the guard dropped why (from the rank owning the tokenizer socket).",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.release_aborted_prefill_waiting_req",
        "calls",
        "guard",
        "Releases a bootstrap/waiting prefill request held by some TP ranks only.",
    ),
    Touch(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result",
        "calls",
        "guard",
        "Releases an in-flight prefill request held by some TP ranks only.",
    ),
    Touch(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue._release_request",
        "calls",
        "guard",
        "Releases a decode transfer-queue request held by some TP ranks only.",
    ),
    Touch(
        "sglang.srt.disaggregation.utils.prepare_abort",
        "calls",
        "guard",
        "Marks a request dropped by the guard as aborted with the reason.",
    ),
    Touch(
        "sglang.srt.mem_cache.common.discard_kv_cache_backup",
        "calls",
        "guard",
        "Frees the retraction backup of a retracted decode request held by some TP ranks only.",
    ),
    Touch(
        "sglang.srt.managers.io_struct.AbortReq",
        "calls",
        "guard",
        "The abort message the guard sends to the tokenizer manager.",
    ),
    Touch(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.filter_batch",
        "calls",
        "guard",
        "Drops decode running requests not held by every TP rank before the forward.",
    ),
)


def installed_sglang_version() -> str | None:
    """The installed sglang distribution's version, or None when sglang is absent."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def pin_mismatch(version: str | None) -> str | None:
    """One line explaining why ``version`` is not the pin, or None when it is."""
    if version == SGLANG_PIN:
        return None
    found = "no sglang installed" if version is None else f"installed sglang is {version}"
    return (
        f"dsv4-sm120: {found}, but this release is pinned to sglang=={SGLANG_PIN}; "
        f"no hooks registered. Install sglang=={SGLANG_PIN}, or set {PIN_OVERRIDE_ENV}=1 "
        f"to register anyway (unsupported)."
    )


def touch_for(target: str) -> Touch:
    """The manifest entry for ``target``; KeyError names the manifest when it is missing."""
    for touch in MANIFEST:
        if touch.target == target:
            return touch
    raise KeyError(f"{target} is not in dsv4_sm120.pin.MANIFEST; list it there before touching it")


def resolve(target: str) -> str | None:
    """Import ``target`` on the installed sglang; None when it resolves, else the error."""
    try:
        pkgutil.resolve_name(target)
    except Exception as exc:  # noqa: BLE001 - any failure to resolve is the answer
        return f"{type(exc).__name__}: {exc}"
    return None

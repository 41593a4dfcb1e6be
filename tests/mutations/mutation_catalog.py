"""The mutations: for each fix and each switch-governed branch, a named edit of the package's code
and the tests (single functions, never tests/e2e unless marked ``e2e_only``) that must fail under it.

An edit is a literal replacement in ``src/dsv4_sm120/...`` that must match exactly once; when the
source moves on, the runner stops with the mutation's name, and this file must follow. ``covers``
says what the mutation takes away: a fix of the README's four, a ``DSV4_SM120_*`` switch branch, or
an item of issue 17's audit.
"""

from __future__ import annotations

from mutation_engine import Edit, Mutation

M = Mutation
E = Edit

DISAGG = "src/dsv4_sm120/disagg/"
GUARD = "src/dsv4_sm120/guard/"
INDEX_K = "src/dsv4_sm120/index_k/"
FRAMES = "tests/disagg/test_disagg_frames.py::"
LIVENESS = "tests/disagg/test_disagg_liveness.py::test_stuck_transfer_worker_then_dead_bootstrap_thread_fail_health"
HEALTH_GATE = "tests/disagg/test_disagg_health_gate.py::test_busy_scheduler_does_not_vouch_for_a_dead_nixl_thread"
LOOPS = "tests/guard/test_overlap_loops.py::"
ROUND_TRIP = "tests/index_k/test_hicache.py::test_round_trip_is_byte_exact"

MUTATIONS: tuple[Mutation, ...] = (
    # --- fix 1: bf16 index keys -------------------------------------------------------------------
    M("model-skips-use_bf16_indexers", "audit: the model class swaps its C4 indexers (built through upstream's __init__)",
      (E("src/dsv4_sm120/model/deepseek_v4.py",
         "self.bf16_indexers = use_bf16_indexers(self, hisparse=bool(get_memory().enable_hisparse))",
         "self.bf16_indexers = 0"),),
      ("tests/kernels/test_model_build.py::test_bf16_build_swaps_every_c4_indexer",)),
    M("switch-index-k-dtype-model-ignored", "switch DSV4_SM120_INDEX_K_DTYPE=fp8: the model keeps upstream's indexer",
      (E("src/dsv4_sm120/model/deepseek_v4.py", 'if self.index_k_dtype == "bf16":', "if True:"),),
      ("tests/kernels/test_model_build.py::test_fp8_build_is_upstreams_indexer",)),
    M("switch-index-k-dtype-pool-ignored", "switch DSV4_SM120_INDEX_K_DTYPE=fp8: the pool is upstream's byte for byte",
      (E(INDEX_K + "pool.py", 'if self.index_k_dtype != "bf16" or force_fp4:', "if force_fp4:"),),
      ("tests/index_k/test_pool.py::test_fp8_is_upstream_byte_for_byte",)),
    M("model-impl-transformers-taken", "audit: --model-impl transformers is upstream's",
      (E("src/dsv4_sm120/model/resolve.py",
         'return str(getattr(model_impl, "value", model_impl)).lower() == MODEL_IMPL',
         'return str(getattr(model_impl, "value", model_impl)).lower() in (MODEL_IMPL, "transformers")'),),
      ("tests/foundation/test_model_impl_transformers.py::test_transformers_resolves_the_same_class_as_upstream",),
      timeout_s=400, imported_in_subprocess=True),

    M("checkpoint-refusal-dropped", "fix 1: a non-DSV4 (or bf16 V4.1) checkpoint is refused at model load",
      (E("src/dsv4_sm120/model/resolve.py", "    if message:\n        raise UnsupportedCheckpointError(message)",
         "    if False:\n        raise UnsupportedCheckpointError(message)"),),
      ("tests/foundation/test_plugin_loading.py::test_model_impl_dsv4_refuses_a_non_dsv4_checkpoint_clearly",),
      timeout_s=400, imported_in_subprocess=True),

    M("planner-sizes-fp8-keys", "audit: the planner's allocation fits the budget (bf16 sized at 256 B)",
      (E(INDEX_K + "planner.py", "    return index_head_dim * 2",
         "    return original(index_head_dim, use_fp4_indexer, *args, **kwargs)"),),
      ("tests/index_k/test_planner.py::test_allocation_fits_the_plan",)),
    M("pd-layout-tag-dropped", "fix 1: the PD layout carries index_k:bf16",
      (E(INDEX_K + "pool.py", 'return f"{base},{layout.PD_LAYOUT_TAG_BF16}"', "return base"),),
      ("tests/index_k/test_pd.py::test_pool_layouts_from_the_real_pools_differ",)),
    M("pd-mismatch-keeps-upstream-message", "fix 1: a bf16/fp8 PD pair is refused naming both layouts and the switch",
      (E(INDEX_K + "pd.py", "raise IndexKLayoutMismatch(message) from exc", "raise"),),
      ("tests/index_k/test_pd.py::test_mismatch_is_refused_with_both_layouts_and_the_switch",)),
    M("hicache-strategy-never-matches", "audit: HiCache round trips depend on the package's bf16 stack strategy",
      (E(INDEX_K + "hicache.py",
         "return isinstance(pools.get(4), BF16IndexKPool) and super().matches(kvcache, components)",
         "return False"),),
      (ROUND_TRIP + "[random-1-layer_first-kernel]", ROUND_TRIP + "[random-1-page_first-kernel]")),
    M("hicache-sub-page-allowed", "fix 1: the bf16 mirror refuses sub-page copies (fp8-row kernel)",
      (E(INDEX_K + "hicache.py", "host_pool.page_aligned_only = True", "host_pool.page_aligned_only = False"),),
      (ROUND_TRIP + "[page_boundaries-2-page_first-kernel]",)),
    # --- fix 2: HiCache race-freedom and integrity -----------------------------------------------
    M("writer-skips-load-fence", "fix 2: a bf16 write waits for its layer's HiCache load",
      (E(INDEX_K + "pool.py", "        self.wait_layer_transfer(layer_id)\n        pool, local = self._bf16_index_pool(layer_id)\n"
         "        pool.write_slots", "        pool, local = self._bf16_index_pool(layer_id)\n        pool.write_slots"),),
      ("tests/index_k/test_pool.py::test_readers_and_writer_wait_for_the_layer_load",)),
    M("switch-checksum-hicache-ignored", "switch DSV4_SM120_INDEX_K_CHECKSUM=1: HiCache pages are checksummed",
      (E(INDEX_K + "hicache.py", "adopt(host, checksum=settings.load().index_k_checksum)",
         "adopt(host, checksum=False)"),),
      ("tests/index_k/test_integrity.py::test_planted_corruption_is_caught_counted_and_logged",)),
    M("checksum-compare-blind", "fix 2: a page that comes back different is counted and quarantined",
      (E(INDEX_K + "integrity.py", "bad = (_checksum(loaded_rows) != self.expected[layer, host_pages])",
         "bad = (_checksum(loaded_rows) != _checksum(loaded_rows))"),),
      ("tests/index_k/test_integrity.py::test_planted_corruption_is_caught_counted_and_logged",)),
    M("corrupt-page-request-not-failed", "fix 2: only the requests reading a quarantined page fail",
      (E(INDEX_K + "request_fail.py", "    if batch is None or not QUARANTINE.active:\n        return plan",
         "    if True:\n        return plan"),),
      ("tests/index_k/test_integrity_request_fail.py::test_corrupt_load_back_fails_only_the_request_that_reads_it",)),
    M("switch-checksum-pd-always", "switch DSV4_SM120_INDEX_K_CHECKSUM=0: no PD integrity hook",
      (E(INDEX_K + "hooks.py", "    if cfg.index_k_checksum:\n", "    if True:\n"),),
      ("tests/index_k/test_pd_integrity.py::test_switch_off_registers_no_pd_hook",)),
    M("pd-checksum-mismatch-passes", "fix 2: a corrupt PD page fails its room",
      (E(INDEX_K + "pd_integrity.py", "        if not bad:\n            return KVPoll.Success",
         "        if True:\n            return KVPoll.Success"),),
      ("tests/index_k/test_pd_integrity.py::test_corrupt_page_fails_the_room_with_page_layer_and_switch",)),
    # --- fix 3: NIXL bootstrap hardening ---------------------------------------------------------
    M("switch-nixl-hardening-ignored", "switch DSV4_SM120_NIXL_HARDENING=0: no disagg hook is registered",
      (E(DISAGG + "hooks.py", "    if not cfg.nixl_hardening:\n        return\n", "    if False:\n        return\n"),),
      ("tests/disagg/test_disagg_units.py::test_switch_off_registers_no_hook",)),
    M("switch-nixl-hardening-per-call-ignored", "switch DSV4_SM120_NIXL_HARDENING=0 at call time: the pin's thread",
      (E(DISAGG + "hooks.py", "    return load().nixl_hardening", "    return True"),),
      # the first builds the hardened pair (hooks registered), the second a pin pair in the same process
      (FRAMES + "test_foreign_frame_is_rejected_and_thread_keeps_serving",
       FRAMES + "test_pin_thread_dies_on_a_foreign_frame_and_sessions_stall")),
    M("bootstrap-backstop-narrowed", "audit: the bootstrap loop's backstop catches any handler error",
      (E(DISAGG + "bootstrap.py", "except Exception as exc:  # an upstream handler failed on this frame",
         "except KeyError as exc:  # an upstream handler failed on this frame"),),
      ("tests/disagg/test_disagg_backstop.py::"
       "test_an_upstream_handler_error_on_a_registered_peers_frame_is_refused_and_the_thread_serves_on",)),
    M("foreign-frame-kills-thread", "fix 3: a frame with an unknown tag is refused, the thread keeps serving",
      (E(DISAGG + "bootstrap.py", "        if tag != GUARD:\n            raise FrameRejected(",
         "        if tag != GUARD:\n            raise SystemExit(0) from FrameRejected("),),
      (FRAMES + "test_foreign_frame_is_rejected_and_thread_keeps_serving",)),
    M("half-registered-peer-kept", "fix 3: a peer whose registration failed half way is rolled back",
      (E(DISAGG + "bootstrap.py", "            if not known:\n                self._roll_back_peer(agent)",
         "            if False:\n                self._roll_back_peer(agent)"),),
      (FRAMES + "test_half_registered_peer_is_rolled_back_and_registers_again",)),
    M("late-transfer-info-revives-room", "audit (frames wait asserted): a buried room stays dead",
      (E(DISAGG + "bootstrap.py", '        if room in self.tombstones:\n            self.rejects.count("late_frames_dropped")',
         '        if False:\n            self.rejects.count("late_frames_dropped")'),),
      (FRAMES + "test_late_transfer_info_after_abort_for_unknown_room_creates_no_room",)),
    M("abort-not-buried", "fix 3: every ABORT buries its room",
      (E(DISAGG + "bootstrap.py", "        self.tombstones.bury(notification.room)\n", ""),),
      (FRAMES + "test_late_transfer_info_after_abort_for_unknown_room_creates_no_room",)),
    M("aborted-room-leaked", "fix 3: an aborted room no sender holds is released",
      (E(DISAGG + "bootstrap.py", "        if room in self.senders:\n            return\n", "        return\n"),),
      (FRAMES + "test_aborted_room_no_sender_holds_is_released_not_leaked",)),
    M("aborted-room-reopens", "fix 3: a room the decode aborted opens Failed",
      (E(DISAGG + "hooks.py",
         "if boot is None or bootstrap_room in mgr.request_status or bootstrap_room not in boot.tombstones:",
         "if True:"),),
      (FRAMES + "test_refused_transfer_info_for_a_room_not_yet_open_makes_it_open_failed",)),
    M("storm-no-foreign-no-late", "audit: the storm test counts its own foreign and late frames",
      (E(DISAGG + "storm.py", "                h.push_raw(FOREIGN_FRAME)", "                pass"),
       E(DISAGG + "storm.py", "        h.push_raw(h.metadata_frame(s))", "        pass")),
      ("tests/disagg/test_disagg_storm.py::test_abort_storm_80_sessions_x2",), timeout_s=240),
    M("health-request-gate-off", "fix 3 (healthy() became this wiring): an idle scheduler leaves health unanswered",
      (E(DISAGG + "hooks.py", "    if is_health_check_generate_req(recv_req) and _unhealthy():", "    if False:"),),
      (LIVENESS,)),
    M("health-signal-gate-off", "audit: a busy scheduler's health signal is gated too (real Scheduler path)",
      (E(DISAGG + "hooks.py", "    if scheduler.return_health_check_ipcs and _unhealthy():", "    if False:"),),
      (HEALTH_GATE,)),
    M("liveness-dead-worker-unseen", "audit: a dead transfer worker makes health fail",
      (E(DISAGG + "liveness.py", "            if not thread.is_alive():\n", "            if False:\n"),),
      ("tests/disagg/test_disagg_health_gate.py::test_a_dead_transfer_worker_fails_health",)),
    M("liveness-dead-bootstrap-unseen", "fix 3: a dead bootstrap thread makes health fail",
      (E(DISAGG + "liveness.py", "if boot.thread is None or not boot.thread.is_alive():", "if False:"),),
      (HEALTH_GATE,)),
    # --- fix 4: collective guard -----------------------------------------------------------------
    M("switch-guard-loop-ignored", "switch DSV4_SM120_COLLECTIVE_GUARD=0: the patched loop is upstream's",
      (E(GUARD + "loop_guard.py", "self.enabled = settings.load().collective_guard", "self.enabled = True"),),
      (LOOPS + "test_guard_switched_off_behaves_as_upstream_and_hangs",)),
    M("guard-top-agreement-off", "fix 4: the ranks agree at the top of each iteration",
      (E(GUARD + "loop_guard.py", '    if state.groups:\n        agree(scheduler, state, lambda: snapshot.take(scheduler, loop), "top"',
         '    if False:\n        agree(scheduler, state, lambda: snapshot.take(scheduler, loop), "top"'),),
      (LOOPS + "test_guard_reconciles_the_incident[2]",)),
    M("guard-poll-agreements-off", "audit (decode harness on upstream's queues): agreement before each mid-iteration poll",
      (E(GUARD + "hooks.py", "            hook(target, queue_check.hook_for(queue, on_queue_object))", "            pass"),),
      (LOOPS + "test_every_injection_point_is_reconciled[decode]",), timeout_s=300),
    M("guard-batch-agreement-off", "fix 4: the second agreement, on the formed batch",
      (E(GUARD + "hooks.py", "        hook(batch_check.PREFILL_TARGET, batch_check.check_prefill_batch)\n", ""),),
      (LOOPS + "test_a_chunked_request_of_a_disagreeing_batch_is_aborted",), timeout_s=200),
    M("guard-fail-fast-never-exits", "audit (healthy() deleted): an unreconcilable divergence exits non-zero",
      (E(GUARD + "loop_guard.py", "    timer.daemon = True\n    timer.start()\n", "    timer.daemon = True\n"),),
      (LOOPS + "test_unreconcilable_divergence_fails_fast_and_exits_nonzero",), timeout_s=45),
    M("dead-tp-peer-not-seen", "audit: a dead TP peer fails the survivors fast (shared-memory channel)",
      (E(GUARD + "consensus.py", "dead = [r for r in missing if not _alive(self.pids[r])]", "dead = []"),),
      ("tests/guard/test_consensus_channels.py::test_a_dead_rank_fails_the_survivors_fast_instead_of_hanging",),
      timeout_s=40, imported_in_subprocess=True),
    M("shm-poll-reduction-off", "fix 4: transfer polls MIN-reduce through the guard's shared memory",
      (E(GUARD + "hooks.py", "        hook(poll_reduce.TARGET, poll_reduce.all_reduce_polls)\n", ""),),
      ("tests/guard/test_consensus_channels.py::test_upstream_poll_reduction_goes_through_the_guards_shared_memory",),
      imported_in_subprocess=True),
    M("unpatched-warning-silent", "fix 4: a PD scheduler without the patch warns loudly",
      (E(GUARD + "hooks.py", 'if mode in ("prefill", "decode") and patching.applied_in_process() is not True:',
         "if False:"),),
      ("tests/guard/test_guard_units.py::test_pd_scheduler_startup_warns_loudly_when_the_patch_is_missing",)),
    M("patch-state-misread", "audit: the patching tests assert the state",
      (E("src/dsv4_sm120/patching.py", "    if transform(text, fp, reverse=True) is not None:\n        return APPLIED",
         "    if transform(text, fp, reverse=True) is not None:\n        return PRISTINE"),),
      ("tests/guard/test_patching.py::test_apply_is_idempotent_and_revert_is_byte_identical",)),
    # --- plugin, pin, clients --------------------------------------------------------------------
    M("switch-allow-pin-mismatch-ignored", "switch DSV4_SM120_ALLOW_PIN_MISMATCH=1 registers on another sglang",
      (E("src/dsv4_sm120/plugin.py", 'if problem is not None and settings.raw(pin.PIN_OVERRIDE_ENV) != "1":',
         "if problem is not None:"),),
      ("tests/foundation/test_pin.py::test_wrong_pin_with_override_registers_and_warns",)),
    M("storm-client-records-defaults", "audit: storm-client reports the exact switches in force",
      (E("src/dsv4_sm120/serving_bench/common.py", '"switches_in_force": settings.in_force(),',
         '"switches_in_force": {s.env: s.default for s in settings.SWITCHES},'),),
      ("tests/serving_bench/test_storm_client.py::test_healthy_server_recovers_and_every_session_was_cut_mid_stream",)),
)

"""Integrity mode on the PD path (DSV4_SM120_INDEX_K_CHECKSUM=1): bf16 index-K pages sent over NIXL are verified.

One loopback pair for the module: the pin's real NixlKVManager / Sender /
Receiver and bootstrap server, real NIXL agents over UCX DRAM-to-DRAM on
127.0.0.1 (dsv4_sm120.loopback.pair), with two extra registered buffers shaped
like bf16 index-K page rows (16384 B) and both sides' PD layout tagged
``index_k:bf16``, as a bf16 DSV4 pool registers them. Only the model is absent:
the pages hold random bytes. The checksum runs on CPU tensors (the kernel's torch
reference); its CUDA path on VRAM (a side stream, a pinned copy behind an event) is
tested here and in tests/kernels/test_gpu.py (-m gpu). The hold of a request failed for a late write runs on
upstream's own decode KV books on CPU (``tests.nixl.late_writes.DecodeKV``).

The hooks are registered as ``load_plugins`` registers them with the switch on;
``DSV4_SM120_INDEX_K_CHECKSUM=0 pytest tests/index_k/test_pd_integrity.py``
registers none, and the tests that need them fail (the point).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import torch

from dsv4_sm120.index_k import layout, pd_integrity, pd_rows
from tests.index_k import pool_harness
from tests.index_k.host_sync import NoHostSync
from dsv4_sm120.index_k.pd_integrity import FrameError, PageSums, encode_frame, parse_frame

INDEX_K_LAYERS = 2
KV_LAYERS = 2  # the loopback's plain KV buffers come first, as the DSV4 pool registers KV before indexer


@pytest.fixture(scope="module")
def pd():
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_sm120.loopback.pair import LoopbackPD

    on = os.environ.get(pd_integrity.SWITCH, "1") == "1"
    if on and pd_integrity.POLL not in HookRegistry._hooks:
        pd_integrity.register_hooks()
    with pytest.MonkeyPatch.context() as mp:
        pool_harness.switches(mp, index_k_checksum=on)
        pair = LoopbackPD(hardened=True, pages=256, seed=11, index_k_layers=INDEX_K_LAYERS)
        HookRegistry.apply_hooks()
        yield pair
        pair.close()


@pytest.fixture
def sides(pd):
    """``sides(prefill_on, decode_on)``: set each manager's switch as its server would read it."""

    def set_sides(prefill_on: bool, decode_on: bool):
        pd_integrity.configure(pd.prefill, prefill_on)
        pd_integrity.configure(pd.decode, decode_on)

    yield set_sides
    set_sides(False, False)


@pytest.fixture
def landing(monkeypatch):
    """Every queued sum stays "on its way" (what its CUDA event answers before the copy landed) until the test
    sets ``landing.landed``; on CPU tensors they land at once."""
    from types import SimpleNamespace

    held = SimpleNamespace(landed=False)
    monkeypatch.setattr(pd_integrity.SumsInFlight, "ready", lambda self: held.landed)
    return held


def _counters():
    from dsv4_sm120.index_k.integrity import COUNTERS

    return dict(COUNTERS)


def _delta(before):
    now = _counters()
    return {k: now[k] - before[k] for k in now if now[k] != before[k]}


def _transfer(pd, s, timeout_s: float = 20.0):
    """Run the prefill side of ``s`` until the decode manager holds Success, without polling the receiver."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pd.send_metadata(s)
    deadline = time.monotonic() + timeout_s
    while pd.decode.check_status(s.room) != KVPoll.Success:
        assert time.monotonic() < deadline, f"room {s.room} never reached Success on the decode"
        state = s.sender.poll()
        if state == KVPoll.WaitingForInput and not s.started:
            s.started = True
            s.sender.init(len(s.src), aux_index=s.src_aux)
            # two chunks, as a chunked prefill sends them: positions must follow index_slice
            half = len(s.src) // 2
            s.sender.send(s.src[:half])
            s.sender.send(s.src[half:])
        assert state != KVPoll.Failed, f"prefill failed room {s.room}"
        time.sleep(0.002)


def _finish(pd, s, timeout_s: float = 20.0):
    """Conclude both sides of ``s`` (the loopback's scheduler loops) and free its pages."""
    assert pd.run([s], timeout_s), f"room {s.room} did not conclude"
    assert pd.quiesce(timeout_s)
    pd.recycle()


def _index_k(pd, side: str):
    kv = pd.src_kv if side == "src" else pd.dst_kv
    return kv[KV_LAYERS:]


def test_registered_index_k_buffers_are_found_by_item_length_and_layout_tag(pd):
    assert pd_integrity.index_k_buffers(pd.prefill.kv_args) == [KV_LAYERS + i for i in range(INDEX_K_LAYERS)]
    assert pd_integrity.index_k_buffers(pd.decode.kv_args) == [KV_LAYERS + i for i in range(INDEX_K_LAYERS)]
    # the rows the check reads are the registered memory itself
    rows = pd_rows.page_rows(pd.decode.kv_args, KV_LAYERS)
    assert rows.data_ptr() == pd.dst_kv[KV_LAYERS].data_ptr() and rows.shape[1] == layout.BF16_PAGE_ROW_BYTES


def test_clean_transfer_is_verified_and_succeeds(pd, sides):
    from sglang.srt.disaggregation.base.conn import KVPoll

    sides(True, True)
    before = _counters()
    s = pd.open(n_pages=6)
    _transfer(pd, s)
    assert s.receiver.poll() == KVPoll.Success
    _finish(pd, s)
    assert s.decode_state == KVPoll.Success and s.prefill_state == KVPoll.Success
    assert pd.verify(s)
    assert _delta(before) == {"pd_pages_recorded": 6 * INDEX_K_LAYERS, "pd_pages_checked": 6 * INDEX_K_LAYERS}


@pytest.mark.parametrize("where", ["destination", "source"])
def test_corrupt_page_fails_the_room_with_page_layer_and_switch(pd, sides, caplog, monkeypatch, where):
    """One flipped byte in page 4 of index-K layer 1: in the received page after it landed, or in the
    source page after the prefill checksummed it and before NIXL read it (an in-flight overwrite)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    sides(True, True)
    before = _counters()
    s = pd.open(n_pages=6)
    src_row = _index_k(pd, "src")[1][int(s.src[4])]
    if where == "source":
        record = pd_integrity.PDIndexK.record_send

        def record_then_overwrite(self, manager, room, kv_indices, *args):
            record(self, manager, room, kv_indices, *args)
            if room == s.room and int(s.src[4]) in [int(p) for p in kv_indices]:
                src_row[777] ^= 0x10

        monkeypatch.setattr(pd_integrity.PDIndexK, "record_send", record_then_overwrite)
    _transfer(pd, s)
    if where == "destination":
        _index_k(pd, "dst")[1][int(s.dst[4]), 777] ^= 0x10
    else:
        src_row[777] ^= 0x10  # the loopback's source pool is shared by later tests
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120.index_k.pd_integrity"):
        assert s.receiver.poll() == KVPoll.Failed
    assert s.receiver.poll() == KVPoll.Failed  # sticky
    assert _delta(before) == {"pd_pages_recorded": 12, "pd_pages_checked": 12, "pd_mismatches": 1,
                              "pd_rooms_failed": 1}
    with pytest.raises(KVTransferError) as err:
        s.receiver.failure_exception()  # what the decode's abort path reads
    reason = str(err.value)
    assert f"Room {s.room}" in reason and f"page {int(s.dst[4])} index-K layer 1" in reason
    assert "DSV4_SM120_INDEX_K_CHECKSUM=1" in reason
    assert any(f"destination page={int(s.dst[4])}" in r.getMessage() for r in caplog.records)
    s.decode_state = KVPoll.Failed
    _finish(pd, s)


def test_the_send_and_the_first_received_poll_only_queue_their_sums(pd, sides, landing, caplog):
    """Neither scheduler thread waits for the GPU (a wait at the send serializes the overlap scheduler behind
    the forward in flight): the prefill's send (the real hook, called in this thread) and the decode's first
    Success poll only queue the sums, and any tensor call that makes the host wait fails here. The prefill
    reads its sums in its transfer thread, the decode at a poll once they landed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    sides(True, True)
    before = _counters()
    s = pd.open(n_pages=6)
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120.index_k.pd_integrity"), NoHostSync():
        _transfer(pd, s)
    # the send hook logs what its checksum raised and sends the room unchecked
    assert [f"{r.getMessage()}: {r.exc_info and r.exc_info[1]}" for r in caplog.records] == []
    with NoHostSync():
        assert s.receiver.poll() == KVPoll.Transferring
    landing.landed = True
    assert s.receiver.poll() == KVPoll.Success
    _finish(pd, s)
    assert s.decode_state == KVPoll.Success and pd.verify(s)
    assert _delta(before) == {"pd_pages_recorded": 6 * INDEX_K_LAYERS, "pd_pages_checked": 6 * INDEX_K_LAYERS}


def test_a_room_answers_transferring_until_its_received_sums_land_then_its_verdict(pd, sides, landing, monkeypatch):
    """After upstream's Success the decode's polls answer Transferring while the received rows' sums are on their
    way (queued once, at the first Success poll; nothing counted yet), then the verdict as before: here Failed,
    sticky, for one flipped byte in a received page."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    sides(True, True)
    s = pd.open(n_pages=6)
    _transfer(pd, s)
    queued, queue = [], pd_integrity._queue_sums
    monkeypatch.setattr(pd_integrity, "_queue_sums", lambda *a, **k: queued.append(a) or queue(*a, **k))
    _index_k(pd, "dst")[0][int(s.dst[2]), 5] ^= 0x01
    before = _counters()
    assert [s.receiver.poll() for _ in range(3)] == [KVPoll.Transferring] * 3
    assert len(queued) == 1 and _delta(before) == {}
    assert pd.decode.check_status(s.room) == KVPoll.Success  # upstream's state, untouched while the sums travel
    landing.landed = True
    assert s.receiver.poll() == KVPoll.Failed
    assert s.receiver.poll() == KVPoll.Failed  # sticky
    assert len(queued) == 1
    assert _delta(before) == {"pd_pages_checked": 6 * INDEX_K_LAYERS, "pd_mismatches": 1, "pd_rooms_failed": 1}
    with pytest.raises(KVTransferError, match=f"page {int(s.dst[2])} index-K layer 0"):
        s.receiver.failure_exception()
    s.decode_state = KVPoll.Failed
    _finish(pd, s)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
def test_cuda_sums_are_queued_behind_the_forward_and_read_once_landed():
    """The CUDA path on registered VRAM (no sglang needed): the sums run on the side stream after the current
    stream's work and after an early send's event, and are queued while that forward still runs, with no call
    that makes the host wait; read once landed, they are those of the final bytes."""
    from types import SimpleNamespace

    from dsv4_sm120.kernels.page_checksum import page_checksum_ref

    rows = [torch.zeros(64, layout.BF16_PAGE_ROW_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]
    kv_args = SimpleNamespace(kv_item_lens=[r.shape[1] for r in rows], kv_data_ptrs=[r.data_ptr() for r in rows],
                              kv_data_lens=[r.numel() for r in rows], kv_data_mem_kinds=["VRAM"] * 2,
                              gpu_id=rows[0].device.index or 0)
    pages, positions = np.array([7, 3, 7]), np.array([10, 11, 12])
    pd_integrity._queue_sums(kv_args, [0, 1], pages, positions).value()  # compile before the race, not in it
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):  # the prior forward of an early send
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time before its write lands
        rows[0][7].fill_(9)
        done = torch.cuda.Event()
        done.record(forward)
    torch.cuda._sleep(1_000_000_000)  # the current stream's own write, queued before the send
    rows[1][3].fill_(5)
    with NoHostSync():
        sums = pd_integrity._queue_sums(kv_args, [0, 1], pages, positions, wait_event=done)
    assert not done.query() and not sums.ready()
    got = sums.value()
    want = torch.stack([page_checksum_ref(r.cpu()[torch.as_tensor(pages)]) for r in rows]).numpy()
    assert np.array_equal(got, want) and np.array_equal(sums.positions, positions)
    assert got[0, 0] != page_checksum_ref(torch.zeros(1, layout.BF16_PAGE_ROW_BYTES, dtype=torch.uint8))[0]


@pytest.mark.parametrize("prefill_on, decode_on", [(True, False), (False, True)])
def test_a_peer_without_the_switch_still_pairs_and_transfers(pd, sides, caplog, prefill_on, decode_on):
    from sglang.srt.disaggregation.base.conn import KVPoll

    sides(prefill_on, decode_on)
    before = _counters()
    s = pd.open(n_pages=5)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120.index_k.pd_integrity"):
        _transfer(pd, s)
        assert s.receiver.poll() == KVPoll.Success
    _finish(pd, s)
    assert s.decode_state == KVPoll.Success and pd.verify(s)
    delta = _delta(before)
    if prefill_on:  # the frame was sent and the decode ignored it
        assert delta == {"pd_pages_recorded": 5 * INDEX_K_LAYERS}
    else:  # no frame: logged once for that prefill, room admitted unchecked
        assert delta == {"pd_rooms_unchecked": 1}
        assert any("not checked for prefill" in r.getMessage() for r in caplog.records)


def _sums(buffers=2, pages=3):
    gen = np.random.default_rng(3)
    return PageSums(np.arange(5, 5 + pages, dtype=np.int64), gen.integers(-(2**62), 2**62, (buffers, pages)))


def test_frame_round_trips_and_upstream_parser_ignores_it(pd):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    sums = _sums()
    back = parse_frame(encode_frame(sums))
    assert np.array_equal(back.positions, sums.positions) and np.array_equal(back.sums, sums.sums)
    # the message a prefill with the switch on sends, read by upstream's own (unhooked) parser
    msg = [b"KV_STATUS", b"42", str(int(KVPoll.Success)).encode(), b"0", b"", encode_frame(sums)]
    assert CommonKVManager.parse_kv_status_message(pd.decode, msg) == (42, int(KVPoll.Success), 0, None)


@pytest.mark.parametrize("frame, error", [
    (pd_integrity.MAGIC + b"\x01", "header truncated"),
    (encode_frame(_sums())[:-3], "carries"),
    (encode_frame(PageSums(np.array([-1], dtype=np.int64), np.zeros((2, 1), dtype=np.int64))), "negative"),
    (b"DSV4SM120/index-k-sums/9\0" + bytes(8), "wrong magic"),
])
def test_malformed_frames_are_refused_with_what_is_wrong(frame, error):
    with pytest.raises(FrameError, match=error):
        parse_frame(frame)


def test_malformed_frame_fails_the_room_and_the_listener_lives_on(pd, sides):
    """A Success whose checksum frame does not parse fails that room; the decode's listener thread keeps serving."""
    import zmq
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    from tests.polling import wait_until

    sides(True, True)
    before = _counters()
    bad, plain = pd.open(n_pages=2, prefill=False), pd.open(n_pages=2, prefill=False)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://{pd.decode.local_ip}:{pd.decode.rank_port}")
    success = str(int(KVPoll.Success)).encode()
    try:
        push.send_multipart([b"KV_STATUS", str(bad.room).encode(), success, b"0", b"",
                             pd_integrity.MAGIC + b"\xff" * 3])
        push.send_multipart([b"KV_STATUS", str(plain.room).encode(), success, b"0"])
        assert wait_until(lambda: pd.decode.check_status(plain.room) == KVPoll.Success, 10)
    finally:
        push.close(0)
    assert bad.receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="checksum frame is malformed .*header truncated"):
        bad.receiver.failure_exception()
    assert plain.receiver.poll() == KVPoll.Success  # no frame: admitted unchecked, as an upstream prefill's
    assert _delta(before) == {"pd_rooms_failed": 1, "pd_rooms_unchecked": 1}
    for s in (bad, plain):
        s.decode_state = KVPoll.Failed if s is bad else KVPoll.Success
        s.receiver.clear()
    pd.recycle()


def test_switch_off_registers_no_pd_hook(monkeypatch):
    import dataclasses

    from dsv4_sm120 import hooks as door
    from dsv4_sm120 import settings
    from dsv4_sm120.index_k import hooks

    registered = []
    monkeypatch.setattr(hooks, "hook", lambda target, fn: registered.append(target))
    monkeypatch.setattr(door, "hook", lambda target, fn: registered.append(target))
    pd_targets = [target for target, _ in pd_integrity.HOOKS]
    hooks.register(dataclasses.replace(settings.load(), index_k_checksum=False))
    assert not set(pd_targets) & set(registered)
    registered.clear()
    hooks.register(dataclasses.replace(settings.load(), index_k_checksum=True))
    assert set(pd_targets) <= set(registered)


def test_unconfigured_manager_follows_the_registered_switch_not_the_environment(monkeypatch, pd):
    class Manager:
        kv_args = pd.decode.kv_args

    for on in (False, True):
        pool_harness.switches(monkeypatch, index_k_checksum=on)
        monkeypatch.setenv(pd_integrity.SWITCH, "0" if on else "1")
        assert pd_integrity.state_of(Manager()).enabled is on


def _decode_forward(req):
    """A decode batch of ``req`` as ``Scheduler.run_batch`` receives it (the fields the late-write hook reads)."""
    from types import SimpleNamespace

    return SimpleNamespace(reqs=[req], forward_mode=SimpleNamespace(is_decode=lambda: True))


def _forwards(batch, n: int, hold_list=None) -> None:
    """``n`` decode forwards of ``batch`` on a scheduler of one attention TP rank, whose transfer queue (with its
    hold list) is ``hold_list``."""
    from types import SimpleNamespace

    from dsv4_sm120.index_k import pd_late_writes

    scheduler = SimpleNamespace(attn_tp_size=1, disagg_decode_transfer_queue=hold_list)
    for _ in range(n):
        pd_late_writes.run_batch(lambda scheduler, batch: None, scheduler, batch)


def test_a_late_nixl_write_into_received_pages_fails_the_request_at_its_next_reread(pd, sides):
    """Another room's NIXL write lands in pages a request received and is decoding on (what an aborted
    room's late write does once its pages were handed out again): the request's next re-read finds each
    changed page, counts it once, and fails the request with HTTP 500 naming the room and the switch. Before
    that write, the same re-reads find nothing; a write into the request's partial last page (its own
    decode steps append there) is not a late write."""
    from http import HTTPStatus

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from dsv4_sm120.index_k import pd_late_writes
    from tests.nixl.late_writes import pin_req

    sides(True, True)
    s = pd.open(n_pages=6)
    _transfer(pd, s)
    assert s.receiver.poll() == KVPoll.Success  # the baseline of its 5 full pages is taken here
    req = pin_req(f"req-{s.room}", s.room)
    req.finished = lambda: req.to_finish is not None
    batch = _decode_forward(req)
    before = dict(pd_late_writes.COUNTERS)
    _forwards(batch, 2 * pd_late_writes.EVERY + 1)  # three re-reads (forwards 0, 16, 32), two read back
    clean = {k: pd_late_writes.COUNTERS[k] - before[k] for k in before}
    assert clean["pd_page_rereads_total"] == 3 * 5 * (KV_LAYERS + INDEX_K_LAYERS) and clean["pd_late_writes_total"] == 0

    for layer in pd.dst_kv:
        layer[int(s.dst[-1])] ^= 0x01  # the partial last page: the request's own appends
    late = pd.open(n_pages=3)
    own = late.dst
    late.dst = s.dst[1:4].copy()  # the late room's destination pages are three of the request's full pages
    _transfer(pd, late)
    _forwards(batch, pd_late_writes.EVERY + 1)  # the next re-read, and the forward that reads it back
    found = {k: pd_late_writes.COUNTERS[k] - before[k] for k in before}
    assert found["pd_late_writes_total"] == 3, found
    assert found["pd_late_write_requests_failed_total"] == 1
    assert isinstance(req.to_finish, FINISH_ABORT) and req.to_finish.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert f"room {s.room}" in req.to_finish.message and "DSV4_SM120_INDEX_K_CHECKSUM=1" in req.to_finish.message
    _forwards(batch, pd_late_writes.EVERY)  # the request is finished: no re-read, nothing counted again
    assert pd_late_writes.COUNTERS["pd_late_writes_total"] - before["pd_late_writes_total"] == 3
    late.dst = own  # the loopback's books get the late room's own pages back, not the request's twice
    _finish(pd, late)
    _finish(pd, s)


def test_a_late_write_after_the_sampled_rereads_is_found_at_the_requests_last_forward(pd, sides):
    """A late write that lands after a request's first re-read and before its last forward (its length bound
    reached) is found by the re-read of that last forward; the verdict lands after the answer went out, so it
    is counted and logged, and nothing is failed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from dsv4_sm120.index_k import pd_late_writes
    from tests.nixl.late_writes import pin_req

    sides(True, True)
    s = pd.open(n_pages=6)
    _transfer(pd, s)
    assert s.receiver.poll() == KVPoll.Success
    req = pin_req(f"req-{s.room}", s.room, max_new_tokens=5)
    req.output_ids = [7]
    req.finished = lambda: req.to_finish is not None
    batch = _decode_forward(req)
    before = dict(pd_late_writes.COUNTERS)
    _forwards(batch, 1)  # the first forward's re-read: clean
    late = pd.open(n_pages=2)
    own = late.dst
    late.dst = s.dst[2:4].copy()
    _transfer(pd, late)  # lands after the first re-read, long before the sampled one (forward 16)
    for _ in range(3):  # forwards 2-4; the fourth makes token 5 of 5, its re-read is queued
        req.output_ids.append(7)
        _forwards(batch, 1)
    req.to_finish = "length"  # the answer went out
    _forwards(_decode_forward(pin_req("other", -1)), 1)  # a later forward reads the verdict back
    found = {k: pd_late_writes.COUNTERS[k] - before[k] for k in before}
    assert found["pd_late_writes_total"] == 2 and found["pd_late_write_requests_failed_total"] == 0, found
    assert req.to_finish == "length"
    late.dst = own
    _finish(pd, late)
    _finish(pd, s)


HOLD_S = 0.3  # the decode's deferred-release timeout in the hold tests


def _write_late_into(pd, pages) -> None:
    """Another room's NIXL write lands in ``pages`` (what an aborted room's late write does), and concludes."""
    late = pd.open(n_pages=len(pages))
    own = late.dst
    late.dst = np.array(pages, dtype=late.dst.dtype)
    _transfer(pd, late)
    late.dst = own  # the loopback's books get the late room's own pages back, not the request's twice
    _finish(pd, late)


def test_a_request_failed_for_a_late_write_keeps_its_kv_out_of_the_allocator_until_no_write_can_reach_it(pd, sides):
    """The aborted room whose write landed late may have more writes on their way (NIXL cannot cancel one), so
    the request failed for it must not give its pages to the next request when it finishes. Its KV stays out of
    upstream's allocator, in upstream's hold list, so that the scheduler's idle leak check finds nothing amiss,
    and goes back once the deferred-release timeout has passed; then the books balance with nothing held."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from dsv4_sm120.index_k import pd_late_write_hold, pd_late_writes
    from tests.nixl.late_writes import DecodeKV

    sides(True, True)
    s = pd.open(n_pages=6)
    _transfer(pd, s)
    assert s.receiver.poll() == KVPoll.Success
    kv = DecodeKV(HOLD_S)
    req = kv.admit(s.room, pages=6)
    batch = _decode_forward(req)
    _forwards(batch, 1, kv.queue)  # the first forward's re-read: clean
    _write_late_into(pd, s.dst[1:3])
    _forwards(batch, pd_late_writes.EVERY + 1, kv.queue)  # the next re-read finds it, a later forward fails the request
    assert isinstance(req.to_finish, FINISH_ABORT)
    kv.finish(req)
    own = 6 * kv.PAGE
    assert kv.free_tokens() == kv.total - own, (
        "the failed request's pages went back to the allocator at its finish, where the late writer's next write "
        "lands in another request's KV")
    assert [h.req for h in pd_late_write_hold.held(kv.queue)] == [req] and kv.queue.has_pending_deferred_releases()
    assert kv.idle_leaks() == [], "the held pages read as a leak to the scheduler's idle check"
    assert pd_late_write_hold.sample_gauges() == {"pd_late_write_tokens_held": own}
    kv.queue.resolve_deferred_releases()
    assert kv.free_tokens() == kv.total - own, "the held pages went back before the deferred-release timeout"
    time.sleep(HOLD_S)
    kv.queue.resolve_deferred_releases()
    assert kv.free_tokens() == kv.total and not kv.queue.has_pending_deferred_releases()
    assert kv.idle_leaks() == [] and pd_late_write_hold.sample_gauges() == {"pd_late_write_tokens_held": 0}
    _finish(pd, s)


def _held_behind_an_aborted_room(pd, kv, deliver):
    """A request failed for a late write while the hold list holds an aborted room whose prefill acknowledgement
    is on its way; returns (the request, the room's entry)."""
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from dsv4_sm120.index_k import pd_late_write_hold
    from tests.polling import wait_until

    aborted = pd.open(n_pages=2)
    pd.send_metadata(aborted)
    pd.abort(aborted)  # the decode aborts it; its ABORT_ACK comes back, held on its way
    assert wait_until(lambda: deliver.held, 10.0), "the prefill never acknowledged the abort"
    room = DecodeRequest(req=kv.admit(aborted.room, pages=2), kv_receiver=aborted.receiver, metadata_buffer_index=0)
    kv.queue._defer_release(room)
    failed = kv.admit(pd.new_room(), pages=4)
    failed.to_finish = FINISH_ABORT("a late write")
    pd_late_write_hold.fail(failed, pd.addr, kv.queue)
    kv.finish(failed)
    return failed, room


def _held(kv, req) -> bool:
    from dsv4_sm120.index_k import pd_late_write_hold

    return any(h.req is req for h in pd_late_write_hold.held(kv.queue))


def test_a_late_write_hold_outlasts_the_aborted_rooms_held_at_its_verdict(pd):
    """Any aborted room the decode still holds when the late write is found may be its writer: the failed
    request's pages stay held past the timeout while such a room is held (here quarantined past the timeout, as
    NIXL hardening does without the prefill's acknowledgement), and go back once it was released."""
    from tests.nixl.late_writes import DecodeKV, acks_on_their_way

    kv = DecodeKV(HOLD_S)
    with acks_on_their_way(pd.decode) as deliver:
        failed, room = _held_behind_an_aborted_room(pd, kv, deliver)
        time.sleep(HOLD_S)
        kv.queue.resolve_deferred_releases()
        assert _held(kv, failed), "the hold ended at its timeout while an aborted room that may write was still held"
        deliver()
    kv.queue.resolve_deferred_releases()  # the room drained: upstream releases it
    assert not any(entry[0] is room for entry in kv.queue._deferred_releases)
    kv.queue.resolve_deferred_releases()
    assert not _held(kv, failed) and kv.free_tokens() == kv.total and kv.idle_leaks() == []
    assert pd.quiesce(10.0)  # the aborted room concludes on the loopback too
    pd.recycle()


def test_a_late_write_hold_ends_at_once_when_the_heartbeat_loses_the_prefill(pd, monkeypatch):
    """A prefill the decode's heartbeat declared lost writes no more: the hold ends at once, before its timeout
    and while the aborted room (upstream's business) is still held."""
    from dsv4_sm120.nixl import decode_hold
    from tests.nixl.late_writes import DecodeKV, acks_on_their_way

    monkeypatch.setattr(decode_hold, "_lost_at", {})
    kv = DecodeKV(60.0)
    with acks_on_their_way(pd.decode) as deliver:
        failed, room = _held_behind_an_aborted_room(pd, kv, deliver)
        kv.queue.resolve_deferred_releases()
        assert _held(kv, failed)
        decode_hold.prefill_lost(None, pd.decode, pd.addr)  # the heartbeat's verdict (AFTER _handle_node_failure)
        kv.queue.resolve_deferred_releases()
        assert not _held(kv, failed), "the hold outlived the prefill the heartbeat declared lost"
        assert any(entry[0] is room for entry in kv.queue._deferred_releases)
    kv.queue.resolve_deferred_releases()
    assert kv.free_tokens() == kv.total and kv.idle_leaks() == []
    assert pd.quiesce(10.0)
    pd.recycle()


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
def test_cuda_late_write_rereads_queue_without_a_host_wait_and_find_a_changed_page():
    """The late-write check's CUDA path on registered VRAM: the baseline (side stream) and the re-reads (current
    stream, behind the baseline's event) are queued with no call that makes the host wait, even while the
    current stream is busy; a page changed after the baseline is found once its verdict landed."""
    from types import SimpleNamespace

    from dsv4_sm120.index_k import pd_late_writes

    rows = [torch.randint(0, 256, (64, n), dtype=torch.uint8, device="cuda") for n in (1168, layout.BF16_PAGE_ROW_BYTES)]
    kv_args = SimpleNamespace(kv_item_lens=[r.shape[1] for r in rows], kv_data_ptrs=[r.data_ptr() for r in rows],
                              kv_data_lens=[r.numel() for r in rows], kv_data_mem_kinds=["VRAM"] * 2,
                              gpu_id=rows[0].device.index or 0, kv_layer_ids=[0, 1])
    receiver = SimpleNamespace(kv_mgr=SimpleNamespace(kv_args=kv_args), bootstrap_room=77)
    setattr(receiver, pd_rows.DST, np.array([5, 9, 11, 2]))
    req = SimpleNamespace(rid="gpu-req", bootstrap_room=77, to_finish=None, retraction_count=0)
    req.finished = lambda: req.to_finish is not None
    batch = SimpleNamespace(reqs=[req], forward_mode=SimpleNamespace(is_decode=lambda: True))
    scheduler = SimpleNamespace(attn_tp_size=1)
    before = dict(pd_late_writes.COUNTERS)
    torch.cuda._sleep(1_000_000_000)  # the current stream is busy with a forward
    with NoHostSync():
        pd_late_writes.record(receiver, SimpleNamespace(buffers=[1]))
        pd_late_writes.run_batch(lambda s, b: None, scheduler, batch)  # the first forward's re-read, queued
    torch.cuda.synchronize()
    rows[0][9, 100] ^= 1  # a late write into a full received page of the compressed-KV buffer
    rows[1][2, 7] ^= 1  # and one into the partial last page: not a late write
    for _ in range(pd_late_writes.EVERY + 1):
        pd_late_writes.run_batch(lambda s, b: None, scheduler, batch)
    torch.cuda.synchronize()
    pd_late_writes.run_batch(lambda s, b: None, scheduler, batch)  # reads the landed verdict back
    found = {k: pd_late_writes.COUNTERS[k] - before[k] for k in before}
    assert found["pd_pages_watched_total"] == 3 * 2 and found["pd_late_writes_total"] == 1, found
    assert req.to_finish is not None and "room 77" in req.to_finish.message

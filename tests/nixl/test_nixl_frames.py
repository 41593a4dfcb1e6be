"""No frame from the network kills the prefill bootstrap thread; aborted rooms stay dead."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dsv4_sm120.loopback.pair import FOREIGN_FRAME
from tests.polling import wait_until

KV_SUCCESS = 4  # KVPoll.Success
KV_FAILED = 0


def _one_session_completes(pd, timeout=10.0) -> bool:
    s = pd.open()
    pd.send_metadata(s)
    return pd.run([s], timeout) and s.prefill_state == KV_SUCCESS and s.decode_state == KV_SUCCESS and pd.verify(s)


def test_pin_thread_dies_on_a_foreign_frame_and_sessions_stall(make_pd):
    """The incident, against the pin: one unknown frame, and every later request waits in Bootstrapping."""
    pin = make_pd(hardened=False, seed=2)
    assert _one_session_completes(pin)
    pin.push_raw(FOREIGN_FRAME)
    assert wait_until(lambda: not pin.thread_alive())
    s = pin.open()
    pin.send_metadata(s)
    assert not pin.run([s], 2.0)  # bounded wait: it would sit there for the 300 s bootstrap timeout
    assert pin.prefill.request_status[s.room] == 1  # KVPoll.Bootstrapping


def test_foreign_frame_is_rejected_and_thread_keeps_serving(pd):
    pd.push_raw(FOREIGN_FRAME)
    pd.push_raw([b"NixlMsgGuard", b"1"])  # too few parts
    pd.push_raw([b"NixlMsgGuard", b"\xff\xfe", b"h", b"1", b"agent"])  # room not ascii
    pd.push_raw([b"NixlMsgGuard", b"12x", b"h", b"1", b"agent"])  # room not an int
    pd.push_raw([b"ABORT"])  # ABORT without a room
    assert _one_session_completes(pd)
    assert pd.thread_alive()
    rejected = pd.hardening.rejects.snapshot()["rejected_by_reason"]
    for reason in ("unknown tag", "too few parts", "bad encoding", "bad integer", "bad abort"):
        assert rejected.get(reason, 0) >= 1, rejected


def test_late_transfer_info_after_abort_for_unknown_room_creates_no_room(pd):
    s = pd.open(prefill=False)  # the prefill has not heard of this request yet
    pd.abort(s)  # ABORT for a room the prefill does not know
    pd.run([s], 5.0)
    pd.settle_aborts()
    frame = pd.metadata_frame(s)
    dropped_before = pd.hardening.rejects.snapshot()["late_frames_dropped"]
    pd.push_raw(frame)  # the transfer info lands late
    assert wait_until(lambda: pd.hardening.rejects.snapshot()["late_frames_dropped"] > dropped_before, 5.0), (
        "the late transfer-info frame was not dropped as late")
    assert s.room not in pd.prefill.transfer_infos, "a late transfer-info frame resurrected an aborted room"
    assert s.room not in pd.prefill.request_status, "a late transfer-info frame resurrected an aborted room"
    # And when the prefill finally opens the request, it starts Failed instead of waiting 300 s.
    from sglang.srt.disaggregation.nixl.conn import NixlKVSender

    sender = NixlKVSender(pd.prefill, pd.addr, s.room)
    assert sender.poll() == KV_FAILED
    sender.clear()
    assert s.room not in pd.prefill.request_status


def test_half_registered_peer_is_rolled_back_and_registers_again(make_pd):
    """A registration that fails inside _add_remote_peer must not leave the peer half registered."""
    fresh = make_pd(seed=5)  # its decode has not registered yet
    frame = fresh.decode.build_receiver_registration_message()
    frame[5] = b"not nixl agent metadata"  # add_remote_agent fails after the peer table was written
    fresh.push_raw(frame)
    agent = fresh.decode.agent.name
    assert wait_until(lambda: fresh.hardening is not None and fresh.hardening.rejects.frames_rejected >= 1)
    assert fresh.thread_alive()
    assert agent not in fresh.prefill.decode_kv_args_table
    # The real decode registers (again) and its sessions complete.
    assert _one_session_completes(fresh)
    assert agent in fresh.prefill.decode_kv_args_table


GUARD = b"NixlMsgGuard"
_part = st.one_of(
    st.binary(max_size=24),
    st.integers(-(2**63), 2**64).map(lambda i: str(i).encode()),
    st.sampled_from([b"None", b"", b"127.0.0.1", b"0", b"1", b"\xff", b"-1"]),
)
_tag = st.one_of(st.sampled_from([GUARD, b"ABORT", b"WATERMARK", b"STAGING_RSP", b"KV_STATUS"]), st.binary(max_size=16))
_frames = st.builds(lambda tag, rest: [tag, *rest], _tag, st.lists(_part, max_size=26))


def _fuzz(pd, n_examples):
    sent = []

    # Frames are handled asynchronously, so shrinking an example means nothing here: generate only.
    @settings(max_examples=n_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(frames=_frames)
    def send(frames):
        pd.push_raw(frames)
        sent.append(frames)
        if len(sent) % 100 == 0:  # legitimate traffic interleaved with the garbage
            assert pd.thread_alive(), f"bootstrap thread died within the last 100 frames, e.g. {sent[-100:][:3]}"
            assert _one_session_completes(pd)

    send()
    return sent


def _check_after_fuzz(pd, sent):
    assert wait_until(lambda: pd.hardening.rejects.snapshot()["frames_served"] + pd.hardening.rejects.frames_rejected
                 >= len(sent), timeout=30)
    assert pd.thread_alive()
    assert _one_session_completes(pd)


def test_generated_frames_never_kill_the_thread(make_pd):
    pd = make_pd(seed=6)
    assert _one_session_completes(pd)  # the decode is registered: generated frames meet a live peer table
    sent = _fuzz(pd, 300)
    _check_after_fuzz(pd, sent)


@pytest.mark.slow
def test_ten_thousand_generated_frames_never_kill_the_thread(make_pd):
    pd = make_pd(seed=7)
    assert _one_session_completes(pd)
    sent = _fuzz(pd, 10_000)
    _check_after_fuzz(pd, sent)


def _bad_transfer_info(pd, s) -> list[bytes]:
    """The registered decode's own transfer-info frame for ``s``, with KV indices no int32 array can hold."""
    # The decode registers over its own socket, this frame goes over another: no order between them.
    assert wait_until(lambda: pd.decode.agent.name in pd.prefill.decode_kv_args_table, 5.0), "the decode never registered"
    frame = pd.metadata_frame(s)
    frame[5] = b"\x00\x01\x02"  # 3 bytes: TransferInfo.from_zmq raises in np.frombuffer
    return frame


def test_refused_transfer_info_fails_its_open_room_at_once_with_the_reason(pd):
    """A room whose transfer info was refused cannot be served: it fails now, not after the 300 s timeout."""
    s = pd.open()
    pd.push_raw(_bad_transfer_info(pd, s))
    assert wait_until(lambda: s.sender.poll() == KV_FAILED, 5.0), "the room waited instead of failing"
    assert pd.thread_alive()
    reason = pd.prefill.failure_records.get(s.room, "")
    assert "refused this request's transfer info" in reason and "bad transfer info" in reason, reason
    assert pd.hardening.rejects.snapshot()["rejected_by_reason"].get("bad transfer info", 0) >= 1
    pd.abort(s)  # the decode side gives up too; the session concludes for the pair's later tests
    assert pd.run([s], 5.0)


def test_refused_transfer_info_for_a_room_not_yet_open_makes_it_open_failed(pd):
    s = pd.open(prefill=False)
    pd.push_raw(_bad_transfer_info(pd, s))
    assert wait_until(lambda: s.room in pd.hardening.tombstones, 5.0)
    from sglang.srt.disaggregation.nixl.conn import NixlKVSender

    sender = NixlKVSender(pd.prefill, pd.addr, s.room)  # the prefill request arrives after the bad frame
    assert sender.poll() == KV_FAILED
    assert "refused this request's transfer info" in pd.prefill.failure_records.get(s.room, "")
    sender.clear()
    pd.abort(s)
    assert pd.run([s], 5.0)


def test_aborted_room_no_sender_holds_is_released_not_leaked(pd):
    """Transfer info arrived, the prefill request never did, the decode aborted: nothing may stay behind.

    Found on a real PD pair (tests/e2e, three 80-session storms): 30 such rooms stayed in the
    prefill manager's request_status and transfer_infos for good, because upstream leaves the
    clearing of an aborted room to its sender, and these rooms had none.
    """
    s = pd.open(prefill=False)
    pd.send_metadata(s)
    assert wait_until(lambda: s.room in pd.prefill.request_status, 5.0), "the transfer info never bootstrapped the room"
    pd.abort(s)
    pd.settle_aborts()
    assert wait_until(lambda: s.room not in pd.prefill.request_status and s.room not in pd.prefill.transfer_infos, 5.0), (
        "an aborted room nobody holds stayed in the prefill manager's tables")
    assert pd.run([s], 5.0)


@pytest.fixture(scope="module")
def orphan_pd(make_pd):
    """A pair of its own: these tests leave the decode side of their rooms as a killed decode leaves it."""
    return make_pd(seed=5)


def _bootstrapped(pd, s) -> None:
    pd.send_metadata(s)
    assert wait_until(lambda: s.room in pd.prefill.transfer_infos and s.room in pd.prefill.request_status, 5.0), (
        "the transfer info never bootstrapped the room")


def _own_clock(pd, room: int) -> float:
    """The sweeps are the test's from now on, on its own clock: the bootstrap loop's sweep on the real clock could
    otherwise find the room first, a moment after the test's start, and every later time would be short by that.
    A sweep the loop began before it was told to stop sweeping ends before the loop's next beat: the room's time is
    forgotten only after that beat (a loop sweep that ran between the two once made the test's time late, and the
    room's release came after the test's last sweep; CI under load)."""
    boot = pd.hardening
    boot.sweep_every_s = float("inf")
    told, deadline = time.monotonic(), time.monotonic() + 10.0
    while boot.thread is not None and boot.thread.is_alive() and boot.last_beat <= told and time.monotonic() < deadline:
        time.sleep(0.01)
    boot.unheld_since.pop(room, None)
    return time.monotonic()


def _released(pd, room: int) -> bool:
    return room not in pd.prefill.request_status and room not in pd.prefill.transfer_infos


def _opens_failed_late(pd, room: int) -> bool:
    from sglang.srt.disaggregation.nixl.conn import NixlKVSender

    late = NixlKVSender(pd.prefill, pd.addr, room)
    try:
        return late.poll() == KV_FAILED
    finally:
        late.clear()


def test_a_failed_room_no_request_holds_is_released_when_its_decode_died(orphan_pd):
    """Upstream aborts a prefill request that already bootstrapped (waiting queue, retired forward) with
    ``sender.abort()`` and drops it without ``clear()``: the room stays Failed in the manager's tables, and
    only the decode's ABORT got it released. Seen on an H200 PD pair: a decode killed mid-storm sends none,
    and two rooms stayed on the prefill for good."""
    import gc

    from dsv4_sm120.nixl import bootstrap

    pd = orphan_pd
    s = pd.open()
    _bootstrapped(pd, s)
    s.sender.abort()
    s.sender = None  # the request is dropped; the decode is gone, so no ABORT comes
    gc.collect()
    t0 = _own_clock(pd, s.room)
    pd.hardening.sweep_unheld_rooms(t0)
    assert not _released(pd, s.room), "released on the first sweep (a sender may still be opening)"
    pd.hardening.sweep_unheld_rooms(t0 + bootstrap.SWEEP_EVERY_S)
    assert _released(pd, s.room), "a failed room nobody holds stayed in the prefill manager's tables"
    assert _opens_failed_late(pd, s.room)


def test_a_room_its_decode_announced_and_no_request_claimed_is_released_after_both_timeouts(orphan_pd):
    """The decode's transfer info came; the prefill request never did (a rebootstrap cut off by the decode's
    death). A request may still come within the timeouts; after them, nobody will clear the room."""
    pd = orphan_pd
    s = pd.open(prefill=False)
    _bootstrapped(pd, s)
    boot = pd.hardening
    t0 = _own_clock(pd, s.room)
    boot.sweep_unheld_rooms(t0)
    boot.sweep_unheld_rooms(t0 + boot.unclaimed_after_s - 1)
    assert not _released(pd, s.room), "released while its request may still come"
    boot.sweep_unheld_rooms(t0 + boot.unclaimed_after_s)
    assert _released(pd, s.room), "a room no request claimed stayed in the prefill manager's tables"
    assert _opens_failed_late(pd, s.room)


def _decode_reason(s) -> str:
    try:
        s.receiver.failure_exception()
    except Exception as exc:  # noqa: BLE001 - the decode's failure, as its abort path reads it
        return str(exc)
    return ""


def _prefill_fails_on_its_own(pd, s, reason: str) -> None:
    """What the collective guard does to a request it must drop: tell the decode, then upstream's abort."""
    from dsv4_sm120.nixl import tell_decode

    tell_decode.room_failed(pd.prefill, s.room, reason)
    s.sender.abort()


def test_a_room_the_prefill_fails_is_told_to_its_decode_at_once(pd):
    """The PD router answers the client from the decode: a prefill-only failure must reach it, with its reason.

    Upstream's ``sender.abort()`` marks the room Failed on the prefill only; the decode then waits
    for SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s). Seen on a real TP=2 PD pair (tests/e2e):
    the guard's "safe to retry" abort never reached the client.
    """
    s = pd.open()
    pd.send_metadata(s)
    assert wait_until(lambda: s.sender.poll() == 2, 5.0), "the transfer info never bootstrapped the room"  # WaitingForInput
    _prefill_fails_on_its_own(pd, s, "ranks disagreed (test)")
    assert wait_until(lambda: s.receiver.poll() == KV_FAILED, 5.0), "the decode was never told"
    assert "ranks disagreed (test)" in _decode_reason(s), _decode_reason(s)
    assert pd.run([s], 5.0)


def test_a_room_failed_before_its_transfer_info_arrives_answers_that_transfer_info(pd):
    s = pd.open()
    _prefill_fails_on_its_own(pd, s, "ranks disagreed before bootstrap (test)")
    pd.send_metadata(s)  # the decode's transfer info arrives after the prefill dropped the request
    assert wait_until(lambda: s.receiver.poll() == KV_FAILED, 5.0), "the late transfer info was only dropped"
    assert "ranks disagreed before bootstrap (test)" in _decode_reason(s), _decode_reason(s)
    assert pd.run([s], 5.0)
    assert s.room not in pd.prefill.transfer_infos

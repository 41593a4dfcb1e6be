"""An aborted room's late NIXL write never lands in decode pages another request owns.

Real NIXL agents over UCX and the pin's own managers, bootstrap thread, transfer worker, ABORT and
ABORT_ACK handling and deferred release (``tests.nixl.late_writes`` says what is played). The fault
in each test is a prefill send posted late, as a busy transport posts it: the decode aborts the room
while its write is still on the way.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.nixl import late_writes
from tests.polling import wait_until

SEND_DELAY_S = 1.5
RELEASE_TIMEOUT_S = 0.3  # the decode's deferred-release timeout, well under the send's delay
NEW_OWNER = 0xA5


@pytest.fixture(scope="module")
def safety_pd(make_pd):
    return make_pd(seed=11)  # follows DSV4_SM120_NIXL_HARDENING: set to 0, these tests fail (the pin's behaviour)


def _writing(pd, s, began) -> None:
    """Bootstrap ``s`` and let the prefill start its transfer; return once the worker holds the delayed send."""
    pd.send_metadata(s)
    assert wait_until(lambda: (pd.pump(), began.is_set())[1], 10.0), "the prefill never started the room's send"


def _client_abort(pd, s) -> None:
    pd.abort(s)


def _waiting_timeout(pd, s) -> None:
    """The decode gives up on the room (SGLANG_DISAGGREGATION_WAITING_TIMEOUT): upstream fails it, sends the
    ABORT and arms the drain acknowledgement as a client abort does, so its pages are held too."""
    before = pd.decode.waiting_timeout
    pd.decode.waiting_timeout = 0.2
    try:
        assert wait_until(lambda: s.receiver.poll() == 0, 5.0), "the decode's waiting timeout never failed the room"
    finally:
        pd.decode.waiting_timeout = before
    assert s.receiver.abort_notified, "the waiting timeout did not tell the prefill"
    assert s.room in pd.decode._deferred_abort_ack_tracker, "the waiting timeout's ABORT is not armed for an ack"


@pytest.mark.parametrize("abort", [_client_abort, _waiting_timeout], ids=["client_abort", "waiting_timeout"])
def test_an_aborted_rooms_pages_stay_held_past_the_release_timeout_until_its_late_write_landed(safety_pd, abort):
    """The decode aborts a room whose write is still on its way (the client went, or the decode's waiting
    timeout) and holds its pages (upstream's deferred release); the acknowledgement comes only after the
    write, later than the release timeout. Upstream then releases the pages anyway, the next owner writes
    them, and the late write overwrites that owner's KV. With the package the pages stay quarantined until
    the acknowledgement: the write lands before any new owner has them."""
    from dsv4_sm120.nixl import decode_hold

    pd = safety_pd
    released_at = []

    def released(decode_req):
        released_at.append(time.monotonic())
        late_writes.stamp(pd, s.dst, NEW_OWNER)  # the next request served on these pages writes its KV

    hold = late_writes.HoldList(RELEASE_TIMEOUT_S, released)
    quarantined = []
    with late_writes.slow_send(pd.prefill, SEND_DELAY_S) as began:
        s = pd.open(n_pages=4)
        _writing(pd, s, began)
        abort(pd, s)
        hold.hold(s)
        deadline = time.monotonic() + SEND_DELAY_S + 10.0
        while time.monotonic() < deadline and not released_at:
            hold.resolve()
            quarantined += [(q.room, q.tokens) for q in decode_hold.quarantined(hold.queue)]
            time.sleep(0.005)
    assert released_at, "the pages were never released, even after the prefill acknowledged the drained write"
    time.sleep(max(0.0, began.at + SEND_DELAY_S + 1.0 - time.monotonic()))  # the late write has landed by now
    assert pd.quiesce(10.0)
    assert late_writes.stamped(pd, s.dst, NEW_OWNER), (
        "the aborted room's late NIXL write landed in pages already released to a new owner")
    assert (s.room, 256 * len(s.dst)) in quarantined, (
        f"the pages were held past the timeout but not counted as quarantined with the KV tokens the request holds: "
        f"{sorted(set(quarantined))}")
    assert not decode_hold.quarantined(hold.queue)


def test_upstreams_reopen_of_a_room_mid_write_does_not_let_an_abort_be_acknowledged_early(safety_pd):
    """Upstream counts a room's chunks in flight to know when an abort may be acknowledged, and its opening
    of a room (``update_status`` with an opening status: a request that arrives for the room again) drops
    that count with the room's acknowledgement state. An ABORT that comes after it (another decode rank's,
    or a repeated one) is then acknowledged at once while the write still runs, and that decode frees pages
    the write will land in. The package acknowledges only once no chunk of the room is in a worker's hands."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pd = safety_pd
    listener = late_writes.AckListener()
    landed_at_ack = None
    try:
        with late_writes.slow_send(pd.prefill, SEND_DELAY_S) as began:
            s = pd.open(n_pages=4)
            _writing(pd, s, began)
            pd.abort(s)
            assert wait_until(lambda: (pd.pump(), s.prefill_state is not None)[1], 5.0), "the prefill never failed the room"
            pd.prefill.update_status(s.room, KVPoll.Bootstrapping)  # the room opened again mid-write
            pd.push_raw(listener.abort_frame(s.room))
            deadline = time.monotonic() + SEND_DELAY_S + 10.0
            while time.monotonic() < deadline and not listener.drain():
                time.sleep(0.002)
            if listener.acks:
                landed_at_ack = late_writes.landed(pd, s)
        assert listener.acks, "the abort was never acknowledged, even after the write drained"
        assert landed_at_ack, "the abort was acknowledged while the room's write was still on its way"
    finally:
        listener.close()
        pd.prefill.request_status.pop(s.room, None)
        assert pd.quiesce(10.0)


def test_a_room_whose_handles_outlived_a_failed_sibling_is_acknowledged_once_they_settle(safety_pd, monkeypatch):
    """A batch of a room's writes fails on one handle while another keeps running past upstream's settle
    timeout: upstream poisons the room (no acknowledgement can prove it drained) and the decode keeps its
    pages until its release timeout. The package keeps polling the handles that were still running and
    acknowledges the abort once each has settled, so the decode's held pages come back, and not before."""
    from sglang.srt.disaggregation.nixl import conn

    pd = safety_pd
    monkeypatch.setattr(conn, "NIXL_ERR_SETTLE_TIMEOUT_S", 0.2)
    stuck_s = 2.0
    with late_writes.stuck_handles(pd.prefill, stuck_s) as handles:
        t0 = time.monotonic()
        s = pd.open(n_pages=4)
        pd.send_metadata(s)
        assert wait_until(lambda: (pd.pump(), len(handles) > 1)[1], 10.0), "the prefill never posted the room's writes"
        assert wait_until(lambda: (pd.pump(), s.prefill_state is not None)[1], 5.0), "the broken batch never failed the room"
        pd.abort(s)
        acked = wait_until(lambda: pd.decode.is_abort_release_safe(s.room, 1), stuck_s + 5.0)
        acked_after = time.monotonic() - t0
    assert acked, "the abort was never acknowledged after the room's handles settled"
    assert acked_after >= stuck_s, f"acknowledged {acked_after:.2f} s in, before the running handles settled"
    assert pd.quiesce(10.0)


def test_an_aborted_room_with_a_write_in_flight_stays_in_the_prefills_tables_until_it_drained(safety_pd):
    """The hardened thread drops an aborted room nobody holds from the manager's tables; a room whose write is
    still in a transfer worker's hands keeps them (the worker and the acknowledgement read them) until a
    sweep finds it drained."""
    import gc
    import threading

    pd = safety_pd
    posted = threading.Event()  # the worker posts the write once this is set: nothing below races its clock
    with late_writes.slow_send(pd.prefill, 60.0, until=posted) as began:
        s = pd.open(n_pages=4)
        _writing(pd, s, began)
        s.sender = None  # the prefill request is gone; its chunk is still in the worker's hands
        gc.collect()
        pd.abort(s)
        pd.settle_aborts()
        pd.hardening.sweep_unheld_rooms()
        assert s.room in pd.prefill.request_status, "an aborted room was dropped while its write was in flight"
        posted.set()
        assert wait_until(lambda: late_writes.landed(pd, s), SEND_DELAY_S + 5.0)
    assert wait_until(lambda: (pd.hardening.sweep_unheld_rooms(), s.room not in pd.prefill.request_status)[1], 5.0), (
        "the drained room stayed in the prefill's tables")
    assert pd.quiesce(10.0)


def test_holds_upstream_dropped_leave_nothing_counted_as_quarantined():
    """``release_memory_occupation`` empties upstream's hold list without releasing entry by entry: the rooms
    quarantined there must not stay on the gauge."""
    from types import SimpleNamespace

    from dsv4_sm120.nixl import decode_hold

    queue = SimpleNamespace(_deferred_releases=[])
    queue._dsv4_quarantined = {1: decode_hold.Quarantined(room=7, tokens=512, since=0.0)}
    decode_hold.hold_until_drained(lambda q: None, queue)
    assert decode_hold.quarantined(queue) == []

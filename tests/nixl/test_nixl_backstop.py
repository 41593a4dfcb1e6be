"""The hardened bootstrap loop's backstop: an upstream handler that raises does not end the thread.

Every parse the loop does itself is refused with its own reason (tests/nixl/test_nixl_frames.py);
the backstop is for what the loop cannot foresee, an error raised inside one of upstream's handlers
on a well-formed frame from a registered decode. Replaced: the pin's
``NixlKVManager._handle_abort_notification`` on the loopback pair's real prefill manager, by one that
raises (no real frame makes the pin's handler raise today, which is why it is a stand-in).
"""

from __future__ import annotations

from tests.polling import wait_until


def test_an_upstream_handler_error_on_a_registered_peers_frame_is_refused_and_the_thread_serves_on(
        pd, monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll

    s = pd.open()  # a registered decode's real session
    pd.send_metadata(s)

    def handler_breaks(frames):
        raise RuntimeError("upstream's ABORT handler broke")

    rejects = pd.hardening.rejects
    before = rejects.snapshot()["rejected_by_reason"].get("handler error", 0)
    monkeypatch.setattr(pd.prefill, "_handle_abort_notification", handler_breaks)
    pd.abort(s)  # a well-formed ABORT from that decode
    assert wait_until(lambda: rejects.snapshot()["rejected_by_reason"].get("handler error", 0) > before, 5.0), (
        "the handler's error was not refused as a handler error")
    assert pd.thread_alive()
    monkeypatch.undo()

    fresh = pd.open()
    pd.send_metadata(fresh)
    assert pd.run([fresh], 10.0) and fresh.prefill_state == KVPoll.Success and pd.verify(fresh)

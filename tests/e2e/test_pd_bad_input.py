"""Scenario (f): bad input at the HTTP front of a real PD set (the router) and at each server.

Malformed JSON, a wrong type, an absurd ``max_tokens``, an unknown field, a
client that hangs up mid-stream: each gets an answer that says what was wrong
(a 4xx with a message; an unknown field is ignored, as the OpenAI API does)
or, for the hang-up, nothing at all — and the set serves the next request with
every process healthy and nothing left behind. This is upstream's behaviour,
unchanged by the plugin; the test pins it so a hook can never regress it.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

from harness import checks
from harness.cluster import chat
from harness.servers import http
from tests.e2e import results


def _chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def _hang_up_mid_stream(front: str) -> None:
    """Open a streaming chat on a raw socket, read the first bytes of the answer, close the socket."""
    url = urlparse(front)
    body = b'{"model":"tiny","messages":[{"role":"user","content":"hello"}],"max_tokens":256,"stream":true,"ignore_eos":true}'
    with socket.create_connection((url.hostname, url.port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(256)


def test_bad_requests_get_clear_4xx_and_the_set_keeps_serving(pd, record):
    cases = {
        "malformed json": http("POST", pd.front + "/v1/chat/completions", b'{"model": "tiny", "messages": [', timeout=60),
        "messages not a list": http("POST", pd.front + "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, timeout=60),
        "absurd max_tokens": http("POST", pd.front + "/v1/chat/completions", _chat_body(max_tokens=10**12), timeout=60),
        "negative max_tokens": http("POST", pd.front + "/v1/chat/completions", _chat_body(max_tokens=-5), timeout=60),
        "unknown field": http("POST", pd.front + "/v1/chat/completions", _chat_body(no_such_field=1), timeout=60),
        "malformed json at decode": http("POST", pd.decode.url + "/generate", b"{not json", timeout=60),
        "malformed json at prefill": http("POST", pd.prefill.url + "/generate", b"{not json", timeout=60),
    }
    for _ in range(5):
        _hang_up_mid_stream(pd.front)
    time.sleep(1)
    statuses = {k: s for k, (s, _) in cases.items()}
    after = chat(pd.front, timeout=120)[0]
    health = checks.health(pd)
    left = checks.settle(pd)
    record("f: bad input", results.suite_fix(), statuses=statuses, bodies={k: b[:200].decode(errors="replace") for k, (_, b) in cases.items()},
           request_after=after, health=health, leaks=left)
    for case, (status, body) in cases.items():
        if case == "unknown field":
            assert status == 200, (case, status, body[:300])
        else:
            assert 400 <= status < 500, (case, status, body[:300])
            assert body.strip(), f"{case}: a {status} with no message"
    assert after == 200
    assert set(health.values()) == {200}, health
    assert left == {}, left

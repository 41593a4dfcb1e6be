"""A loopback stand-in for one process of a PD set (test infrastructure): a prefill, a decode or the PD router.

Started with the argument list a real ``sglang.launch_server`` or ``sglang_router.launch_router`` would get, so
the ``pd`` set's own launch lines, process handling (start, kill -9, start again, stop) and scenario code run on
a CPU in seconds. What each answers:

- every role: ``/health``, ``/health_generate``, and ``/metrics`` with the idle gauges at 0;
- the prefill: its bootstrap server's ``/route`` naming a ZMQ socket that counts each frame as a refusal, by the
  hardened thread's reason for a foreign tag; with ``DSV4_SM120_NIXL_HARDENING=0`` the first frame stops that
  thread for good (``/bootstrap_alive`` answers 503), as it stops upstream's;
- the decode, and a server of no PD mode: chats (streamed a token every 20 ms, or whole), six index-K pages checked
  for each; ``/generate`` with ``return_indexer_topk`` answers selections of the hicache checkpoint's shape (six
  C4 layers of top-512), made from the prompt; with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0`` the
  first request after an ``/abort_request`` gets them changed, as a late write into freed pages would;
- the router: chats passed to the decode while the prefill's thread lives; after that they stall, as the pin's do;
- every server: the NIXL hardening's and the guard's hook time, a millisecond and a thousand calls a second each
  while its switch is on.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import struct
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--disaggregation-mode", default=None)
ap.add_argument("--disaggregation-bootstrap-port", type=int)
ap.add_argument("--prefill", nargs=2)
ap.add_argument("--decode")
args, _ = ap.parse_known_args()
role = args.disaggregation_mode or ("router" if args.prefill else "single")
state = {"frames": 0, "alive": True, "pages": 0, "aborted": False}
TOPK_LAYERS, TOPK = 6, 512
STARTED = time.monotonic()
FIX_SWITCHES = {"nixl": "DSV4_SM120_NIXL_HARDENING", "guard": "DSV4_SM120_COLLECTIVE_GUARD"}
lock = threading.Lock()


def metrics() -> str:
    lines = ["sglang:num_running_reqs 0", "sglang:num_used_tokens 0"]
    if role == "prefill":
        lines += [f'sglang:dsv4_nixl_frames_rejected_total{{reason="unknown tag"}} {state["frames"]}',
                  f"sglang:dsv4_nixl_bootstrap_threads_alive {int(state['alive'])}"]
    if role != "router":
        up = time.monotonic() - STARTED
        lines += [f'sglang:dsv4_hook_{kind}_total{{tp_rank="0",fix="{fix}",thread="main"}} {per_s * up}'
                  for fix, env in FIX_SWITCHES.items() if os.environ.get(env) != "0"
                  for kind, per_s in (("seconds", 1e-3), ("calls", 1e3))]
    if role in ("decode", "single"):
        lines += [f"sglang:dsv4_index_k_pd_pages_checked_total {state['pages']}",
                  "sglang:dsv4_index_k_pd_mismatches_total 0"]
    return "\n".join(lines) + "\n"


def bootstrap_thread(sock) -> None:
    while True:
        sock.recv_multipart()
        with lock:
            state["frames"] += 1
        if os.environ.get("DSV4_SM120_NIXL_HARDENING") == "0":
            state["alive"] = False
            print("Exception in thread bootstrap (stand-in): AssertionError", flush=True)
            return


def generated(payload: dict) -> dict:
    """A greedy ``/generate`` answer: tokens, and selections for every position when asked."""
    ids, new = payload["input_ids"], payload["sampling_params"]["max_new_tokens"]
    meta = {"cached_tokens": 0}
    if payload.get("return_indexer_topk"):
        seed = int(hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:6], 16)
        with lock:
            late = state["aborted"] and os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE") == "0"
            state["aborted"] = False
        rows = [(seed + late + r) % 1000 for r in range(len(ids) + new - 1)
                for _ in range(TOPK_LAYERS * TOPK)]
        meta["indexer_topk"] = base64.b64encode(struct.pack(f"{len(rows)}i", *rows)).decode()
    return {"output_ids": [2] * new, "meta_info": meta}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/metrics":
            self._send(200, metrics().encode(), "text/plain")
        elif self.path == "/bootstrap_alive":
            self._send(200 if state["alive"] else 503, b"{}")
        else:
            self._send(200, b"{}")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if role == "router":
            return self._route(body)
        payload = json.loads(body)
        if self.path == "/abort_request":
            state["aborted"] = True
            return self._send(200, b"{}")
        if self.path == "/generate" and role == "decode":
            return self._send(200, json.dumps(generated(payload)).encode())
        with lock:
            state["pages"] += 6
        if not payload.get("stream"):
            whole = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
            return self._send(200, json.dumps(whole).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for _ in range(min(payload.get("max_tokens", 16), 500)):
                self.wfile.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\ndata: [DONE]\n\n')
        except OSError:  # the client went away
            pass
        self.close_connection = True

    def _route(self, body: bytes) -> None:
        prefill = args.prefill[0]
        try:
            urllib.request.urlopen(prefill + "/bootstrap_alive", timeout=5).read()
        except (urllib.error.URLError, OSError):
            time.sleep(60)  # the prefill's bootstrap thread is gone: the request never gets a room
            return self._send(504, b"{}")
        req = urllib.request.Request(args.decode + self.path, data=body, headers={"Content-Type": "application/json"})
        try:
            upstream = urllib.request.urlopen(req, timeout=60)
        except (urllib.error.URLError, OSError) as exc:
            return self._send(502, json.dumps({"error": str(exc)}).encode())
        self.send_response(200)
        self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
        self.end_headers()
        try:
            while chunk := upstream.read1(4096):
                self.wfile.write(chunk)
                self.wfile.flush()
        except OSError:
            pass
        finally:
            upstream.close()
        self.close_connection = True


if role == "prefill":
    sock = zmq.Context.instance().socket(zmq.PULL)
    rank_port = sock.bind_to_random_port("tcp://127.0.0.1")
    threading.Thread(target=bootstrap_thread, args=(sock,), daemon=True).start()

    class Bootstrap(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = json.dumps({"rank_ip": "127.0.0.1", "rank_port": rank_port}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    boot = ThreadingHTTPServer(("127.0.0.1", args.disaggregation_bootstrap_port), Bootstrap)
    threading.Thread(target=boot.serve_forever, daemon=True).start()

ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 256  # an 80-session agent connects at once
ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()

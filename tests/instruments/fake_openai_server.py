"""A small OpenAI-compatible chat server for the serving instruments' tests.

Real ASGI stack (FastAPI on uvicorn, the versions sglang installs) on 127.0.0.1, so the
clients meet real HTTP, real SSE framing and real client disconnects. It stands in for
a DeepSeek-V4 deployment, which cannot run here (no GPU, no weights); what matters
to the instruments — how replies are framed, and the three misbehaviours seen in
production — is switchable through :class:`Behaviour`:

- ``wedge_after_aborts``: once that many streams were cut by the client, no chat request
  gets another byte, new or in flight (the cluster wedged by killing an 80-session agent);
- ``markup_when_inflight`` / ``bad_arguments_when_inflight``: a tool call comes back
  as DeepSeek DSML text in ``content`` (or with arguments that are not JSON) when at
  least that many chat requests are in flight (the C >= 60 tool-call corruption);
- ``token_delay_s``: seconds between streamed frames (slow streams);
- ``unavailable_after_aborts`` / ``unavailable_for_s``: once that many streams were cut,
  answer 503 for that many seconds, then serve again (a server that recovers slowly).

The fake model calls a tool while the conversation holds fewer than ``tool_turns``
tool results, then answers in plain text.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-dsv4"

DSML_CALL = (
    "I will read it.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"{name}\">\n"
    '<｜DSML｜parameter name="path" string="true">src/main.py</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


@dataclass
class Behaviour:
    token_delay_s: float = 0.0
    reply_words: int = 8
    tool_turns: int = 2
    wedge_after_aborts: int | None = None
    markup_when_inflight: int | None = None
    bad_arguments_when_inflight: int | None = None
    unavailable_after_aborts: int | None = None
    unavailable_for_s: float = 0.0


class FakeServer:
    def __init__(self) -> None:
        self.app = self._make_app()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._release: asyncio.Event | None = None
        self.reset()

    def reset(self, **behaviour) -> None:
        """New behaviour and zeroed counters; requests hung by a previous wedge are let go."""
        self.release_hung()
        # Streams of an earlier test that end late must not count against this one.
        self.epoch = getattr(self, "epoch", 0) + 1
        self.behaviour = Behaviour(**behaviour)
        self.inflight = self.max_inflight = 0
        self.aborts = self.completed = self.hung = 0
        self.markup_sent = self.bad_arguments_sent = 0
        self.unavailable_since: float | None = None
        self.refused = 0

    def release_hung(self) -> None:
        if self._loop is not None and self._release is not None:
            self._loop.call_soon_threadsafe(self._release.set)
            self._release = None

    def _wedged(self) -> bool:
        b = self.behaviour
        return b.wedge_after_aborts is not None and self.aborts >= b.wedge_after_aborts

    def _unavailable(self) -> bool:
        b = self.behaviour
        if b.unavailable_after_aborts is None or self.aborts < b.unavailable_after_aborts:
            return False
        if self.unavailable_since is None:
            self.unavailable_since = time.monotonic()
        return time.monotonic() - self.unavailable_since < b.unavailable_for_s

    async def _hang(self) -> None:
        """Never answer (until the test lets go): what a wedged server does to every request."""
        self.hung += 1
        if self._release is None:
            self._release = asyncio.Event()
        await self._release.wait()

    # -- the fake model ---------------------------------------------------------------

    def _reply_plan(self, body: dict) -> tuple[str, str, str | None]:
        """(kind, text, tool name): kind is content | tool | markup | bad_args."""
        b = self.behaviour
        messages = body.get("messages") or []
        tools = [t["function"]["name"] for t in body.get("tools") or []]
        tool_results = sum(1 for m in messages if m.get("role") == "tool")
        if tools and tool_results < b.tool_turns and messages and messages[-1].get("role") in ("user", "tool"):
            if b.markup_when_inflight is not None and self.inflight >= b.markup_when_inflight:
                self.markup_sent += 1
                return "markup", DSML_CALL.format(name=tools[0]), None
            if b.bad_arguments_when_inflight is not None and self.inflight >= b.bad_arguments_when_inflight:
                self.bad_arguments_sent += 1
                return "bad_args", '{"path": "src/ma', tools[0]
            return "tool", json.dumps({"path": "src/main.py"}), tools[0]
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or b.reply_words
        words = limit if body.get("ignore_eos") else min(limit, b.reply_words)
        return "content", "".join(f"word{k} " for k in range(words)), None

    @staticmethod
    def _frame(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> str:
        chunk = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def _frames(self, kind: str, text: str, tool: str | None):
        """The SSE frames of one reply, made lazily (a storm asks for thousands per stream)."""
        yield self._frame({"role": "assistant", "content": ""})
        if kind in ("tool", "bad_args"):
            call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": tool, "arguments": ""}}
            yield self._frame({"tool_calls": [call]})
            for i in range(0, len(text), 6):
                yield self._frame({"tool_calls": [{"index": 0, "function": {"arguments": text[i : i + 6]}}]})
            yield self._frame({}, finish="tool_calls")
        elif kind == "markup":
            # Cut into 5-character frames so a client must join the stream to see the markup.
            for i in range(0, len(text), 5):
                yield self._frame({"content": text[i : i + 5]})
            yield self._frame({}, finish="stop")
        else:
            for word in text.split():
                yield self._frame({"content": word + " "})
            yield self._frame({}, finish="stop")
        yield self._frame(usage={"prompt_tokens": 10, "completion_tokens": len(text.split()), "total_tokens": 10})
        yield "data: [DONE]\n\n"

    def _message(self, kind: str, text: str, tool: str | None) -> dict:
        msg: dict = {"role": "assistant", "content": None if kind in ("tool", "bad_args") else text}
        if kind in ("tool", "bad_args"):
            msg["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"name": tool, "arguments": text}}]
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    # -- the app ----------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

        @app.get("/health")
        async def health():
            return {"ok": True}

        @app.get("/server_info")
        async def server_info():
            return {"fake": True, "internal_states": []}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self._loop = asyncio.get_running_loop()
            b = self.behaviour
            if self._wedged():
                await self._hang()
                return JSONResponse({"error": "released at test teardown"}, status_code=503)
            if self._unavailable():
                self.refused += 1
                return JSONResponse({"error": "recovering from the storm"}, status_code=503)
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            kind, text, tool = self._reply_plan(body)
            if not body.get("stream"):
                try:
                    await asyncio.sleep(b.token_delay_s)
                    self.completed += 1
                    return self._message(kind, text, tool)
                finally:
                    self.inflight -= 1
            frames = self._frames(kind, text, tool)

            epoch = self.epoch

            async def stream():
                outcome = "cut"  # unless the loop below says otherwise: the client went away
                try:
                    for f in frames:
                        if self._wedged():
                            # A wedged server stops streams already in flight too, so a
                            # request that slipped in just before the cut streams never lands.
                            await self._hang()
                            return
                        if self._unavailable():
                            # Likewise a request that slipped in just before the window fails.
                            outcome = "refused"
                            yield 'data: {"error": {"message": "recovering from the storm"}}\n\n'
                            return
                        if b.token_delay_s:
                            await asyncio.sleep(b.token_delay_s)
                        yield f
                    outcome = "completed"
                finally:
                    if epoch == self.epoch:
                        self.inflight -= 1
                        if outcome == "completed":
                            self.completed += 1
                        elif outcome == "refused":
                            self.refused += 1
                        else:
                            self.aborts += 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        return app


@contextmanager
def serve(server: FakeServer):
    """Run ``server`` on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(
        uvicorn.Config(server.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, access_log=False)
    )
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True, name="fake-openai-server")
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake OpenAI server did not start within 20 s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.release_hung()
        uv.should_exit = True
        thread.join(15)
        sock.close()

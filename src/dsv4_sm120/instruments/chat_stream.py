"""One OpenAI chat completion over HTTP, streamed or not, assembled into a :class:`ChatReply`.

Written here (not borrowed from upstream's bench) because the instruments need what a
throughput bench throws away: the streamed ``tool_calls`` deltas put back together,
the ``finish_reason``, whether the stream ended properly, and a way to drop the
connection mid-stream exactly as a killed agent does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


class ChatError(RuntimeError):
    """The request did not yield a complete reply (HTTP error, bad frame, or a cut stream)."""


# What can go wrong on one request: the server's answer, the socket, or our own timeout.
REQUEST_ERRORS = (ChatError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
ERRORS_KEPT = 3  # an instrument's record quotes this many of a level's errors


def keep_error(examples: list[str], exc: BaseException) -> None:
    """Quote ``exc`` in ``examples`` while fewer than ``ERRORS_KEPT`` are there."""
    if len(examples) < ERRORS_KEPT:
        examples.append(f"{type(exc).__name__}: {exc}"[:300])


@dataclass
class ToolCall:
    id: str | None
    name: str
    arguments: str


@dataclass
class ChatReply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    chunks: int = 0
    chunk_at: list[float] = field(default_factory=list)  # perf_counter of each streamed frame that carried output

    def as_message(self) -> dict:
        """The assistant message an agent appends to its history."""
        msg: dict = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


def chat_url(base_url: str) -> str:
    return f"{base_url}/v1/chat/completions"


def _merge_tool_deltas(partial: dict[int, dict], deltas: list[dict]) -> None:
    for d in deltas:
        slot = partial.setdefault(d.get("index", len(partial)), {"id": None, "name": "", "arguments": ""})
        if d.get("id"):
            slot["id"] = d["id"]
        fn = d.get("function") or {}
        slot["name"] += fn.get("name") or ""
        slot["arguments"] += fn.get("arguments") or ""


async def _lines(resp: aiohttp.ClientResponse):
    """The response body line by line; a line over aiohttp's buffer limit is a ChatError, not a crash."""
    try:
        async for raw in resp.content:
            yield raw
    except ValueError as exc:
        raise ChatError(f"stream line too long for the client buffer: {exc}") from None


async def chat(
    session: aiohttp.ClientSession,
    base_url: str,
    payload: dict,
    *,
    headers: dict[str, str] | None = None,
    on_first_chunk=None,
) -> ChatReply:
    """POST ``payload`` to ``/v1/chat/completions``; raise :class:`ChatError` unless a whole reply came back.

    ``on_first_chunk()`` is called when the first streamed frame arrives (the abort
    storm uses it to know which sessions were mid-stream when it pulled the plug).
    """
    start = time.perf_counter()
    reply = ChatReply()
    async with session.post(chat_url(base_url), json=payload, headers=headers or {}) as resp:
        if resp.status != 200:
            body = (await resp.text())[:500]
            raise ChatError(f"HTTP {resp.status}: {body}")
        if not payload.get("stream"):
            try:
                data = await resp.json(content_type=None)
            except ValueError as exc:  # not JSON at all
                raise ChatError(f"unparsable reply body: {exc}") from None
            choice = (data.get("choices") or [{}])[0]
            msg = choice.get("message") or {}
            reply.content = msg.get("content") or ""
            reply.reasoning = msg.get("reasoning_content") or ""
            for c in msg.get("tool_calls") or []:
                fn = c.get("function") or {}
                reply.tool_calls.append(ToolCall(c.get("id"), fn.get("name") or "", fn.get("arguments") or ""))
            reply.finish_reason = choice.get("finish_reason")
            reply.usage = data.get("usage")
            reply.latency_s = reply.ttft_s = time.perf_counter() - start
            return reply

        partial: dict[int, dict] = {}
        done = False
        async for raw in _lines(resp):
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments and keep-alives
            data_text = line[len("data:") :].strip()
            if data_text == "[DONE]":
                done = True
                break
            try:
                data = json.loads(data_text)
            except json.JSONDecodeError as exc:
                raise ChatError(f"unparsable stream frame {data_text[:200]!r}: {exc}") from None
            if reply.chunks == 0:
                reply.ttft_s = time.perf_counter() - start
                if on_first_chunk is not None:
                    on_first_chunk()
            reply.chunks += 1
            if data.get("error"):
                raise ChatError(f"error frame in stream: {json.dumps(data['error'])[:500]}")
            if data.get("usage"):
                reply.usage = data["usage"]
            for choice in data.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                    reply.chunk_at.append(time.perf_counter())
                reply.content += delta.get("content") or ""
                reply.reasoning += delta.get("reasoning_content") or ""
                _merge_tool_deltas(partial, delta.get("tool_calls") or [])
                if choice.get("finish_reason"):
                    reply.finish_reason = choice["finish_reason"]
        if not done and reply.finish_reason is None:
            raise ChatError(f"stream ended after {reply.chunks} frames without finish_reason or [DONE]")
        reply.tool_calls = [ToolCall(s["id"], s["name"], s["arguments"]) for _, s in sorted(partial.items())]
        reply.latency_s = time.perf_counter() - start
        return reply

"""Classify one assistant turn of a tool-using session: tool call, plain content, or corrupted.

"Corrupted" is what the production incident looked like from the agent's side: the
model emitted a tool call, but the server's tool-call parser let DeepSeek's markup
through as text, or handed back arguments no tool can run. The markers below are
the opening tags of the pin's DeepSeek detectors (sglang 0.5.23,
``srt/function_call/deepseekv{3,31,32,4,41}_detector.py``):

- V3.2 / V4 / V4.1 "DSML": ``<｜DSML｜function_calls>``, ``<｜DSML｜tool_calls>``,
  ``<｜DSML｜ calls>`` around ``<｜DSML｜invoke name="...">`` and
  ``<｜DSML｜parameter ...>`` — all share the ``｜DSML｜`` token (full-width bars,
  U+FF5C), so that token alone identifies a leak, whole or cut mid-tag.
- V3 / V3.1: ``<｜tool▁calls▁begin｜>``, ``<｜tool▁call▁begin｜>``, ``<｜tool▁sep｜>`` and
  their ``▁end｜>`` closers.

The ASCII-bar spelling (``<|DSML|``) is matched as well, in case a proxy or client
folds full-width characters. ``tests/instruments`` checks these markers against the
installed detectors, so a pin bump that renames a tag fails there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsv4_sm120.instruments.chat_stream import ChatReply

DEEPSEEK_TOOL_MARKUP: tuple[str, ...] = (
    "｜DSML｜",
    "|DSML|",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)

TOOL_CALL, CONTENT, CORRUPTED = "tool_call", "content", "corrupted"

# Why a turn is corrupted (a turn gets the first that applies, in this order).
MARKUP_IN_CONTENT = "markup_in_content"
MARKUP_IN_REASONING = "markup_in_reasoning"
UNPARSABLE_ARGUMENTS = "unparsable_arguments"
UNKNOWN_TOOL = "unknown_tool"
TOOL_FINISH_WITHOUT_CALLS = "tool_calls_finish_without_calls"

EXCERPT_CHARS = 160


@dataclass(frozen=True)
class TurnClass:
    kind: str  # TOOL_CALL | CONTENT | CORRUPTED
    reason: str | None = None  # set when kind is CORRUPTED
    excerpt: str | None = None  # the offending text, for the report's examples


def find_markup(text: str) -> int:
    """Index of the first DeepSeek tool-call marker in ``text``, or -1."""
    hits = [i for i in (text.find(m) for m in DEEPSEEK_TOOL_MARKUP) if i >= 0]
    return min(hits) if hits else -1


def _around(text: str, at: int) -> str:
    lo = max(0, at - EXCERPT_CHARS // 4)
    return text[lo : lo + EXCERPT_CHARS]


def classify(reply: ChatReply, offered_tools: set[str]) -> TurnClass:
    """One turn's class; ``offered_tools`` are the function names the request offered."""
    for text, reason in ((reply.content, MARKUP_IN_CONTENT), (reply.reasoning, MARKUP_IN_REASONING)):
        at = find_markup(text)
        if at >= 0:
            return TurnClass(CORRUPTED, reason, _around(text, at))
    for call in reply.tool_calls:
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            return TurnClass(CORRUPTED, UNPARSABLE_ARGUMENTS, f"{call.name}({call.arguments[:EXCERPT_CHARS]})")
        if call.name not in offered_tools:
            return TurnClass(CORRUPTED, UNKNOWN_TOOL, f"{call.name!r} not among {sorted(offered_tools)}")
    if reply.tool_calls:
        return TurnClass(TOOL_CALL)
    if reply.finish_reason == "tool_calls":
        return TurnClass(CORRUPTED, TOOL_FINISH_WITHOUT_CALLS, reply.content[:EXCERPT_CHARS])
    return TurnClass(CONTENT)

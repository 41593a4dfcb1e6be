"""The turn classifier: the markers it looks for are the pin's own DeepSeek tool-call tags."""

from __future__ import annotations

import pytest

from dsv4_sm120.instruments.chat_stream import ChatReply, ToolCall
from dsv4_sm120.instruments.classify import (
    CONTENT,
    CORRUPTED,
    TOOL_CALL,
    classify,
    find_markup,
)

TOOLS = {"read_file", "grep"}


def _reply(content="", calls=(), finish="stop", reasoning=""):
    calls = [ToolCall("c", n, a) for n, a in calls]
    return ChatReply(content=content, reasoning=reasoning, tool_calls=calls, finish_reason=finish)


@pytest.mark.parametrize(
    "reply, kind, reason",
    [
        (_reply("The timeout is 30 s."), CONTENT, None),
        (_reply("", [("read_file", '{"path": "a.py"}')], "tool_calls"), TOOL_CALL, None),
        (_reply("Let me check.", [("grep", '{"pattern": "x", "path": "."}')], "tool_calls"), TOOL_CALL, None),
        (_reply("", [("read_file", "")], "tool_calls"), TOOL_CALL, None),  # zero-argument call
        (_reply("", [("read_file", '{"path": "a.')], "tool_calls"), CORRUPTED, "unparsable_arguments"),
        (_reply("", [("read_file", '["a.py"]')], "tool_calls"), CORRUPTED, "unparsable_arguments"),
        (_reply("", [("delete_repo", "{}")], "tool_calls"), CORRUPTED, "unknown_tool"),
        (_reply("", finish="tool_calls"), CORRUPTED, "tool_calls_finish_without_calls"),
        (_reply('ok <｜DSML｜invoke name="grep">'), CORRUPTED, "markup_in_content"),
        (_reply("fine", reasoning="<｜DSML｜tool_calls>"), CORRUPTED, "markup_in_reasoning"),
        (_reply("<|DSML|tool_calls>"), CORRUPTED, "markup_in_content"),  # full-width bars folded to ASCII
        (_reply("the pipe | and DSML are words"), CONTENT, None),
    ],
)
def test_classify(reply, kind, reason):
    got = classify(reply, TOOLS)
    assert (got.kind, got.reason) == (kind, reason)


def test_markup_wins_over_structured_calls_and_excerpt_shows_it():
    text = "x" * 500 + "<｜DSML｜tool_calls><｜DSML｜invoke name=\"grep\">"
    got = classify(_reply(text, [("grep", "{}")], "tool_calls"), TOOLS)
    assert got.kind == CORRUPTED and "<｜DSML｜tool_calls>" in got.excerpt and len(got.excerpt) <= 160


def test_markers_cover_every_deepseek_detector_of_the_pin():
    """A pin bump that renames or adds a DeepSeek tool-call tag must fail here, not hide leaks."""
    import importlib
    import pkgutil

    import sglang.srt.function_call as fc

    names = [m.name for m in pkgutil.iter_modules(fc.__path__)]
    names = sorted(n for n in names if n.startswith("deepseek") and n.endswith("_detector"))
    assert {f"deepseekv{v}_detector" for v in ("3", "31", "32", "4", "41")} <= set(names)
    checked = 0
    for name in names:
        module = importlib.import_module(f"{fc.__name__}.{name}")
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__ and hasattr(cls, "has_tool_call")):
                continue
            detector = cls()
            for tag in filter(None, (detector.bot_token, detector.eot_token, getattr(detector, "invoke_start_token", ""))):
                assert find_markup(f"prose {tag} more") >= 0, (cls.__name__, tag)
                if "DSML" in tag:  # cut mid-tag, as a stream stopped early leaves it
                    assert find_markup(f"prose {tag[:8]}") >= 0, (cls.__name__, tag[:8])
            checked += 1
    assert checked >= 5

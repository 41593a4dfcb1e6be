"""``dsv4-sm120 toolcall-check``: tool-using agent sessions per concurrency, each turn classified.

Why: at C >= 60, 12-18 % of tool calls in production came back as DeepSeek's DSML
markup inside the assistant ``content`` instead of structured ``tool_calls``; agents
then showed the markup to users or stalled. Whether it happens depends on load, so
this harness runs the same multi-turn sessions at each ``--concurrency`` (one session
holds one slot for its whole life, as an agent does) and classifies every assistant
turn with :func:`dsv4_sm120.instruments.classify.classify`: a structured tool call,
plain content, or corrupted (markup in content, arguments that are not a JSON
object, a tool that was not offered). The report gives, per concurrency, the
corruption rate among tool-call turns (structured + corrupted) with examples.

Prints one JSON object; exit status 0 when no level exceeds ``--max-corruption-rate``,
1 when one does, 2 when nothing was measured (no tool-call turn at all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from dsv4_sm120.instruments import common
from dsv4_sm120.instruments.chat_stream import REQUEST_ERRORS, ChatReply, chat, keep_error
from dsv4_sm120.instruments.classify import CONTENT, CORRUPTED, TOOL_CALL, TurnClass, classify

CLEAN, CORRUPT, INCONCLUSIVE = "clean", "corrupted", "inconclusive"


def _tool(name: str, description: str, **params: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("list_dir", "List the entries of a directory of the repository.", path="directory, relative to the repo root"),
    _tool("read_file", "Read a text file of the repository.", path="file path, relative to the repo root"),
    _tool("grep", "Search the repository for a regular expression.", pattern="regular expression", path="where to search"),
    _tool("run_shell", "Run a shell command in the repository and return its output.", command="the command line"),
]
TOOL_NAMES = {t["function"]["name"] for t in TOOLS}

SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to look at the code "
    "before you answer; call one tool at a time and wait for its result."
)
TASKS = (
    "Find where the HTTP server's request timeout is configured and tell me its default.",
    "Which module parses the command line, and what subcommands does it accept?",
    "Find every TODO in src/ and summarise them by file.",
    "Run the unit tests for the cache module and tell me which ones fail.",
    "What does the function load_settings return, and where is it called?",
    "List the files under src/ that import asyncio and explain what each uses it for.",
    "Find the retry logic for outgoing requests and tell me the backoff schedule.",
    "Which environment variables does the package read? Give each with its default.",
)
FOLLOW_UP = "Keep going: use the tools to check your answer against the code."


def _tool_result(name: str, arguments: str) -> str:
    """A deterministic, plausible tool output, long enough to grow the context like real ones."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return "error: the arguments were not valid JSON; call the tool again with a JSON object"
    if not isinstance(args, dict):
        return "error: the arguments must be a JSON object"
    target = args.get("path") or args.get("pattern") or args.get("command") or "."
    hits = [f"  src/pkg/module_{k}.py:{10 * k}: def handler_{k}(request, timeout=30):" for k in range(12)]
    lines = [f"{name} {target}:", *hits]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_endpoint_arguments(parser)
    pos = common.positive
    parser.add_argument(
        "--concurrency", type=pos(int), nargs="+", default=[1, 16, 64], help="concurrency levels, in order (default 1 16 64)"
    )
    parser.add_argument(
        "--sessions", type=pos(int), default=None, help="sessions per level (default: max(concurrency, 8))"
    )
    parser.add_argument("--turns", type=pos(int), default=6, help="assistant turns per session (default 6)")
    parser.add_argument("--max-tokens", type=pos(int), default=1024, help="max_tokens per assistant turn")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="ask for whole replies instead of streams")
    parser.add_argument("--request-timeout", type=pos(float), default=600.0, help="seconds one turn may take")
    parser.add_argument("--level-timeout", type=pos(float), default=3600.0, help="seconds one concurrency level may take")
    parser.add_argument("--examples", type=int, default=5, help="corrupted turns quoted per level (default 5)")
    parser.add_argument(
        "--max-corruption-rate", type=float, default=0.0, help="exit 1 when a level's corruption rate is above this (default 0)"
    )
    parser.add_argument("--out", help="also write the JSON object to this file")


@dataclass
class _Level:
    concurrency: int
    sessions: int
    kinds: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)
    errors: int = 0
    error_examples: list[str] = field(default_factory=list)

    def add(self, cls: TurnClass, session: int, turn: int, keep: int) -> None:
        self.kinds[cls.kind] += 1
        if cls.kind == CORRUPTED:
            self.reasons[cls.reason] += 1
            if len(self.examples) < keep:
                self.examples.append({"session": session, "turn": turn, "reason": cls.reason, "excerpt": cls.excerpt})

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        keep_error(self.error_examples, exc)

    def report(self, duration_s: float, timed_out: bool) -> dict:
        tool_turns = self.kinds[TOOL_CALL] + self.kinds[CORRUPTED]
        turns = sum(self.kinds.values())
        return {
            "concurrency": self.concurrency,
            "sessions": self.sessions,
            "turns": turns,
            TOOL_CALL: self.kinds[TOOL_CALL],
            CONTENT: self.kinds[CONTENT],
            CORRUPTED: self.kinds[CORRUPTED],
            "corruption_rate": self.kinds[CORRUPTED] / tool_turns if tool_turns else None,
            "corrupted_share_of_turns": self.kinds[CORRUPTED] / turns if turns else None,
            "reasons": dict(self.reasons),
            "examples": self.examples,
            "request_errors": self.errors,
            "error_examples": self.error_examples,
            "duration_s": round(duration_s, 3),
            "timed_out": timed_out,
        }


def _assistant_message(reply: ChatReply, session: int, turn: int) -> dict:
    msg = reply.as_message()
    msg["content"] = msg["content"] or ""
    for k, call in enumerate(msg.get("tool_calls") or []):
        call["id"] = call["id"] or f"call_{session}_{turn}_{k}"
    return msg


async def _session(args, http: aiohttp.ClientSession, level: _Level, sid: int, slots: asyncio.Semaphore) -> None:
    base, headers = args.base_url, common.auth_headers(args.api_key)
    async with slots:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[sid % len(TASKS)]}]
        for turn in range(args.turns):
            payload = {
                "model": args.model,
                "messages": messages,
                "tools": TOOLS,
                "tool_choice": "auto",
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "stream": args.stream,
            }
            try:
                reply = await asyncio.wait_for(chat(http, base, payload, headers=headers), args.request_timeout)
            except REQUEST_ERRORS as exc:
                level.error(exc)
                return  # an agent whose request failed stops this task
            level.add(classify(reply, TOOL_NAMES), sid, turn, args.examples)
            msg = _assistant_message(reply, sid, turn)
            messages.append(msg)
            for call in msg.get("tool_calls") or []:
                fn = call["function"]
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": _tool_result(fn["name"], fn["arguments"])}
                )
            if not reply.tool_calls:
                messages.append({"role": "user", "content": FOLLOW_UP})


async def _run_level(args, concurrency: int) -> dict:
    level = _Level(concurrency, args.sessions or max(concurrency, 8))
    slots = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    timed_out = False
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = [asyncio.create_task(_session(args, http, level, sid, slots)) for sid in range(level.sessions)]
        done, pending = await asyncio.wait(tasks, timeout=args.level_timeout)
        if pending:
            timed_out = True
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
    report = level.report(time.perf_counter() - start, timed_out)
    rate = report["corruption_rate"]
    common.log(
        f"C={concurrency:<4} turns={report['turns']:<5} tool_call={report[TOOL_CALL]:<5} content={report[CONTENT]:<5} "
        f"corrupted={report[CORRUPTED]:<4} rate={'n/a' if rate is None else f'{rate:.1%}'} errors={report['request_errors']}"
    )
    return report


async def _run(args) -> dict:
    record = common.provenance("dsv4-sm120 toolcall-check", args)
    record.update(
        turns_per_session=args.turns,
        stream=args.stream,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        max_corruption_rate=args.max_corruption_rate,
    )
    levels = [await _run_level(args, c) for c in args.concurrency]
    measured = [lv for lv in levels if lv["corruption_rate"] is not None]
    if not measured:
        verdict = INCONCLUSIVE
    elif any(lv["corruption_rate"] > args.max_corruption_rate for lv in measured):
        verdict = CORRUPT
    else:
        verdict = CLEAN
    record.update(levels=levels, verdict=verdict)
    return record


def run(args: argparse.Namespace) -> int:
    record = asyncio.run(_run(args))
    common.write_json(args.out, record)
    common.log(f"verdict: {record['verdict']}")
    return {CLEAN: 0, CORRUPT: 1}.get(record["verdict"], 2)

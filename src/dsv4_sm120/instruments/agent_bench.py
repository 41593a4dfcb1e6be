"""``dsv4-sm120 agent-bench``: a multi-turn agent workload that comes back to its history, per concurrency.

Why: HiCache exists to win back prefix-cache speed when agents return to histories that other sessions pushed
out of the device pool, and the incidents this package fixes came from such agents (tool-using sessions on
long shared prefixes, killed mid-run). Upstream's serving bench sends one-shot prompts, so neither HiCache's
gain nor a fix's price on that traffic can be read from it. This instrument runs that traffic:

- ``--sessions`` agent sessions in ``--groups`` groups; a group's sessions share a system prompt of
  ``--prefix-words`` words (the agent's instructions and tool definitions), each session then grows its own
  history (``--start-words`` of it before the first turn): every turn appends an assistant tool call and its
  result of ``--turn-words`` words, and a session past ``--max-history-words`` starts a new task on the same
  prefix.
- ``C`` workers per level take sessions round-robin, one turn each, so a session's next turn comes after
  ``sessions - 1`` other turns: with more sessions than the device pool holds, it finds its history evicted
  (on the host with HiCache, recomputed without), which is the case HiCache is for.
- Every session does ``--turns`` turns per level (the same work at every concurrency and on every server).
  The history is made by the instrument, not from the replies, so two servers see exactly the same prompts
  whatever their outputs; replies are streamed with ``ignore_eos`` (``--no-ignore-eos`` for servers that refuse
  it) so that each turn decodes ``--max-tokens`` tokens.
- ``--level-seconds`` bounds a level: no turn starts after it (those are reported as not started).
- ``--cut-fraction`` of the turns (seeded) drop their stream at its first chunk, as a killed agent does; such a
  turn is counted as cut, not timed, and the session tries again on its next turn.

Per level: TTFT p50/p90/max, request latency p50/p90/max and sum (sent to last frame), inter-token latency p50
(between streamed chunks), output and total (prompt + output) token throughput, turns done, cut and failed
(with the first errors), and the server's own cache hit share: the growth of sglang's ``cached_tokens`` over
its ``prompt_tokens`` counters on ``--metrics-url`` (the prefill's for a PD pair; default ``--base-url``),
beside every other ``sglang:*_total`` counter that moved.
``--repetitions`` runs the levels again, in reverse order every other time (ABBA). Prints one JSON object;
exit 0 when every turn that was not cut was served, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from dsv4_sm120.instruments import common
from dsv4_sm120.instruments.chat_stream import REQUEST_ERRORS, chat, keep_error
from dsv4_sm120.instruments.toolcall_check import TOOLS

PROMPT_TOKENS, CACHED_TOKENS = "sglang:prompt_tokens_total", "sglang:cached_tokens_total"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_endpoint_arguments(parser)
    pos = common.positive
    parser.add_argument("--concurrency", type=pos(int), nargs="+", default=[4, 64], help="levels, in order (default 4 64)")
    parser.add_argument("--sessions", type=pos(int), default=96, help="agent sessions (default 96)")
    parser.add_argument("--groups", type=pos(int), default=8, help="groups of sessions sharing a system prompt")
    parser.add_argument("--turns", type=pos(int), default=3, help="turns per session per level (default 3)")
    parser.add_argument("--prefix-words", type=pos(int), default=1200, help="words of a group's shared system prompt")
    parser.add_argument(
        "--start-words", type=int, default=0, help="words of the history a session has before its first turn (default 0)"
    )
    parser.add_argument("--turn-words", type=pos(int), default=300, help="words of the tool result each turn appends")
    parser.add_argument(
        "--max-history-words", type=pos(int), default=3000, help="a session past this many history words starts over"
    )
    parser.add_argument("--max-tokens", type=pos(int), default=64, help="tokens decoded per turn (default 64)")
    parser.add_argument("--cut-fraction", type=float, default=0.0, help="share of turns cut at their first chunk")
    parser.add_argument("--repetitions", type=pos(int), default=1, help="runs of every level, ABBA order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--level-seconds", type=pos(float), default=None, help="start no turn after this many seconds of a level"
    )
    parser.add_argument("--request-timeout", type=pos(float), default=600.0, help="seconds one turn may take")
    parser.add_argument(
        "--metrics-url", action="append", type=common.normalize_base_url, default=None,
        help="server whose /metrics gives the cache hits (repeatable; default --base-url; a PD pair's prefill)",
    )  # fmt: skip
    parser.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos (servers that reject it)"
    )
    parser.add_argument("--out", help="also write the JSON object to this file")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


@dataclass
class Session:
    """One agent: its group's system prompt and the history it has built so far."""

    index: int
    system: str
    start_words: int = 0
    task_no: int = 0
    history: list[dict] = field(default_factory=list)
    history_words: int = 0

    def messages(self) -> list[dict]:
        task = f"Task {self.task_no} of agent {self.index}: read the repository and fix the failing test."
        if self.start_words:
            notes = _words(random.Random(f"notes:{self.index}:{self.task_no}"), self.start_words)
            task = f"{task}\nWhat you found so far: {notes}"
        return [{"role": "system", "content": self.system}, {"role": "user", "content": task}, *self.history]

    def advance(self, turn_words: int, max_history_words: int, seed: int) -> None:
        """Append this turn's tool call and result; start a new task once the history is too long."""
        rng = random.Random(f"{seed}:{self.index}:{self.task_no}:{len(self.history)}")
        call_id = f"call_{self.index}_{self.task_no}_{len(self.history)}"
        path = f"src/pkg/module_{rng.randrange(100)}.py"
        self.history += [
            {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
             "function": {"name": "read_file", "arguments": f'{{"path": "{path}"}}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": _words(rng, turn_words)},
        ]  # fmt: skip
        self.history_words += turn_words
        if self.history_words > max_history_words:
            self.task_no, self.history, self.history_words = self.task_no + 1, [], 0


def sessions(args) -> list[Session]:
    prefixes = [_words(random.Random(f"{args.seed}:prefix:{g}"), args.prefix_words) for g in range(args.groups)]
    return [Session(i, f"You are coding agent group {i % args.groups}.\n{prefixes[i % args.groups]}", args.start_words)
            for i in range(args.sessions)]  # fmt: skip


def scrape_totals(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every ``sglang:*_total`` series of ``url``'s /metrics, summed over its labels ({} when unreachable)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        if name.endswith("_total"):
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Level:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)  # each served turn's request, sent to its last frame
    prompt_tokens: int = 0
    output_tokens: int = 0
    served: int = 0
    cut: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, exc: BaseException) -> None:
        self.failed += 1
        keep_error(self.errors, exc)


def _payload(args, session: Session) -> dict:
    payload = {"model": args.model, "messages": session.messages(), "tools": TOOLS, "max_tokens": args.max_tokens,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def _turn(args, http: aiohttp.ClientSession, session: Session, cut: bool, level: _Level) -> None:
    task = asyncio.ensure_future(chat(http, args.base_url, _payload(args, session),
                                      headers=common.auth_headers(args.api_key),
                                      on_first_chunk=(lambda: task.cancel()) if cut else None))  # fmt: skip
    await asyncio.wait([task])
    if task.cancelled():
        level.cut += 1
        return
    exc = task.exception()
    if exc is not None:
        if not isinstance(exc, REQUEST_ERRORS):
            raise exc
        level.fail(exc)
        return
    reply = task.result()
    level.served += 1
    level.ttft_s.append(reply.ttft_s)
    level.latency_s.append(reply.latency_s)
    level.itl_s += [b - a for a, b in zip(reply.chunk_at, reply.chunk_at[1:])]
    usage = reply.usage or {}
    level.prompt_tokens += usage.get("prompt_tokens") or 0
    level.output_tokens += usage.get("completion_tokens") or len(reply.chunk_at)
    session.advance(args.turn_words, args.max_history_words, args.seed)


async def run_level(args, concurrency: int, agents: list[Session], rng: random.Random) -> dict:
    """Every session's ``--turns`` turns by ``concurrency`` workers taking sessions round-robin."""
    queue = [(turn, s) for turn in range(args.turns) for s in agents]  # turn-major: a session returns last
    cuts = [rng.random() < args.cut_fraction for _ in queue]
    level, position = _Level(), 0
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30)
    metrics_urls = args.metrics_url or [args.base_url]
    before = [scrape_totals(u) for u in metrics_urls]

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal position
        while position < len(queue) and (stop_at is None or time.perf_counter() < stop_at):
            k, position = position, position + 1
            await _turn(args, http, queue[k][1], cuts[k], level)

    t0 = time.perf_counter()
    stop_at = None if args.level_seconds is None else t0 + args.level_seconds
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    deltas: dict[str, float] = {}
    for url, was in zip(metrics_urls, before):
        now = scrape_totals(url)
        for name in now:
            if now[name] != was.get(name, 0.0):
                deltas[name] = deltas.get(name, 0.0) + now[name] - was.get(name, 0.0)
    prompt, cached = deltas.get(PROMPT_TOKENS), deltas.get(CACHED_TOKENS)
    return {
        "concurrency": concurrency, "sessions": len(agents), "turns": len(queue),
        "not_started": len(queue) - position, "served": level.served, "cut": level.cut, "failed": level.failed,
        "errors": level.errors,
        "duration_s": round(elapsed, 3),
        "ttft_p50_s": _pct(level.ttft_s, 0.5), "ttft_p90_s": _pct(level.ttft_s, 0.9),
        "ttft_max_s": max(level.ttft_s, default=None),
        # a level's time is its requests' latencies (and its workers' gaps between them): where two servers' levels
        # differ at equal TTFT percentiles and ITL, the latencies' tail says whether the requests did
        "latency_p50_s": _pct(level.latency_s, 0.5), "latency_p90_s": _pct(level.latency_s, 0.9),
        "latency_max_s": max(level.latency_s, default=None), "latency_sum_s": round(sum(level.latency_s), 3),
        "itl_p50_s": statistics.median(level.itl_s) if level.itl_s else None,
        "output_tokens_per_s": level.output_tokens / elapsed,
        "total_tokens_per_s": (level.prompt_tokens + level.output_tokens) / elapsed,
        "prompt_tokens": level.prompt_tokens, "output_tokens": level.output_tokens,
        "server_cache_hit": cached / prompt if prompt and cached is not None else None,
        "server_counter_deltas": deltas,
    }  # fmt: skip


async def _run(args) -> dict:
    record = common.provenance("dsv4-sm120 agent-bench", args)
    workload = {k: getattr(args, k) for k in ("sessions", "groups", "turns", "prefix_words", "start_words", "turn_words",
                                              "max_history_words", "max_tokens", "cut_fraction", "seed")}  # fmt: skip
    record.update(workload=workload, levels=[])
    rng = random.Random(args.seed)
    for rep in range(args.repetitions):
        order = args.concurrency if rep % 2 == 0 else list(reversed(args.concurrency))
        for c in order:
            agents = sessions(args)  # every level starts from the same histories
            common.log(f"[rep {rep + 1} C={c}] {len(agents)} sessions x {args.turns} turns")
            level = await run_level(args, c, agents, rng)
            record["levels"].append({"repetition": rep + 1, **level})
            common.log(f"[rep {rep + 1} C={c}] served {level['served']} cut {level['cut']} failed {level['failed']}"
                       f" ttft p50 {level['ttft_p50_s']} out {level['output_tokens_per_s']:.1f} tok/s")  # fmt: skip
    return record


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.cut_fraction < 1.0:
        raise SystemExit(f"--cut-fraction {args.cut_fraction} must be in [0, 1): it is the share of turns cut")
    record = asyncio.run(_run(args))
    common.write_json(args.out, record)
    return 0 if all(lv["failed"] == 0 for lv in record["levels"]) else 1

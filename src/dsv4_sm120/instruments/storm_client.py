"""``dsv4-sm120 storm-client``: cancel N streaming chat sessions at once, then time the recovery.

Why: killing an 80-session agent wedged a PD cluster — every session's connection
dropped in the same instant, the servers aborted the rooms mid-prefill, mid-transfer
and mid-decode, and afterwards no request ever completed again. This client
reproduces that from the outside: it opens ``--sessions`` streaming chats (each on
its own connection, as separate agent workers hold them), closes them all after
``--cancel-after`` seconds, then sends fresh requests (a new one every
``--probe-interval`` seconds, so one stuck request cannot hide a recovered server)
until one completes. "wedged" means none completed within ``--deadline`` seconds.

It prints one JSON object; exit status 0 healthy, 1 wedged, 2 the server did not
answer a request even before the storm (nothing was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from dsv4_sm120.instruments import common
from dsv4_sm120.instruments.chat_stream import REQUEST_ERRORS, chat, keep_error

HEALTHY, WEDGED, UNHEALTHY_BEFORE = "healthy", "wedged", "unhealthy_before_storm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_endpoint_arguments(parser)
    pos = common.positive
    parser.add_argument("--sessions", type=pos(int), default=80, help="streaming sessions in the storm (default 80)")
    parser.add_argument(
        "--cancel-after", type=pos(float), default=5.0, help="seconds after the first session starts to cancel them all"
    )
    parser.add_argument(
        "--ramp", type=float, default=0.0, help="spread the session starts over this many seconds (default 0: all at once)"
    )
    parser.add_argument(
        "--deadline", type=pos(float), default=120.0, help="seconds after the cancel within which a fresh request must complete"
    )
    parser.add_argument("--probe-interval", type=pos(float), default=2.0, help="seconds between fresh requests after the cancel")
    parser.add_argument("--rounds", type=pos(int), default=1, help="storms in a row; stops at the first wedge")
    parser.add_argument(
        "--prompt-words", type=int, default=2000, help="filler words per storm prompt (long prompts abort in prefill)"
    )
    parser.add_argument("--storm-max-tokens", type=pos(int), default=4096, help="max_tokens of storm sessions")
    parser.add_argument("--probe-max-tokens", type=pos(int), default=16, help="max_tokens of the fresh requests")
    parser.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos (servers that reject it)"
    )
    parser.add_argument("--out", help="also write the JSON object to this file")


@dataclass
class _Storm:
    """Where each session of one storm stands: unsent (ramp), waiting, streaming, finished or failed."""

    status: dict[int, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def error(self, i: int, exc: BaseException) -> None:
        self.status[i] = "failed"
        keep_error(self.errors, exc)

    def count(self, what: str) -> int:
        return sum(1 for v in self.status.values() if v == what)


def _storm_payload(args, i: int, round_no: int) -> dict:
    filler = " ".join(f"w{(i * 7 + k) % 997}" for k in range(args.prompt_words))
    payload = {
        "model": args.model,
        "messages": [
            {"role": "system", "content": f"Agent worker {i}, round {round_no}."},
            {"role": "user", "content": f"{filler}\n\nWrite a very long, detailed essay about the text above."},
        ],
        "max_tokens": args.storm_max_tokens,
        "temperature": 0.7,
        "stream": True,
    }
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _probe_payload(args) -> dict:
    return {
        "model": args.model,
        "messages": [{"role": "user", "content": "Reply with the single word: ok"}],
        "max_tokens": args.probe_max_tokens,
        "temperature": 0.0,
        "stream": True,
    }


async def _storm_session(args, i: int, round_no: int, state: _Storm, delay: float) -> None:
    await asyncio.sleep(delay)
    state.status[i] = "waiting"

    def streaming() -> None:
        state.status[i] = "streaming"

    # One client session (one connection) per agent worker: leaving it closes the socket,
    # which is what the server sees when the agent process dies.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) as s:
        try:
            await chat(
                s,
                args.base_url,
                _storm_payload(args, i, round_no),
                headers=common.auth_headers(args.api_key),
                on_first_chunk=streaming,
            )
            state.status[i] = "finished"
        except REQUEST_ERRORS as exc:
            state.error(i, exc)


async def _probe(args, timeout_s: float) -> float:
    """Seconds one fresh request took; raises on any failure or after ``timeout_s``."""
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        await chat(s, args.base_url, _probe_payload(args), headers=common.auth_headers(args.api_key))
    return time.perf_counter() - start


async def _recover(args, cancelled_at: float) -> dict:
    """Fresh requests every ``probe_interval`` until one completes or the deadline passes."""
    end = cancelled_at + args.deadline
    pending: set[asyncio.Task] = set()
    sent, errors, failed = 0, [], 0
    recovery_s = None
    next_launch = time.perf_counter()
    try:
        while recovery_s is None:
            now = time.perf_counter()
            if now >= end:
                break
            if now >= next_launch:
                pending.add(asyncio.create_task(_probe(args, end - now)))
                sent += 1
                next_launch = now + args.probe_interval
            wait_s = max(0.0, min(next_launch, end) - time.perf_counter())
            if not pending:  # every probe so far failed fast (refused, 503): wait for the next launch
                await asyncio.sleep(wait_s)
                continue
            done, _ = await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.discard(task)
                exc = task.exception()
                if exc is None:
                    recovery_s = time.perf_counter() - cancelled_at
                    break
                failed += 1
                keep_error(errors, exc)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return {
        "recovery_s": recovery_s,
        "probes_sent": sent,
        "probes_failed": failed,
        "probes_unanswered_at_deadline": len(pending) if recovery_s is None else 0,
        "probe_errors": errors,
    }


async def _one_round(args, round_no: int) -> dict:
    n = args.sessions
    state = _Storm(status={i: "unsent" for i in range(n)})
    tasks = [
        asyncio.create_task(_storm_session(args, i, round_no, state, args.ramp * i / max(1, n - 1)))
        for i in range(n)
    ]
    await asyncio.sleep(args.cancel_after)
    # Snapshot before cancelling: a cancelled session is neither finished nor failed.
    snapshot = {
        "streaming_at_cancel": state.count("streaming"),
        "waiting_at_cancel": state.count("waiting"),
        "finished_before_cancel": state.count("finished"),
        "failed_before_cancel": state.count("failed"),
        "unsent_at_cancel": state.count("unsent"),
    }
    cancelled_at = time.perf_counter()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    snapshot["storm_errors"] = state.errors
    common.log(
        f"round {round_no}: cancelled {n} sessions ({snapshot['streaming_at_cancel']} streaming, "
        f"{snapshot['waiting_at_cancel']} waiting for a first token); probing for {args.deadline:.0f} s"
    )
    result = {"round": round_no, **snapshot, **await _recover(args, cancelled_at)}
    if snapshot["finished_before_cancel"] == n:
        result["warning"] = "every session finished before the cancel: raise --storm-max-tokens or lower --cancel-after"
    return result


async def _run(args) -> dict:
    record = common.provenance("dsv4-sm120 storm-client", args)
    record.update(
        sessions=args.sessions,
        cancel_after_s=args.cancel_after,
        ramp_s=args.ramp,
        deadline_s=args.deadline,
        rounds_requested=args.rounds,
    )
    try:
        record["baseline_probe_s"] = await _probe(args, args.deadline)
    except REQUEST_ERRORS as exc:
        record.update(
            baseline_probe_s=None,
            baseline_error=f"{type(exc).__name__}: {exc}"[:300],
            rounds=[],
            recovery_s=None,
            verdict=UNHEALTHY_BEFORE,
        )
        return record
    rounds = []
    for r in range(1, args.rounds + 1):
        rounds.append(await _one_round(args, r))
        if rounds[-1]["recovery_s"] is None:
            break
    wedged = rounds[-1]["recovery_s"] is None
    record.update(
        rounds=rounds,
        recovery_s=None if wedged else max(r["recovery_s"] for r in rounds),
        verdict=WEDGED if wedged else HEALTHY,
    )
    return record


def run(args: argparse.Namespace) -> int:
    record = asyncio.run(_run(args))
    common.write_json(args.out, record)
    common.log(f"verdict: {record['verdict']}  recovery_s: {record['recovery_s']}")
    return {HEALTHY: 0, WEDGED: 1}.get(record["verdict"], 2)

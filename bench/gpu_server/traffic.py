"""Requests a GPU serving run sends: token-id prompts made from a seed, greedy ``/generate`` batches, timed.

A batch goes as ONE ``/generate`` call carrying a list of prompts, so the server's scheduler receives all
of them together and every server of a comparison sees the same batch composition (greedy outputs of a
batch can depend on which requests share a step). Prompts are random token ids from a seeded generator:
the same seed gives the same prompt on every server.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import random
import time
import urllib.error
import urllib.request

FIRST_TOKEN = 2  # ids 0 and 1 are the configs' bos / eos


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(length)]


def prompts(seed: int, batch: int, length: int, vocab: int, prefix: list[int] | None = None) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens; with ``prefix``, each is the prefix plus its own tail."""
    head = prefix or []
    return [head + prompt(seed * 1000 + i, length - len(head), vocab) for i in range(batch)]


class RequestFailed(RuntimeError):
    """A request did not answer 200; the message has the server's answer."""

    @property
    def timed_out(self) -> bool:
        """No answer within the request's timeout (connecting or reading), as opposed to an error answer."""
        cause = self.__cause__
        return isinstance(cause, TimeoutError) or isinstance(getattr(cause, "reason", None), TimeoutError)


def request(url: str, path: str, body: dict | None = None, *, timeout: float = 30) -> bytes:
    """The answer of one GET (no body) or JSON POST to ``url + path``; anything but 200 raises RequestFailed."""
    with _answer(url, path, body, timeout) as resp:
        return resp.read()


@contextlib.contextmanager
def _answer(url: str, path: str, body: dict | None, timeout: float):
    """The open answer of a GET (no body) or JSON POST; anything but 200, or a broken read, raises RequestFailed."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            yield resp
    except urllib.error.HTTPError as exc:
        raise RequestFailed(f"{url}{path} answered {exc.code}: {exc.read()[:2000]!r}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise RequestFailed(f"{url}{path}: {exc}") from exc


def generate(url: str, input_ids: list[list[int]], max_new_tokens: int, *, timeout: float = 600,
             return_indexer_topk: bool = False) -> tuple[float, list[dict]]:
    """(seconds, one result per prompt) of a greedy batch that ignores EOS."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    if return_indexer_topk:
        body["return_indexer_topk"] = True
    t0 = time.perf_counter()
    payload = request(url, "/generate", body, timeout=timeout)
    seconds = time.perf_counter() - t0
    out = json.loads(payload)
    return seconds, out if isinstance(out, list) else [out]


def pd_generate(prefill: str, decode: str, bootstrap_port: int, ids: list[int], max_new_tokens: int, *,
                room: int, rid: str | None = None, timeout: float = 120,
                return_indexer_topk: bool = False) -> dict:
    """One greedy request sent to a PD pair the way the router sends it, with no router: the same body, naming the
    prefill's bootstrap address and a room, to the prefill and the decode at once; the decode's result (the
    prefill's answer carries no tokens). A test can then pick the decode (one the router does not know) and
    abort the request by ``rid`` on both sides."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"input_ids": ids, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": room,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if rid is not None:
        body["rid"] = rid
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(request, prefill, "/generate", body, timeout=timeout)
        decoded = {**body, "return_indexer_topk": True} if return_indexer_topk else body
        try:
            out = json.loads(request(decode, "/generate", decoded, timeout=timeout))
        finally:
            first.exception()  # the prefill's side is over too (its error, if any, is the decode's as well)
    return out[0] if isinstance(out, list) else out


def stream_token_times(url: str, input_ids: list[list[int]], max_new_tokens: int, *,
                       timeout: float = 600) -> tuple[float, list[dict[int, float]]]:
    """(seconds, per prompt {completion tokens: arrival time}) of a greedy batch streamed as one ``/generate``
    call: sglang sends each prompt's chunks tagged with its ``index`` and the tokens it has completed so far
    (several at once when the server coalesces), so a decode step is read off the arrivals of one stream,
    without the prefill that a difference of two requests carries."""
    body = {
        "input_ids": input_ids, "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    arrivals: list[dict[int, float]] = [{} for _ in input_ids]
    t0 = time.perf_counter()
    with _answer(url, "/generate", body, timeout) as resp:
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RequestFailed(f"{url}/generate streamed an error: {chunk['error']}")
            done = (chunk.get("meta_info") or {}).get("completion_tokens")
            if done is not None:
                arrivals[chunk.get("index", 0)].setdefault(int(done), now)
    return time.perf_counter() - t0, arrivals


def step_seconds(arrivals: list[dict[int, float]], skip: int) -> float:
    """The decode step of a streamed batch: per prompt, the time from its ``skip``-th token to its last over
    the tokens between; the median over prompts."""
    per_prompt = []
    for times in arrivals:
        counts = sorted(c for c in times if c >= skip)
        if len(counts) >= 2 and counts[-1] > counts[0]:
            per_prompt.append((times[counts[-1]] - times[counts[0]]) / (counts[-1] - counts[0]))
    if not per_prompt:
        raise ValueError(f"no prompt streamed two token counts from {skip} on")
    per_prompt.sort()
    return per_prompt[len(per_prompt) // 2]


def output_ids(result: dict) -> list[int]:
    return list(result.get("output_ids") or [])


def digest(result: dict) -> str:
    """A request's greedy tokens as ``<sha1 prefix>/<count>``: equal tokens, equal digest."""
    ids = output_ids(result)
    return f"{hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]}/{len(ids)}"


def indexer_topk(result: dict, layers: int, topk: int):
    """The captured top-k rows of one request as a numpy int32 array [rows, layers, topk] (sglang returns
    them base64-encoded in ``meta_info.indexer_topk``), or None when the server returned none."""
    import numpy as np

    raw = (result.get("meta_info") or {}).get("indexer_topk")
    if not raw:
        return None
    flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    return flat.reshape(-1, layers, topk)


def own_selections(result: dict, first_row: int, layers: int, topk: int) -> dict | None:
    """{row: digest of each C4 layer's sorted selection} for the rows from ``first_row`` on (those the request
    computed in its own forward: sglang captures by device KV slot, so rows of a prefix it did not compute
    there hold whatever last used those slots), or None when the server returned no selections."""
    rows = indexer_topk(result, layers, topk)
    if rows is None:
        return None
    import numpy as np

    rows = np.sort(rows[first_row:], axis=-1)
    return {first_row + i: hashlib.sha1(row.tobytes()).hexdigest()[:16] for i, row in enumerate(rows)}


def topk_agreement(a: list, b: list, selective_from: int) -> dict:
    """Requests (and rows) whose own-forward selections (``own_selections`` under ``"selections"``) are equal on
    two servers, over the rows both computed from ``selective_from`` on (below it the top-k takes every
    compressed key, so equality says nothing)."""
    out = {"requests": 0, "requests_equal": 0, "rows": 0, "rows_equal": 0, "not_compared": 0}
    for x, y in zip(a, b):
        if not x.get("selections") or not y.get("selections"):
            out["not_compared"] += 1
            continue
        rows = [r for r in x["selections"] if r in y["selections"] and r >= selective_from]
        equal = sum(x["selections"][r] == y["selections"][r] for r in rows)
        out["requests"] += 1
        out["requests_equal"] += int(bool(rows) and equal == len(rows))
        out["rows"] += len(rows)
        out["rows_equal"] += equal
    return out


def get_text(url: str, path: str, timeout: float = 30) -> str:
    return request(url, path, timeout=timeout).decode(errors="replace")


STOP_AFTER_S = 10.0  # a profile still running this long after its work ended is stopped (it exports what it has)


def profile_window(url: str, out_dir, work, *, wait_s: float, steps: int, activities: list[str], name: str,
                   timeout: float, with_stack: bool = True):
    """sglang's profiler on ``steps`` forward steps of ``work()`` (run on its own thread, the profile started
    ``wait_s`` after it; with ``wait_s`` 0 the profile is started first, so its steps are the work's first):
    the trace it wrote (``*.trace.json.gz`` under ``out_dir``), or None after ``timeout``. A work that ends
    before ``steps`` steps ran has its profile stopped ``STOP_AFTER_S`` later, which exports the steps it has.
    ``with_stack``: sglang records every Python call (its default), which slows the host several times over."""
    import threading
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    worker = threading.Thread(target=work, daemon=True)
    if wait_s > 0:
        worker.start()
        time.sleep(wait_s)
    request(url, "/start_profile", {"output_dir": str(out_dir), "num_steps": steps, "activities": activities,
                                    "profile_id": name, "with_stack": with_stack}, timeout=timeout)
    if wait_s <= 0:
        worker.start()
    worker.join(timeout)
    deadline, stop_at = time.monotonic() + timeout, time.monotonic() + STOP_AFTER_S
    while time.monotonic() < deadline:
        traces = sorted(out_dir.rglob("*.trace.json.gz"))
        if traces:
            time.sleep(2.0)  # let the export finish writing
            return traces[-1]
        if stop_at is not None and time.monotonic() > stop_at:  # the work ended before its steps did: stop there
            stop_at = None
            try:
                request(url, "/stop_profile", {}, timeout=timeout)
            except RequestFailed:  # it stopped on its own meanwhile
                pass
        time.sleep(1.0)
    return None

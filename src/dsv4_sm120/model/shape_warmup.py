"""``--warmups dsv4_shapes``: the request shapes a DeepSeek-V4 server meets, served once before it is healthy.

The package compiles its own kernels while the model is built (``kernels/warmup.py``). What a first
request of a new shape still pays is upstream's first use: the top-k selection switching on once a prompt
passes ``4 x index_topk`` tokens, chunked extends over a cached prefix, kernels that upstream compiles on
first call, the allocator growing to a long prompt's activations. On a Hopper GPU the first 4096- and
16384-token requests took 2.5-2.8x their steady latency under CUDA graphs, with upstream's fp8 indexer as
with the package's bf16 one (``bench/results/gpu_serving/``).

sglang runs the warmups named by ``--warmups`` in its HTTP process before it accepts a request, so
``/health`` turns healthy only after these have run. The plan is small and bounded: prompts from 128
tokens up to a few prefill chunks (past that nothing new is met: every chunk is one more extend over a
cached prefix), one batch of concurrent mid-size prompts and one full batch of short ones (decode at the
largest running batch). Each request decodes a few tokens, so decode at that context runs too.

The warmups run inside the window in which sglang's launcher waits for the HTTP app to answer (about 120 s;
past it the launcher kills the server), so the whole warmup has ``BUDGET_S``: each group may take what is left of
it (on a cold JIT cache the first group compiles kernels: on a Hopper GPU it took over 30 s, so a fixed 30 s per group
left every shape cold), and a group that does not finish in it stops the warmup, naming the shapes left cold.
The longest prompt is bounded by half the KV pool the scheduler reported as well as by the context: on a Hopper GPU a HiCache server with a 16384-token pool and
context never scheduled a 16,377-token warmup prompt and never turned healthy. A PD server does not run it:
its requests wait for a decode peer a warmup does not have (a PD prefill served 1 of 22 in 126 s); warm the
pair through the router once both are up.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

logger = logging.getLogger("dsv4_sm120.warmup")

NAME = "dsv4_shapes"
NEW_TOKENS = 4
SHORT, MID = 128, 1024
MIN_LONGEST = 16384  # the longest prompt is at least this (within the context), at most a few chunks
CHUNKS = 4
MAX_BATCH = 64
BUDGET_S = 80.0


def plan(context_len: int, chunk: int | None, max_running: int | None, reserved: int = 0,
         max_input: int | None = None, pool: int | None = None) -> list[tuple[int, int]]:
    """The warmup's groups as (concurrent requests, prompt tokens), in the order they are sent; every prompt
    with its new tokens fits the context (``reserved``: tokens the server adds to each prompt), stays under
    the scheduler's own input limit (``max_input``: the pool or the context, less a margin) and takes at most
    half the KV pool (``pool``: its tokens), so that it can be scheduled beside what the pool holds."""
    room = context_len - reserved - NEW_TOKENS - 1
    if max_input:
        room = min(room, max_input - 1)
    if pool:
        room = min(room, pool // 2)
    chunk = chunk if chunk and chunk > 0 else room
    longest = min(room, max(MIN_LONGEST, CHUNKS * chunk))
    lengths, n = {SHORT, MID}, 2048
    while n < longest:
        lengths.add(n)
        n *= 2
    lengths.add(longest)
    groups = [(1, n) for n in sorted(x for x in lengths if 0 < x <= room)]
    batch = min(max_running or MAX_BATCH, MAX_BATCH)
    return groups + [(min(8, batch), min(MID, room)), (batch, min(SHORT, room))]


async def dsv4_shapes(disaggregation_mode: str, tokenizer_manager) -> None:
    """The warmup itself, as sglang's ``execute_warmups`` calls it."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if disaggregation_mode != "null":
        peer = "decode" if disaggregation_mode == "prefill" else "prefill"
        logger.warning("dsv4-sm120: warmup %s does not run on a PD %s server: its requests would wait for a %s "
                       "peer a warmup does not have; warm the pair through the router once both are up", NAME,
                       disaggregation_mode, peer)
        return
    args = tokenizer_manager.server_args
    groups = plan(tokenizer_manager.context_len, args.chunked_prefill_size, args.max_running_requests,
                  getattr(tokenizer_manager, "num_reserved_tokens", 0), getattr(tokenizer_manager, "max_req_input_len", None),
                  _pool_tokens())
    vocab = tokenizer_manager.model_config.vocab_size
    rng = random.Random(0)

    async def one(tokens: int) -> None:
        req = GenerateReqInput(input_ids=[rng.randrange(vocab) for _ in range(tokens)],
                               sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
        async for _ in tokenizer_manager.generate_request(req, None):
            pass

    t0, sent = time.monotonic(), 0
    for i, (count, tokens) in enumerate(groups):
        if time.monotonic() - t0 > BUDGET_S:
            logger.warning("dsv4-sm120: warmup %s stopped after %.0f s; left cold: %s", NAME, time.monotonic() - t0,
                           _shapes(groups[i:]))
            break
        left = BUDGET_S - (time.monotonic() - t0)
        try:
            await asyncio.wait_for(asyncio.gather(*(one(tokens) for _ in range(count))), left)
        except asyncio.TimeoutError:  # a group the server does not finish: the ones after it would queue behind it
            logger.warning("dsv4-sm120: warmup %s: %dx%d tokens not served in the %.0f s left of its budget; "
                           "stopped, left cold: %s", NAME, count, tokens, left, _shapes(groups[i:]))
            break
        except Exception as exc:  # a shape the server refuses stays cold; the server still starts
            logger.warning("dsv4-sm120: warmup %s: %dx%d tokens refused (%s: %s); that shape stays cold", NAME,
                           count, tokens, type(exc).__name__, exc)
            continue
        sent += count
    logger.info("dsv4-sm120: warmup %s served %d requests in %.1f s (prompts %s tokens)", NAME, sent,
                time.monotonic() - t0, _shapes(groups))


def _pool_tokens() -> int | None:
    """The KV pool's tokens as the scheduler reported them to the HTTP process (None where not known)."""
    try:
        from sglang.srt.entrypoints import http_server

        return int(http_server._global_state.scheduler_info["max_total_num_tokens"])
    except (AttributeError, ImportError, KeyError, TypeError, ValueError):
        return None


def _shapes(groups: list[tuple[int, int]]) -> str:
    return ", ".join(f"{count}x{tokens}" for count, tokens in groups)


def offer_warmup(disaggregation_mode, warmup_names, tokenizer_manager):
    """BEFORE hook on ``execute_warmups``: put ``dsv4_shapes`` in upstream's warmup registry, so
    ``--warmups dsv4_shapes`` finds it; upstream runs the names it is given, unchanged."""
    from sglang.srt.entrypoints import warmup

    warmup._warmup_registry.setdefault(NAME, dsv4_shapes)
    return None

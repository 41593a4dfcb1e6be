"""``--warmups dsv4_shapes`` through upstream's own warmup runner, in a fresh process with the plugin loaded.

The probe loads the plugins as ``sglang.launch_server`` does, imports the real HTTP server module (which binds
``execute_warmups`` by name at import) and runs that binding with a recording tokenizer manager (test
infrastructure: it answers every request at once). What the server would be sent is then checked: every
prompt fits the context, the long ones reach past the top-k threshold and a few chunks, the last groups
run concurrently; a small KV pool bounds the longest prompt to half of it; a group the server does not finish
stops the warmup at its budget, naming what stays cold; a PD server runs none of it and says so.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import asyncio, json, sys, types
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.entrypoints import http_server

    import logging
    from dsv4_sm120.model import shape_warmup
    shape_warmup.BUDGET_S = 1.0
    warned = []
    logging.getLogger("dsv4_sm120.warmup").addHandler(
        type("H", (logging.Handler,), {"emit": lambda self, r: warned.append(r.getMessage())})())

    class RecordingTokenizerManager:
        context_len, num_reserved_tokens = 8192, 0
        refuse_from = 8186  # what the scheduler reports for this context: min(context - 1, pool - 1) - 5
        server_args = types.SimpleNamespace(chunked_prefill_size=2048, max_running_requests=16)
        model_config = types.SimpleNamespace(vocab_size=1000)
        def __init__(self, told, stuck_from=None):
            self.max_req_input_len = self.refuse_from if told else None
            self.stuck_from = stuck_from
            self.seen, self.refused, self.open, self.most_open = [], [], 0, 0
        async def generate_request(self, req, raw):
            if len(req.input_ids) >= self.refuse_from:  # as upstream's validation does
                self.refused.append(len(req.input_ids))
                raise ValueError("Input length exceeds the maximum allowed length")
            if self.stuck_from and len(req.input_ids) >= self.stuck_from:  # a prompt the scheduler never takes
                await asyncio.sleep(3600)
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            await asyncio.sleep(0)
            self.seen.append({"tokens": len(req.input_ids), "max_id": max(req.input_ids),
                              "new": req.sampling_params["max_new_tokens"], "host": req.bootstrap_host})
            self.open -= 1
            yield {}

    out = {}
    for case, mode, told, pool, stuck in (("null", "null", True, None, None), ("prefill", "prefill", True, None, None),
                                          ("decode", "decode", True, None, None),
                                          ("limit_unknown", "null", False, None, None),
                                          ("small_pool", "null", True, 6000, None), ("stuck", "null", True, None, 4096)):
        http_server._global_state = types.SimpleNamespace(scheduler_info={"max_total_num_tokens": pool}) if pool else None
        tm = RecordingTokenizerManager(told, stuck)
        warned.clear()
        asyncio.run(http_server.execute_warmups(mode, [sys.argv[1]], tm))
        out[case] = {"seen": tm.seen, "most_open": tm.most_open, "refused": tm.refused, "warned": list(warned)}
    print("PROBE" + json.dumps(out))
    """
)


@functools.lru_cache(maxsize=None)  # one fresh process per warmup name
def _probe(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_PLUGINS", "DSV4_SM120_"))}
    proc = subprocess.run([sys.executable, "-c", PROBE, name], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("PROBE"):])


def test_warmups_dsv4_shapes_serves_every_shape_before_the_server_is_up():
    out = _probe("dsv4_shapes")
    seen = out["null"]["seen"]
    lengths = [r["tokens"] for r in seen]
    assert seen and all(r["tokens"] + r["new"] < 8192 and r["max_id"] < 1000 for r in seen)
    assert {128, 2048, 4096}.issubset(lengths) and max(lengths) == 8185  # past 4 x 512 keys, 4 chunks, the limit
    assert out["null"]["refused"] == []
    assert lengths.count(128) >= 16 and out["null"]["most_open"] == 16  # a full batch at once
    assert all(r["host"] is None for r in seen)


def test_a_pd_server_runs_no_warmup_and_says_why():
    out = _probe("dsv4_shapes")
    for mode, peer in (("prefill", "decode"), ("decode", "prefill")):
        said = f"does not run on a PD {mode} server: its requests would wait for a {peer} peer"
        assert out[mode]["seen"] == [] and any(said in w for w in out[mode]["warned"]), out[mode]["warned"]


def test_the_longest_prompt_takes_at_most_half_the_pool():
    small = _probe("dsv4_shapes")["small_pool"]
    assert max(r["tokens"] for r in small["seen"]) == 3000 and small["refused"] == []


def test_a_group_the_server_does_not_finish_stops_the_warmup_at_its_budget_naming_what_stays_cold():
    stuck = _probe("dsv4_shapes")["stuck"]
    assert max(r["tokens"] for r in stuck["seen"]) < 4096
    assert any("1x4096 tokens not served in the 1 s left of its budget; stopped, left cold: 1x4096" in w
               for w in stuck["warned"]), stuck["warned"]


def test_a_shape_the_server_refuses_stays_cold_and_the_rest_still_run():
    out = _probe("dsv4_shapes")["limit_unknown"]
    assert out["refused"] == [8192 - 4 - 1]
    assert out["seen"][-1]["tokens"] == 128 and out["most_open"] == 16  # the groups after it ran


def test_an_unknown_warmup_name_is_left_to_upstream():
    out = _probe("no_such_warmup")
    assert all(case["seen"] == [] for case in out.values())

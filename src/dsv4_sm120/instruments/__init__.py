"""The instruments a user points at a live OpenAI-compatible endpoint (``--base-url``, ``--model``).

Why they exist: every performance fix is judged at low and high concurrency, and the
two production incidents this package fixes were found with agent workloads — killing
an 80-session agent wedged a PD cluster, and at C >= 60 a share of tool calls came
back as DeepSeek DSML markup in the assistant content. Users need the same four
instruments against their own deployment, before and after switching each fix on:

- :mod:`.serving` (``dsv4-sm120 bench-serving``): drives upstream's
  ``python -m sglang.benchmark.serving`` once per concurrency and keeps its JSON
  together with the launch flags and the ``DSV4_SM120_*`` switches in force.
- :mod:`.storm_client` (``dsv4-sm120 storm-client``): N streaming sessions cancelled
  at once, then the time until a fresh request completes, or "wedged".
- :mod:`.agent_bench` (``dsv4-sm120 agent-bench``): multi-turn agent sessions on shared
  prefixes that come back to histories others pushed out of the device pool (HiCache's case):
  TTFT, ITL, throughput and the server's cache hits per concurrency.
- :mod:`.toolcall_check` (``dsv4-sm120 toolcall-check``): multi-turn tool-using
  sessions per concurrency; each assistant turn classified by :mod:`.classify`.

None of these import sglang (the serving wrapper runs it in a child process), so
they start fast and run from any machine that can reach the endpoint.

The abort storm over an in-process NIXL pair, for a machine without a cluster, is :mod:`dsv4_sm120.loopback`.
"""

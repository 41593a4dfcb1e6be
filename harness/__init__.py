"""What the tests, the benchmarks and the tools share: starting and stopping servers (``servers``), the PD cluster
behind the router (``cluster``), the checks and traffic of the PD scenarios (``checks``, ``scrape``, ``storm``,
``hostile``, ``decode_kill``, ``traffic``), the tiny Llama checkpoint (``tiny_model``), the DeepSeek-V4
checkpoints of the GPU sets (``dsv4_checkpoints``), the CPU environment (``environment``), the pin's loops on
forked gloo ranks (``pd_loop``, ``pristine``), the top-k stand-ins (``topk_standins``), the date and commit
every record starts with (``run_record``) and the test-only sglang plugins a server loads from its
``PYTHONPATH`` (``faults``). Tests, benchmarks and tools import it; it imports none of them."""

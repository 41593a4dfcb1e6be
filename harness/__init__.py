"""What the tests and the benchmarks share: starting and stopping servers (``servers``), the PD cluster behind
the router (``cluster``), the checks and traffic of the PD scenarios (``checks``, ``scrape``, ``storm``,
``hostile``, ``decode_kill``, ``traffic``), the tiny checkpoint (``tiny_model``), the CPU environment
(``environment``), the pin's loops on forked gloo ranks (``pd_loop``, ``pristine``), the top-k stand-ins
(``topk_standins``), the date and commit every record starts with (``run_record``) and the test-only sglang plugins a server loads from its ``PYTHONPATH`` (``faults``).
Tests and benchmarks import it; it imports neither."""

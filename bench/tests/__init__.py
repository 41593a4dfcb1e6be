"""The benchmarks' own tests: the GPU sets' runner, scenarios and records checked on CPU stand-ins (``gpu_server``),
their ``-m gpu`` bars on a GPU host, and the results page (``test_results``). In the default suite through
``testpaths`` in pyproject.toml; they import ``bench`` and ``harness``, never ``tests``."""

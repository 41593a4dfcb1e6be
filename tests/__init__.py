"""The test suite. A package, with the repository root on pytest's path (``pythonpath`` in pyproject.toml),
so its modules import by full name: ``from tests import polling``; what it shares with the benchmarks (servers,
the PD cluster, checks, the loop harness) is the top-level ``harness`` package: ``from harness import cluster``."""

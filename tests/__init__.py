"""The test suite. A package, with the repository root on pytest's path (``pythonpath`` in pyproject.toml),
so its harness modules import by full name: ``from tests.e2e import cluster``, ``from tests import polling``."""

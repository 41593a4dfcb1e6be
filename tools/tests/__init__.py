"""The repository tools' own tests (the air-gap bundle: ``test_bundle``, ``test_fatbin``). In the default suite
through ``testpaths`` in pyproject.toml; they import ``tools`` and ``harness``, never ``tests`` or ``bench``."""

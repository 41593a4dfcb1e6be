"""The record a ``-m gpu`` test asserts on: a committed run's (named by an environment variable), or a new run.

On a CUDA host with the pin, from the repository root in the unpacked bundle's environment, the set is run
and its record returned; with the variable set, the record it names is read instead (the committed one, on
any machine). Without a CUDA device and no record it fails: a GPU bar that cannot be checked is not passed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest


def results(env: str, set_name: str, *args: str) -> dict:
    """The ``results`` of the record ``$env`` names, else of ``python -m bench.gpu_server run set_name *args``."""
    given = os.environ.get(env)
    if given:
        return json.loads(Path(given).read_text())["results"]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.fail(f"needs a CUDA device with the pin's stack, or {env} naming a run's record")
    from bench.gpu_server import run as runner

    out = Path(tempfile.mkdtemp()) / f"gpu_{set_name}.json"
    rc = runner.main([set_name, "--out", str(out), *args])
    record = json.loads(out.read_text())
    assert rc == 0, record.get("error", "")[:4000]
    return record["results"]

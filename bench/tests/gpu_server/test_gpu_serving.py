"""Real DeepSeek-V4 sglang servers on a CUDA host with the pin: scenarios a, b and f of the serving run.

``python -m bench.gpu_server run serve`` starts upstream (``--model-impl sglang``) and the package
(``--model-impl dsv4``, bf16 and fp8 keys), eager and with decode CUDA graphs, on the tiny checkpoint,
sends the grid of greedy batches and stops everything; these tests read its JSON. Run on the GPU host,
from the repository root, in the unpacked bundle's environment::

    source /tmp/dsv4-bundle/root/env.sh && python -m pytest -m gpu bench/tests/gpu_server -p no:cacheprovider

``DSV4_GPU_SERVING_JSON`` names where the run's JSON goes (default: a temporary directory);
``DSV4_GPU_SERVING_RECORD`` names a committed record to assert on instead, on any machine. Without either a
CUDA device or a record the tests fail: a GPU bar that cannot be checked is not passed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def served() -> dict:
    given = os.environ.get("DSV4_GPU_SERVING_RECORD")
    if given:
        return json.loads(Path(given).read_text())
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device with the pin's stack, or DSV4_GPU_SERVING_RECORD naming a run's record")
    from bench.gpu_server import run

    out = Path(os.environ.get("DSV4_GPU_SERVING_JSON") or Path(tempfile.mkdtemp()) / "gpu_serving.json")
    rc = run.main(["serve", "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0, record.get("error", "")[:4000]
    return record


def test_a_both_impls_serve_every_batch_eager_and_with_graphs(served):
    assert set(served["results"]["a_served"]) == {"sglang_graph", "dsv4_graph", "dsv4fp8_graph",
                                                  "sglang_eager", "dsv4_eager"}
    assert all(served["results"]["a_served"].values()), served["results"]["a_served"]
    assert served["dead_after_traffic"] == []


def test_b_fp8_keys_under_the_package_give_upstreams_tokens(served):
    cmp = served["results"]["b_fp8_equals_upstream"]
    assert cmp["equal"] == cmp["requests"], cmp["per_point"]


def test_b_top512_overlap_of_bf16_and_fp8_keys_is_reported(served):
    overlap = served["results"]["b_topk_overlap_bf16_vs_fp8"]
    for ctx, figures in overlap.items():
        assert figures.get("rows", 0) > 0, (ctx, figures)
        # below 1: the two key formats select differently, so the bf16 keys are in use; at least 0.95: the bf16
        # path selects what the fp8 path does up to fp8's rounding (0.978-0.991 on an H200), not another KV
        assert 0.95 <= figures["mean"] < 1.0, (ctx, figures)


def test_f_each_package_server_logs_what_it_built_once(served):
    lines = served["results"]["f_model_built_lines"]
    for name in ("dsv4_graph", "dsv4_eager"):
        assert len(lines[name]) == 1 and "with bf16 index keys: 2 of 2 C4 indexers replaced" in lines[name][0]
    assert len(lines["dsv4fp8_graph"]) == 1 and "with fp8 index keys: 0 of 2" in lines["dsv4fp8_graph"][0]
    assert lines["sglang_graph"] == lines["sglang_eager"] == []


def test_e_first_request_of_each_shape_within_2x_of_its_steady_state(served):
    ratios = served["results"]["e_first_over_steady"]
    for name in ("dsv4_graph", "dsv4_eager"):
        slow = {shape: r for shape, r in ratios[name].items() if r > 2.0}
        assert not slow, (name, slow)

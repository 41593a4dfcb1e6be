"""An eager indexer call does its host work once per argument layout, not once per call.

On the H200 an eager logits call of 1 x 131072 keys took 2.20 ms, against 0.018 ms in a CUDA graph: the
decode split search ran on every call, and Triton's dispatch bound and specialized 28 arguments on every call;
with both cached, 61 us for a 3 us kernel. Here, without timing anything: each wrapper works out its checks,
split count, grid and launch once per layout of its arguments and the split search once per split key (the
interpreter runs the real wrappers), and in a fresh interpreter where the kernels compile for sm_90 through
Triton's real JIT and launcher with only the GPU driver and Triton's C launch function stood in
(launch_run.py), the direct launch hands the C launcher exactly the arguments Triton's own launch did, Triton's
dispatch runs only for the first call, and a steady-state call makes no torch operation but its outputs'
allocations and executes a few dozen lines of Python in the package and in Triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.helpers import harness_result, logits_case

HARNESS = Path(__file__).with_name("launch_run.py")
# index_query_out and mqa_logits_bound: the calls as the model makes them, into a forward's shared buffers
# query_store: a forward's query and key store in one launch (kernels/query_store.py), as a layer on one stream calls it
WRAPPERS = ("index_query", "index_query_out", "mqa_logits", "mqa_logits_bound", "index_k_store", "query_store")
# Python lines a steady-state eager call executes in the package and Triton (today 30-36; 105-176 with a cached
# specialization key per call and Triton's launcher; a decode split search at the capture width adds about 850
# for the harness's 8 rows, a plan about 100)
MAX_LINES = 60
MAX_LINES_BOUND = 32  # a forward's bound logits call: 27 today, 45 keying its plan on all six tensors again
ALLOCATIONS = {"index_query": 2, "index_query_out": 0, "mqa_logits": 1, "mqa_logits_bound": 0,
               "index_k_store": 0, "query_store": 0}  # the outputs


def test_logits_plan_and_split_search_once_per_layout(kern, monkeypatch):
    ml = kern.mqa_logits
    monkeypatch.setattr(ml, "_SPLITS", {})
    monkeypatch.setattr(ml, "_PLANS", {})
    plans, searches = [], []
    plan, search = ml._logits_plan, ml._search_splits
    monkeypatch.setattr(ml, "_logits_plan", lambda *a: plans.append(a) or plan(*a))
    monkeypatch.setattr(ml, "_search_splits", lambda *a: searches.append(a) or search(*a))
    q, w, pages, sl, pt = logits_case([70, 9], 16, torch.Generator().manual_seed(3))
    for _ in range(3):
        ml.bf16_paged_mqa_logits(q, pages, w, sl, pt, 128)
    assert (len(plans), len(searches)) == (1, 1)
    ml.bf16_paged_mqa_logits(q, pages, w, sl, pt, 120)  # another width, the same split count: no search
    assert (len(plans), len(searches)) == (2, 1)
    ml.bf16_paged_mqa_logits(q[:1], pages, w[:1], sl[:1], pt[:1], 128)  # another row count: its own search
    ml.bf16_paged_mqa_logits(q[:1], pages, w[:1], sl[:1], pt[:1], 128)
    assert (len(plans), len(searches)) == (3, 2)


def test_bound_logits_call_scores_as_the_wrapper_into_its_output(kern):
    """A forward's LogitsCall (lengths, page table, width and output bound) gives the wrapper's logits, for the
    layout it plans once and for one whose inputs need normalizing first (the wrapper's own path)."""
    ml = kern.mqa_logits
    lens = [70, 9]
    q, w, pages, sl, pt = logits_case(lens, 16, torch.Generator().manual_seed(6))
    want = ml.bf16_paged_mqa_logits(q, pages, w, sl, pt, 128)
    out = torch.full((2, 128), float("nan"))
    ml.bf16_paged_mqa_logits(q, pages, w, sl, pt, 128, out=out)
    plans = len(ml._PLANS)
    bound = ml.LogitsCall(sl, pt, 128, out)
    strided_w = torch.stack([w, -w], -1)[..., 0]  # the same weights, not contiguous
    for weights in (w, w, strided_w):
        out.fill_(float("nan"))
        assert bound(q, pages, weights) is out
        for r, n in enumerate(lens):
            assert torch.equal(out[r, :n], want[r, :n])
    assert len(bound._plans) == 2
    assert len(ml._PLANS) == plans + 1, "the bound call shares the wrapper's plan (its defaults are the wrapper's)"


def test_a_lasting_tensors_layout_is_read_once_and_kept_with_it(kern, monkeypatch):
    """``lasting_key`` reads a pool view's or a table's layout once and finds it by identity after; the tensor is
    held with its key (its id cannot name another tensor meanwhile), and a full table starts over."""
    from dsv4_sm120.kernels import launch

    monkeypatch.setattr(launch, "_LASTING", {})
    monkeypatch.setattr(launch, "_LASTING_MAX", 2)
    reads = []
    real = launch.tensor_key
    monkeypatch.setattr(launch, "tensor_key", lambda t: reads.append(t) or real(t))
    a, b, c = torch.zeros(4, 2), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(1)
    assert launch.lasting_key(a) == real(a) and launch.lasting_key(a) == real(a)
    assert launch.lasting_key(b) == real(b) and len(reads) == 2
    assert launch._LASTING[id(a)][0] is a
    launch.lasting_key(c)  # a third: the table of two starts over
    assert list(launch._LASTING) == [id(c)]


def test_plans_hold_no_tensor_and_refuse_bad_layouts_every_time(kern, monkeypatch):
    """A plan keeps no input or output alive, and a layout that fails its checks is refused again, not kept."""
    ml = kern.mqa_logits
    monkeypatch.setattr(ml, "_PLANS", {})
    q, w, pages, sl, pt = logits_case([70], 16, torch.Generator().manual_seed(4))
    ml.bf16_paged_mqa_logits(q, pages, w, sl, pt, 80)
    (plan,) = ml._PLANS.values()
    held = [*plan, *vars(plan.launch).values()]
    held += [v for h in held if isinstance(h, (list, tuple, dict)) for v in (h.values() if isinstance(h, dict) else h)]
    assert not [v for v in held if isinstance(v, torch.Tensor)]
    for _ in range(2):
        with pytest.raises(ValueError, match="q must be bf16"):
            ml.bf16_paged_mqa_logits(q.float(), pages, w, sl, pt, 80)
        with pytest.raises(ValueError, match="one device"):  # the launch passes addresses: no host tensor slips by
            ml.bf16_paged_mqa_logits(q, pages, w, sl.to("meta"), pt, 80)
    assert len(ml._PLANS) == 1


@pytest.fixture(scope="module")
def eager() -> dict:
    return harness_result(HARNESS)


@pytest.mark.parametrize("name", WRAPPERS)
def test_direct_launch_is_the_call_triton_makes(eager, name):
    assert eager["direct"], "the installed Triton should take the direct path (kernels/launch.py)"
    res = eager[name]
    # a call into given buffers has the allocating call's kernel specialization, which Triton launched already
    triton_runs = 0 if name in ("index_query_out", "mqa_logits_bound") else 1
    plans = 2 if name == "query_store" else 1  # the query's and the store's checks, made once for the one launch
    assert res["launches"] == 5 and res["triton_runs"] == triton_runs and res["plans"] == plans, res
    first, second = res["launcher_args"]
    assert first == second, "the direct launch must pass the C launcher what Triton's own launch passed"


@pytest.mark.parametrize("name", WRAPPERS)
def test_eager_call_python_work_is_bounded(eager, name):
    lines = eager[name]["lines"]
    assert "triton/runtime/jit.py" not in lines, f"a steady-state call went through Triton's dispatch: {lines}"
    limit = MAX_LINES_BOUND if name == "mqa_logits_bound" else MAX_LINES
    assert sum(lines.values()) <= limit, f"{name}: {sum(lines.values())} Python lines a call: {lines}"
    assert eager["split_searches"] == 1


@pytest.mark.parametrize("name", WRAPPERS)
def test_steady_state_call_makes_no_torch_op_but_its_outputs(eager, name):
    assert eager[name]["torch_ops"] == ["aten.empty.memory_format"] * ALLOCATIONS[name]


@pytest.mark.parametrize("name", WRAPPERS)
def test_launch_hooks_see_the_launch_as_tritons_would(eager, name):
    kernel = {"index_query": "_query_kernel", "index_query_out": "_query_kernel", "mqa_logits": "_logits_kernel",
              "mqa_logits_bound": "_logits_kernel", "index_k_store": "_store_kernel",
              "query_store": "_query_store_kernel"}[name]
    assert eager[name]["hook_saw"] == repr([[("function", 2), ("name", kernel), ("stream", 7)]])


def test_misaligned_tensors_take_tritons_launch(eager):
    """Queries not 16-byte aligned are another specialization: that call goes through Triton, not the plan's."""
    assert eager["misaligned_triton_runs"] == 1

"""No request compiles a kernel: the warmup launches every Triton specialization a server meets.

specialization_run.py drives the wrappers the way the model does over a sweep of request shapes (decode rows
1..64 at the capture width and at eager widths, extend rows 1..5000 at widths 1..8191, page tables of several
widths, chunked rows whose metadata slices are not 16-byte aligned) and the warmup's own calls, on ``meta``
tensors with the launch recorded instead of run, and keys each launch twice: by ``launch.specialization_key``
and by Triton's own binder (the cache key ``JITFunction.run`` would look up). A request-dependent integer
passed without ``do_not_specialize`` splits the sweep into more keys than the warmup compiles, and fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels.helpers import harness_result

HARNESS = Path(__file__).with_name("specialization_run.py")


@pytest.fixture(scope="module")
def keys() -> dict:
    return harness_result(HARNESS)


def test_warmup_compiles_every_variant_the_sweep_meets(keys):
    from dsv4_sm120.kernels.warmup import SERVING_VARIANTS, TWO_STAGE_VARIANTS

    missing = sorted(set(keys["sweep"]) - set(keys["warmup"]))
    assert not missing, f"request shapes meet specializations the warmup does not compile: {missing}"
    assert set(keys["sweep"]) == set(keys["warmup"]), "the warmup compiles variants no request meets"
    assert len(keys["warmup"]) == SERVING_VARIANTS + 1 + TWO_STAGE_VARIANTS  # with the page checksum and two stages


def test_specialization_key_is_tritons(keys):
    assert keys["mirror_mismatches"] == [], "launch._arg_key partitions values unlike native_specialize_impl"
    assert keys["ours_split_by_triton"] == [], "one specialization_key covered launches Triton compiles apart"
    assert keys["our_keys"] == keys["triton_keys"]


def test_warmup_launches_what_the_aot_builds_check(keys):
    """The warmup's pointer dtypes are the AOT specs' (which test_model_build.py checks against the real model)."""
    from dsv4_sm120.kernels.aot import KERNEL_SPECS

    for launched in keys["warmup_launches"]:
        specs = [s for s in KERNEL_SPECS if s.fn.fn.__name__ == launched["kernel"]
                 and all(launched["constexprs"].get(k) == v for k, v in s.constexprs.items())]
        assert specs, f"no AOT spec builds the warmup's {launched}"
        for spec in specs:
            assert {k: v for k, v in spec.signature.items() if v.startswith("*")} == launched["pointers"], spec.name

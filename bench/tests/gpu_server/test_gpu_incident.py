"""The bars of the production configuration on real figures: ``python -m bench.gpu_server run incident``.

Three PD pairs (prefill with HiCache, decode with CUDA graphs, bf16 keys, the router, sglang's default
timeouts, ``patch apply``): the defaults, the checksum on both sides, the fixes off. On a CUDA host with the
pin this runs the set (about seven minutes); ``DSV4_GPU_INCIDENT_JSON=<record>`` asserts on a record a run
wrote instead. Selected with ``-m gpu``; without a CUDA device and no record it fails.
"""

from __future__ import annotations

import pytest

from bench.tests.gpu_server import gpu_record

pytestmark = pytest.mark.gpu
SIDES = ("prefill", "decode", "router")


@pytest.fixture(scope="module")
def pairs() -> dict:
    return gpu_record.results("DSV4_GPU_INCIDENT_JSON", "incident", "--mem-fraction", "0.85")["pairs"]


@pytest.mark.parametrize("tag", ["_default", "_checksum", "_fixes_off"])
def test_every_kill_is_followed_by_a_served_fresh_request_and_nothing_is_left(pairs, tag):
    pair = pairs[tag]
    assert "error" not in pair, pair.get("error")
    assert len(pair["kills"]) >= 5
    for kill in pair["kills"]:
        assert kill["fresh"]["status"] == 200, kill
        assert all(kill["health"][side] == 200 for side in SIDES), kill
    assert pair["multi_turn"]["sessions"] >= 64 and pair["multi_turn"]["failed"] == 0
    assert pair["fresh_after"]["status"] == 200
    assert pair["leftovers"] == {} and all(pair["health"][side] == 200 for side in SIDES)
    assert pair["dead_after"] == []


def test_the_checksum_pair_checks_hicache_and_pd_pages_and_finds_no_mismatch(pairs):
    deltas = pairs["_checksum"]["counter_deltas"]
    assert deltas.get("sglang:dsv4_index_k_page_checks_total", 0) > 0
    assert deltas.get("sglang:dsv4_index_k_pd_pages_checked_total", 0) > 0
    assert deltas.get("sglang:dsv4_index_k_mismatches_total", 0) == 0
    assert deltas.get("sglang:dsv4_index_k_pd_mismatches_total", 0) == 0
    assert not any(pairs["_checksum"]["integrity_log_lines"].values())

"""PD handshake: upstream's real layout comparison, fed by a real HTTP /route answer.

The decode side's ``CommonKVManager.try_ensure_parallel_info`` runs for real:
it fetches the prefill's parallel info over HTTP from a local server and
compares layouts. The manager is made with ``object.__new__`` and given only the
attributes that method reads, because its ``__init__`` starts transfer threads
and sockets that have nothing to do with the comparison under test.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

FP8 = "v4,c4:v4,c128:v4"
BF16 = "v4,c4:v4,c128:v4,index_k:bf16"


@pytest.fixture
def prefill_route():
    """A local /route endpoint answering a prefill's parallel info with a chosen kv_layout."""
    answer = {}

    class Route(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Route)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def serve(kv_layout):
        answer.clear()
        answer.update(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=256,
                      kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True, kv_layout=kv_layout)
        return f"127.0.0.1:{server.server_address[1]}"

    yield serve
    server.shutdown()


def _decode_manager(kv_layout):
    from types import SimpleNamespace

    from sglang.srt.disaggregation.common.conn import CommonKVManager

    manager = object.__new__(CommonKVManager)
    manager.prefill_info_table = {}
    manager.kv_args = SimpleNamespace(page_size=256, engine_rank=0, state_types=())
    manager.kv_cache_dtype_str = "fp8_e4m3"
    manager.kv_layout = kv_layout
    manager.dsv41_spec_layout = None
    manager.attn_tp_size = manager.attn_cp_size = manager.pp_size = 1
    manager.dcp_size = 1
    manager.attn_cp_rank = manager.pp_rank = 0
    manager.enable_all_cp_ranks_for_transfer = False
    manager.dist_init_addr = None
    manager.is_mla_backend, manager.is_hybrid_mla_backend = True, False
    return manager


@pytest.mark.parametrize("prefill, decode", [(BF16, FP8), (FP8, BF16)])
def test_mismatch_is_refused_with_both_layouts_and_the_switch(hooked, prefill_route, prefill, decode):
    from dsv4_sm120.index_k.pd import IndexKLayoutMismatch

    addr = prefill_route(prefill)
    manager = _decode_manager(decode)
    with pytest.raises(IndexKLayoutMismatch) as info:
        manager.try_ensure_parallel_info(addr)
    message = str(info.value)
    assert prefill in message and decode in message
    assert "DSV4_SM120_INDEX_K_DTYPE" in message and "bf16" in message and "fp8" in message
    assert addr not in manager.prefill_info_table
    assert isinstance(info.value.__cause__, RuntimeError), "upstream's own refusal is kept as the cause"


@pytest.mark.parametrize("layout", [BF16, FP8])
def test_equal_layouts_connect(hooked, prefill_route, layout):
    addr = prefill_route(layout)
    manager = _decode_manager(layout)
    assert manager.try_ensure_parallel_info(addr) is True
    assert manager.prefill_info_table[addr].kv_layout == layout


def test_other_layout_mismatches_keep_upstreams_error(hooked, prefill_route):
    from dsv4_sm120.index_k.pd import IndexKLayoutMismatch

    manager = _decode_manager("v41,c4:v4,c128:v4")
    with pytest.raises(RuntimeError, match="SGLANG_DSV4_KV_LAYOUT") as info:
        manager.try_ensure_parallel_info(prefill_route(FP8))
    assert not isinstance(info.value, IndexKLayoutMismatch)


def test_pool_layouts_from_the_real_pools_differ(built):
    bf16 = built("dsv4", "bf16").token_to_kv_pool.pd_kv_layout()
    fp8 = built("dsv4", "fp8").token_to_kv_pool.pd_kv_layout()
    assert (bf16, fp8) == (BF16, FP8)

"""Frames a misbehaving or hostile peer sends to a real prefill's NIXL bootstrap socket.

The socket is found the way the decode finds it: ``GET /route`` on the prefill's
bootstrap HTTP server answers each rank's ``rank_ip``/``rank_port``
(``disaggregation/common/conn.py`` ~L2700). The frames are built from the
pin's own constants (``GUARD``, ``ABORT_TAG``) so they stay aimed at its parser.
:func:`during_traffic` is scenario (b) as one call, shared by the CPU test and the
GPU host's ``pd`` set (``bench/gpu_server/pd.py``).
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import zmq

from harness import checks, scrape
from harness.servers import LOOPBACK, http
from harness.traffic import Traffic, burst

# Seconds of chats through the front before the frames, and after them before the chats stop.
TRAFFIC_BEFORE_S, TRAFFIC_AFTER_S = 2.0, 3.0


def rank_endpoints(bootstrap_port: int, tp: int) -> list[str]:
    """``tcp://ip:port`` of every prefill TP rank's bootstrap socket."""
    out = []
    for rank in range(tp):
        status, body = http("GET", f"http://{LOOPBACK}:{bootstrap_port}/route?prefill_dp_rank=0&prefill_cp_rank=0"
                                   f"&target_tp_rank={rank}&target_pp_rank=0", timeout=10)
        assert status == 200, f"bootstrap server answered {status} {body[:200]!r} for rank {rank}"
        info = json.loads(body)
        out.append(f"tcp://{info['rank_ip']}:{info['rank_port']}")
    return out


def frames(rng: random.Random) -> dict[str, list[list[bytes]]]:
    """Each kind of bad frame (the scenario's list), a few of each, with random room ids."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG
    from sglang.srt.disaggregation.nixl.conn import GUARD

    def room() -> bytes:
        return str(rng.randrange(1 << 62)).encode()

    ghost = b"ghost-agent-that-never-registered"
    late_room = room()
    # A well-formed transfer-info tail (nixl/conn.py TransferInfo.from_zmq): destination KV indices (int32),
    # aux index, required_dst_info_num, state indices. Only the sender is wrong: it never registered.
    info_tail = [np.array([0, 1], dtype=np.int32).tobytes(), b"0", b"1", b""]
    return {
        "foreign tag": [[b"HELLO"], [b"GET / HTTP/1.1\r\n\r\n"]],
        "short guard frame": [[GUARD], [GUARD, room()]],
        "bad ascii": [[GUARD, b"\xff\xfe\x00", b"127.0.0.1", b"1", ghost]],
        "bad int": [[GUARD, b"not-a-room", b"127.0.0.1", b"1", ghost]],
        "bad registration": [[GUARD, b"None", b"127.0.0.1", b"1", b"peer-with-garbage", b"\x00garbage"]],
        "unregistered transfer info": [[GUARD, room(), b"127.0.0.1", b"1", ghost, *info_tail]],
        "late transfer info after abort": [
            [ABORT_TAG, late_room, b"127.0.0.1", b"1"],
            [GUARD, late_room, b"127.0.0.1", b"1", ghost, *info_tail],
        ],
    }


def send(endpoint: str, batch: list[list[bytes]]) -> None:
    """Push each multipart frame to ``endpoint`` (as the decode's PUSH socket does) and flush."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    try:
        for frame in batch:
            sock.send_multipart(frame)
    finally:
        sock.close()


def rejected(cluster) -> dict[str, float]:
    """The prefill's refusals so far, by reason (``sglang:dsv4_nixl_frames_rejected_total``)."""
    return scrape.by_label(scrape.metrics(cluster.prefill.url), "sglang:dsv4_nixl_frames_rejected_total", "reason")


def during_traffic(cluster, batches: list[list[list[bytes]]], timeout: float = 60.0) -> dict:
    """Every batch to every prefill rank while chats flow through the front, then 8 chats at once (each chat
    bounded by ``timeout`` seconds): what was served during and after, the refusals by reason, the dsv4
    counters' deltas, health and the bootstrap threads alive."""
    endpoints = rank_endpoints(cluster.bootstrap_port, cluster.tp)
    before, rejected_before = checks.dsv4_counters(cluster), rejected(cluster)
    with Traffic(cluster.front, timeout=timeout) as flow:
        time.sleep(TRAFFIC_BEFORE_S)
        for batch in batches:
            for endpoint in endpoints:
                send(endpoint, batch)
        time.sleep(TRAFFIC_AFTER_S)
    later = burst(cluster.front, 8, timeout=timeout)
    refused = {k: v - rejected_before.get(k, 0.0) for k, v in rejected(cluster).items()}
    after = checks.dsv4_counters(cluster)
    return {"during_traffic_ok": flow.ok, "during_traffic_failed": flow.failed, "later_requests": later,
            "rejected_by_reason": refused, "health": checks.health(cluster),
            "metric_deltas": checks.delta(before, after),
            "bootstrap_threads_alive": after.get("sglang:dsv4_nixl_bootstrap_threads_alive")}

"""Frames a misbehaving or hostile peer sends to a real prefill's NIXL bootstrap socket.

The socket is found the way the decode finds it: ``GET /route`` on the prefill's
bootstrap HTTP server answers each rank's ``rank_ip``/``rank_port``
(``disaggregation/common/conn.py`` ~L2700). The frames are built from the
pin's own constants (``GUARD``, ``ABORT_TAG``) so they stay aimed at its parser.
"""

from __future__ import annotations

import json
import random

import numpy as np
import zmq

from servers import LOOPBACK, http


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

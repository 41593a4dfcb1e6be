"""Can two NIXL agents on this GPU host move GPU memory to each other? The question a PD pair asks first.

Two agents with the UCX backend, as sglang's NIXL transfer backend makes them, each register one CUDA
tensor (VRAM); the first WRITEs its tensor into the second's, with a notification, and the bytes are
compared. Prints one JSON line: the UCX memory kinds, the transfer's state, bytes, seconds, equality.

    python -m bench.gpu_server.nixl_vram [--mib 64]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time

from harness import run_record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_server.nixl_vram", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args(argv)

    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    out: dict = {"date": run_record.now_utc(),
                 "commit": run_record.commit(), "device": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "nixl": importlib.metadata.version("nixl")}
    sender = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    receiver = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    out["ucx_mem_types"] = sender.get_backend_mem_types("UCX")
    n = args.mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    sender.register_memory(src)
    receiver.register_memory(dst)
    sender.add_remote_agent(receiver.get_agent_metadata())
    receiver.add_remote_agent(sender.get_agent_metadata())
    local = sender.get_xfer_descs(src)
    remote = receiver.get_xfer_descs(dst)
    t0 = time.perf_counter()
    handle = sender.initialize_xfer("WRITE", local, remote, "decode", b"room-1")
    state = sender.transfer(handle)
    deadline = time.monotonic() + 30
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = sender.check_xfer_state(handle)
    seconds = time.perf_counter() - t0
    notified = False
    while not notified and time.monotonic() < deadline:
        notified = b"room-1" in receiver.get_new_notifs().get("prefill", [])
    torch.cuda.synchronize()
    out.update(state=state, bytes=n, seconds=round(seconds, 4), gb_per_s=round(n / seconds / 1e9, 1),
               notified=notified, equal=bool(torch.equal(src, dst)), backend=sender.query_xfer_backend(handle))
    print(json.dumps(out))
    return 0 if out["equal"] and state == "DONE" else 1


if __name__ == "__main__":
    raise SystemExit(main())

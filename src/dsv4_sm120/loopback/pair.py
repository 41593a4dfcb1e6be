"""A prefill/decode pair over real NIXL on 127.0.0.1, with no model: the abort-storm test bed.

Everything here is the pin's own code: ``NixlKVBootstrapServer`` on 127.0.0.1,
a prefill and a decode ``NixlKVManager`` built through their real ``__init__``
(each with its own NIXL agent on UCX), and ``NixlKVSender``/``NixlKVReceiver``
per session. The KV "pages" are rows of CPU tensors registered as DRAM, with
known content, so every transfer is checked byte for byte. What the harness
plays itself is the two schedulers' event loops: :meth:`LoopbackPD.pump` polls
every sender and receiver, starts a transfer when the prefill sees its room
bootstrapped, and clears concluded requests, as ``prefill.py``/``decode.py`` do.

Both managers live in this one process and read the one published config
(``runtime_context.publish`` of a CPU ``ServerArgs``); decode and prefill TP
are 1. A harness is built hardened or with the pin's bootstrap thread
(``hardened=False``), so one process can compare the two.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

HARDENING_ENV = "DSV4_SM120_NIXL_HARDENING"
# A frame whose tag the pin does not know: what the incident's fork-era decode sent
# (an ABORT the prefill did not know), or a decode of another release mid-upgrade.
FOREIGN_FRAME = [b"KV_PROBE_V2", b"0", b"127.0.0.1", b"1"]

_hooks_lock = threading.Lock()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_hooks() -> None:
    """Register and apply this area's hooks in this process once (what ``load_plugins`` does in a server)."""
    import dataclasses

    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_sm120 import settings
    from dsv4_sm120.nixl import hooks

    with _hooks_lock:
        target = f"{hooks.NIXL_MANAGER}._start_bootstrap_thread"
        if target not in HookRegistry._hooks:
            hooks.register(dataclasses.replace(settings.load(), nixl_hardening=True))
        HookRegistry.apply_hooks()


@contextlib.contextmanager
def _hardening_env(hardened: bool):
    old = os.environ.get(HARDENING_ENV)
    os.environ[HARDENING_ENV] = "1" if hardened else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(HARDENING_ENV, None)
        else:
            os.environ[HARDENING_ENV] = old


def _config_dir() -> str:
    """A directory holding only a tiny ``config.json``: ServerArgs resolution reads one, no weights are loaded."""
    import json
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"dsv4-sm120-loopback-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
           "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _kv_args(kv, aux, kv_layout=None):
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.gpu_id = 0, 0, 0, 0
    a.kv_cache_dtype_str, a.kv_layout, a.page_size = "bfloat16", kv_layout, 1
    a.kv_data_ptrs = [t.data_ptr() for t in kv]
    a.kv_data_lens = [t.nbytes for t in kv]
    a.kv_item_lens = [t[0].nbytes for t in kv]
    a.kv_layer_ids = list(range(len(kv)))
    a.kv_data_mem_kinds = ["DRAM"] * len(kv)  # CPU tensors: NIXL DRAM-to-DRAM over UCX
    a.num_draft_entries = 0
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.data_ptr()], [aux.nbytes], [aux[0].nbytes]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_conv_shard_groups = [], [], [], []
    a.is_hybrid_mla_backend, a.swa_kv_cache_layout, a.ib_device = False, None, None
    a.kv_head_num = a.total_kv_head_num = 1
    a.rust_http_port, a.prefill_start_layer, a.prefill_end_layer, a.mla_compression_ratios = None, 0, None, None
    a.kv_buf_groups, a.hidden_kv_layers, a.draft_kv_layers = 1, len(kv), 0
    return a


@dataclass
class Session:
    """One request's KV crossing from prefill to decode."""

    room: int
    src: np.ndarray
    dst: np.ndarray
    src_aux: int
    dst_aux: int
    sender: object = None
    receiver: object = None
    aborted: bool = False
    started: bool = False
    prefill_state: int | None = None  # KVPoll the prefill concluded with
    decode_state: int | None = None
    done_at: float | None = None
    abort_at: str | None = None  # "bootstrapped" | "transfer": when pump() aborts it
    notes: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return (self.sender is None or self.prefill_state is not None) and (
            self.receiver is None or self.decode_state is not None
        )


class LoopbackPD:
    """A real NIXL prefill and decode in one process, talking over 127.0.0.1."""

    def __init__(self, *, hardened: bool, layers: int = 2, pages: int = 8192, page_bytes: int = 128,
                 aux_slots: int = 2048, aux_bytes: int = 64, seed: int = 0, index_k_layers: int = 0):
        """``index_k_layers`` > 0 also registers that many bf16 index-K shaped buffers (16384 B page
        rows, after the KV buffers, as the DSV4 pool orders them) and tags both sides' PD layout
        ``index_k:bf16``, as a bf16 DSV4 pool does; they travel and verify like the KV buffers."""
        import torch
        from sglang.srt import runtime_context
        from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.server_args import ServerArgs

        if hardened:
            install_hooks()
        self.hardened = hardened
        self.rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        self.src_kv = [torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=gen) for _ in range(layers)]
        self.dst_kv = [torch.zeros(pages, page_bytes, dtype=torch.uint8) for _ in range(layers)]
        kv_layout = None
        if index_k_layers:
            from dsv4_sm120.index_k import layout

            row = layout.BF16_PAGE_ROW_BYTES
            self.src_kv += [torch.randint(0, 256, (pages, row), dtype=torch.uint8, generator=gen)
                            for _ in range(index_k_layers)]
            self.dst_kv += [torch.zeros(pages, row, dtype=torch.uint8) for _ in range(index_k_layers)]
            kv_layout = layout.PD_LAYOUT_TAG_BF16
        self.src_aux = torch.randint(0, 256, (aux_slots, aux_bytes), dtype=torch.uint8, generator=gen)
        self.dst_aux = torch.zeros(aux_slots, aux_bytes, dtype=torch.uint8)
        self.pages, self.aux_slots = pages, aux_slots
        self._free_dst = list(range(pages))
        self._free_aux = list(range(aux_slots))
        self._next_room = int(self.rng.integers(1 << 40, 1 << 50))

        port = free_port()
        self.addr = f"127.0.0.1:{port}"
        server_args = ServerArgs(model_path=_config_dir(), device="cpu", host="127.0.0.1",
                                 disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                                 disaggregation_bootstrap_port=port)
        runtime_context.publish(server_args, role="test", ranks=runtime_context.SpawnRanks(world_rank=0, gpu_id=0))
        runtime_context.get_parallel().override_permanently(pp_group=None)  # pp_size 1: no group
        self.server = NixlKVBootstrapServer(host="127.0.0.1", port=port)
        before = set(threading.enumerate())
        with _hardening_env(hardened):
            self.prefill = NixlKVManager(_kv_args(self.src_kv, self.src_aux, kv_layout), DisaggregationMode.PREFILL,
                                         server_args, False)
        self.bootstrap_thread = next(t for t in set(threading.enumerate()) - before if "bootstrap" in t.name)
        self.decode = NixlKVManager(_kv_args(self.dst_kv, self.dst_aux, kv_layout), DisaggregationMode.DECODE,
                                    server_args, False)
        deadline = time.monotonic() + 30
        while not self.decode.try_ensure_parallel_info(self.addr):
            if time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server {self.addr} never listed the prefill rank")
            time.sleep(0.05)
        import zmq

        self._zctx = zmq.Context.instance()
        self._push = self._zctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(f"tcp://{self.prefill.local_ip}:{self.prefill.rank_port}")
        self._push_lock = threading.Lock()
        self.sessions: list[Session] = []
        self.aborts_sent = 0

    # -- raw access -----------------------------------------------------------------------------
    @property
    def hardening(self):
        """The hardened loop serving the prefill socket, or None on the pin's thread."""
        return getattr(self.prefill, "_dsv4_bootstrap", None)

    def push_raw(self, frames: list[bytes]) -> None:
        """Send one multipart frame to the prefill bootstrap socket, as any peer on the network can."""
        with self._push_lock:
            self._push.send_multipart(frames)

    def thread_alive(self) -> bool:
        return self.bootstrap_thread.is_alive()

    def new_room(self) -> int:
        self._next_room += 1
        return self._next_room

    def leaked_rooms(self) -> dict[str, list[int]]:
        """Rooms still held after every request concluded: each one is a leak."""
        return {
            "prefill.transfer_infos": sorted(self.prefill.transfer_infos),
            "prefill.request_status": sorted(self.prefill.request_status),
            "decode.request_status": sorted(self.decode.request_status),
        }

    def transfer_queues_idle(self) -> bool:
        return all(not q._buf for q in self.prefill.transfer_queues)

    # -- sessions --------------------------------------------------------------------------------
    def open(self, n_pages: int = 4, *, prefill: bool = True, decode: bool = True, room: int | None = None) -> Session:
        """A new request: the prefill opens its sender, the decode its receiver and bootstraps."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver, NixlKVSender

        if len(self._free_dst) < n_pages or not self._free_aux:
            raise RuntimeError("loopback decode pool exhausted; call recycle() after quiescence")
        dst = np.array([self._free_dst.pop() for _ in range(n_pages)], dtype=np.int32)
        dst_aux = self._free_aux.pop()
        for layer in self.dst_kv:
            layer[dst] = 0
        self.dst_aux[dst_aux] = 0
        src = self.rng.choice(self.pages, size=n_pages, replace=False).astype(np.int32)
        s = Session(room=self.new_room() if room is None else room, src=src, dst=dst,
                    src_aux=int(self.rng.integers(self.aux_slots)), dst_aux=dst_aux)
        if prefill:
            s.sender = NixlKVSender(self.prefill, self.addr, s.room)
        if decode:
            s.receiver = NixlKVReceiver(self.decode, self.addr, s.room)
            s.receiver.init(0)
        self.sessions.append(s)
        return s

    def send_metadata(self, s: Session) -> None:
        s.receiver.send_metadata(s.dst, aux_index=s.dst_aux)

    def metadata_frame(self, s: Session) -> list[bytes]:
        """The transfer-info frame the decode would send for ``s`` (to replay it late)."""
        return self.decode.build_receiver_metadata_message(
            bootstrap_room=s.room, required_dst_info_num=1, kv_indices=s.dst, aux_index=s.dst_aux,
            state_indices=None, decode_prefix_len=None, is_dummy=False)

    def abort(self, s: Session) -> None:
        """The decode aborts ``s`` (client gone): marks it Failed and sends ABORT to the prefill."""
        s.aborted = True
        if s.receiver is not None and s.decode_state is None:
            s.receiver.abort()
            self.aborts_sent += 1

    def settle_aborts(self, timeout_s: float = 5.0) -> None:
        """Wait until the prefill handled every ABORT sent so far (the pin's thread has no counter: a short sleep)."""
        boot = self.hardening
        if boot is None:
            time.sleep(0.3)
            return
        deadline = time.monotonic() + timeout_s
        while boot.rejects.snapshot()["aborts_handled"] < self.aborts_sent and time.monotonic() < deadline:
            time.sleep(0.005)

    def verify(self, s: Session) -> bool:
        import torch

        src, dst = torch.from_numpy(s.src).long(), torch.from_numpy(s.dst).long()
        return all(torch.equal(a[src], b[dst]) for a, b in zip(self.src_kv, self.dst_kv)) and torch.equal(
            self.src_aux[s.src_aux], self.dst_aux[s.dst_aux])

    def pump(self) -> int:
        """One iteration of both schedulers' loops over open sessions; returns how many are still open."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        done = (KVPoll.Success, KVPoll.Failed)
        open_count = 0
        for s in self.sessions:
            if s.finished:
                continue
            if s.sender is not None and s.prefill_state is None:
                state = s.sender.poll()
                if state == KVPoll.WaitingForInput and not s.started:
                    if s.abort_at == "bootstrapped":
                        self.abort(s)
                    s.started = True
                    s.sender.init(len(s.src), aux_index=s.src_aux)
                    s.sender.send(s.src)
                    if s.abort_at == "transfer":
                        self.abort(s)
                elif state in done:
                    s.prefill_state = state
                    s.sender.clear()
            if s.receiver is not None and s.decode_state is None:
                state = s.receiver.poll()
                if state in done:
                    s.decode_state = state
                    s.done_at = time.monotonic()
                    s.receiver.clear()
            if not s.finished:
                open_count += 1
        return open_count

    def run(self, sessions: list[Session], timeout_s: float) -> bool:
        """Pump until every session in ``sessions`` concluded; False when ``timeout_s`` ran out first."""
        deadline = time.monotonic() + timeout_s
        while any(not s.finished for s in sessions):
            if time.monotonic() > deadline:
                return False
            self.pump()
            time.sleep(0.002)
        return True

    def quiesce(self, timeout_s: float) -> bool:
        """Pump until every session concluded and no transfer is queued or in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.pump() == 0 and self.transfer_queues_idle() and not self._workers_holding():
                return True
            time.sleep(0.005)
        return False

    def _workers_holding(self) -> bool:
        from dsv4_sm120.nixl import liveness

        watch = liveness.existing_watch(self.prefill)
        return watch is not None and any(q.holding_since is not None for _, q in watch.workers.values())

    def recycle(self) -> None:
        """Give concluded sessions' decode pages back (only once nothing can still write into them)."""
        keep = []
        for s in self.sessions:
            if s.finished:
                self._free_dst.extend(int(p) for p in s.dst)
                self._free_aux.append(s.dst_aux)
            else:
                keep.append(s)
        self.sessions = keep

    def close(self) -> None:
        """Stop the prefill bootstrap thread so the process can exit."""
        from dsv4_sm120.nixl import liveness

        boot = self.hardening
        if boot is not None:
            boot.stop()
        elif self.thread_alive():
            # The pin's thread is not a daemon and has no stop: the frame it cannot parse ends it.
            self.push_raw(FOREIGN_FRAME)
            self.bootstrap_thread.join(5)
        liveness.forget(self.prefill)
        self._push.close(0)

"""Command lines and environment of the e2e servers: a single server, and a PD pair behind the PD router.

Every listener is on 127.0.0.1 (``SGLANG_HOST_IP`` for NIXL's bootstrap sockets,
``--host`` for HTTP, ``--prometheus-host`` for the router's metrics). The flags
that let the pinned sglang serve on CPU: ``--device cpu`` with
``SGLANG_USE_CPU_ENGINE=1`` (else RoPE imports ``vllm._custom_ops``,
``layers/rotary_embedding/base.py`` ~L138), the torch-native attention backend,
no CUDA graphs, dummy weights; at TP > 1 ``SGLANG_NCCL_SO_PATH`` pointing at
nothing (else PyNccl is set up on CPU, ``pynccl.py`` ~L116) and one OpenMP core
set per rank; the decode keeps retraction backups as CPU tensors. Idle schedulers
sleep (upstream's ``--sleep-on-idle``, a 1 s poll of their sockets) instead of
busy-polling: seen here, each idle PD scheduler otherwise takes ~40% of a core, and
on 2 cores the idle sets of a session starve the one under test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from harness.environment import E2EEnv
from harness.servers import LOOPBACK, Proc, ServerFailed, ServerSet, free_port, http

SERVER_FLAGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--load-format", "dummy",
    "--max-total-tokens", "16384", "--host", LOOPBACK, "--enable-metrics", "--log-level", "info",
    "--sleep-on-idle",
]
STARTUP_S = float(os.environ.get("DSV4_E2E_STARTUP_S", "420"))


def server_env(env: E2EEnv, tp: int, extra: dict | None = None) -> dict:
    """The environment of one sglang server process of the suite."""
    # The suite's own DSV4_SM120_* switches reach the servers (``DSV4_SM120_NIXL_HARDENING=0 pytest tests/e2e``
    # runs every scenario with that fix off); a scenario's ``extra`` overrides them.
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "PYTEST"))}
    out.update({
        "PATH": f"{env.bin}:{os.environ.get('PATH', '')}",
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_HOST_IP": LOOPBACK,
        "OMP_NUM_THREADS": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % max(1, os.cpu_count() or 1)) for r in range(tp)),
    })
    if tp > 1:
        out["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so"
    out.update(extra or {})
    return out


@dataclass
class Cluster:
    """A started set: ``front`` is where clients go (the router for PD, the server itself otherwise)."""

    servers: ServerSet
    front: str
    prefill: Proc | None = None
    decode: Proc | None = None
    router: Proc | None = None
    single: Proc | None = None
    bootstrap_port: int = 0
    tp: int = 1
    switches: dict = field(default_factory=dict)

    def stop(self) -> None:
        self.servers.stop()


def _sglang(env: E2EEnv, name: str, log_dir: Path, port: int, model: Path, tp: int, args: list) -> Proc:
    argv = [str(env.python), "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
            "--tp", str(tp), "--nccl-port", str(free_port()), *SERVER_FLAGS, *args]
    return Proc(name, argv, log_dir / f"{name}.log", f"http://{LOOPBACK}:{port}")


def start_single(env: E2EEnv, model: Path, log_dir: Path, tp: int = 1, switches: dict | None = None) -> Cluster:
    servers = ServerSet()
    proc = servers.add(_sglang(env, f"single-tp{tp}", log_dir, free_port(), model, tp, []))
    try:
        proc.start(server_env(env, tp, switches))
        proc.wait_ready("/health", STARTUP_S)
    except BaseException:
        servers.stop()
        raise
    return Cluster(servers, proc.url, single=proc, tp=tp, switches=dict(switches or {}))


def start_pd(env: E2EEnv, model: Path, log_dir: Path, tp: int = 1, switches: dict | None = None,
             extra_prefill: list | None = None, extra_decode: list | None = None, router_args: list | None = None,
             tag: str = "") -> Cluster:
    """Prefill and decode over NIXL, both at ``tp``, and the PD router in front; all stopped on any failure."""
    servers = ServerSet()
    boot = free_port()
    pd = ["--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-port", str(boot)]
    prefill = servers.add(_sglang(env, f"prefill{tag}", log_dir, free_port(), model, tp,
                                  ["--disaggregation-mode", "prefill", *pd, *(extra_prefill or [])]))
    decode = servers.add(_sglang(env, f"decode{tag}", log_dir, free_port(), model, tp,
                                 ["--disaggregation-mode", "decode", *pd,
                                  "--disaggregation-decode-retraction-backup", "cpu_tensor", *(extra_decode or [])]))
    router = pd_router(env.python, prefill, decode, boot, log_dir, tag, router_args)
    try:
        cpu_env = server_env(env, tp, switches)
        # Decode ranks take the cores after the prefill's (the machine may have fewer: they wrap).
        decode_env = dict(cpu_env, SGLANG_CPU_OMP_THREADS_BIND="|".join(
            str((tp + r) % max(1, os.cpu_count() or 1)) for r in range(tp)))
        prefill.start(cpu_env)
        decode.start(decode_env)
        prefill.wait_ready("/health", STARTUP_S)
        decode.wait_ready("/health", STARTUP_S)
        servers.add(router)
        router.start(server_env(env, 1))
        router.wait_ready("/health", 300)
    except BaseException:
        servers.stop()
        raise
    return Cluster(servers, router.url, prefill=prefill, decode=decode, router=router, bootstrap_port=boot, tp=tp,
                   switches=dict(switches or {}))


def pd_router(python, prefill: Proc, decode: Proc, bootstrap_port: int, log_dir: Path, tag: str = "",
              args: list | None = None, more_prefills: list[tuple[Proc, int]] = ()) -> Proc:
    """The PD router in front of one prefill (and ``more_prefills``, with their bootstrap ports) and one decode,
    on loopback (not started yet)."""
    port = free_port()
    prefills = [a for p, boot in [(prefill, bootstrap_port), *more_prefills] for a in ("--prefill", p.url, str(boot))]
    return Proc(f"router{tag}", [str(python), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                 *prefills, "--decode", decode.url,
                                 "--host", LOOPBACK, "--port", str(port),
                                 "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port()), *(args or [])],
                log_dir / f"router{tag}.log", f"http://{LOOPBACK}:{port}")


def chat(front: str, text: str = "hello world", max_tokens: int = 8, timeout: float = 60) -> tuple[int, bytes]:
    return http("POST", front + "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens},
                timeout=timeout)


def wait_serving(c: Cluster, timeout: float = 240) -> None:
    """Until one chat request completes through the front (the router admits workers after its own checks)."""
    import time

    deadline = time.monotonic() + timeout
    last = (0, b"")
    while time.monotonic() < deadline:
        if c.servers.dead():
            break
        last = chat(c.front, timeout=30)
        if last[0] == 200:
            return
        time.sleep(2)
    raise ServerFailed(f"no request completed through {c.front} within {timeout:.0f}s "
                       f"(dead: {c.servers.dead()}; last answer {last[0]} {last[1][:300]!r})")

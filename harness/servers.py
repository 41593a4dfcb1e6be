"""Real ``sglang.launch_server`` / PD-router processes for the e2e suite: start, wait, stop, keep logs.

Every process gets free loopback ports, its own session (so a stop reaches its
scheduler and detokenizer children), a log file, a bounded startup (the log's
tail is in the error when it does not come up) and a bounded stop by PID: SIGTERM
to the process group, SIGKILL after a grace period. ``ServerSet.stop`` always
runs, from a fixture's finalizer, whatever the test did.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"


_HANDED_OUT: set[int] = set()
_PORTS = random.Random(os.getpid())


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, below Linux's ephemeral range.

    Ports the OS hands out for outgoing connections (32768-60999) can be taken between
    our check and the server's bind (seen: a gloo TCPStore failing with EADDRINUSE), and
    sglang opens some listeners next to the ones it is given: so each port comes from
    20000-32000, at least 16 away from every port this session handed out before.
    """
    for _ in range(1000):
        port = _PORTS.randrange(20000, 32000)
        if any(abs(port - p) < 16 for p in _HANDED_OUT):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free loopback port in 20000-32000")


def http(method: str, url: str, body: dict | bytes | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """One HTTP request; (status, body). Connection errors come back as status 0."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the test process dies, even without a teardown.

    pytest killed by a signal or a CI timeout runs no finalizer; this keeps its servers from
    outliving it (sglang's own schedulers and detokenizer follow their launcher when it dies).
    """
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Proc:
    """One started process: what it is, its log, how to reach it."""

    name: str
    argv: list[str]
    log: Path
    url: str
    popen: subprocess.Popen | None = None
    env: dict | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, env: dict | None = None) -> None:
        """Start (or start again, with the environment of the first start)."""
        self.env = env if env is not None else self.env
        env = self.env
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        try:
            self.popen = subprocess.Popen(
                self.argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        finally:
            out.close()

    def wait_ready(self, path: str, timeout: float) -> None:
        """Until ``GET url+path`` answers 200; raise with the log's tail if it dies or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerFailed(f"{self.name} exited with {self.popen.returncode} before it was ready "
                                   f"(log {self.log}):\n{log_tail(self.log)}")
            if http("GET", self.url + path, timeout=5)[0] == 200:
                return
            time.sleep(1.0)
        raise ServerFailed(f"{self.name} not ready on {self.url}{path} within {timeout:.0f}s (log {self.log}):\n"
                           f"{log_tail(self.log)}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds; reap."""
        if self.popen is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait)
                # The leader is gone; its children (schedulers, detokenizer) may not be.
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def kill9(self) -> None:
        """What an operator's ``kill -9`` does to the whole server: every process of the group at once."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(10)


class ServerFailed(RuntimeError):
    """A server did not come up, or died; the message carries its log's tail."""


@dataclass
class ServerSet:
    """Processes started together and stopped together (reverse order)."""

    procs: list[Proc] = field(default_factory=list)

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def dead(self) -> list[str]:
        return [p.name for p in self.procs if p.popen is not None and not p.alive()]

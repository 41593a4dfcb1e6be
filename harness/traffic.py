"""Background chat traffic through a front (router or server) while a scenario does its damage."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness.cluster import chat


class Traffic:
    """``workers`` threads each sending one short chat after another until stopped; counts the answers."""

    def __init__(self, front: str, workers: int = 2, timeout: float = 60.0):
        self.front, self.workers, self.timeout = front, workers, timeout
        self.ok = 0
        self.failed: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def _loop(self) -> None:
        while not self._stop.is_set():
            status, _ = chat(self.front, timeout=self.timeout)
            with self._lock:
                if status == 200:
                    self.ok += 1
                else:
                    self.failed.append(status)

    def __enter__(self) -> "Traffic":
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)


def burst(front: str, n: int, timeout: float) -> dict:
    """``n`` chats at once, each bounded by ``timeout`` seconds: how many completed, and the other answers."""
    start = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        statuses = [s for s, _ in pool.map(lambda _: chat(front, timeout=timeout), range(n))]
    return {"sent": n, "completed": statuses.count(200), "other": sorted(s for s in statuses if s != 200),
            "seconds": round(time.monotonic() - start, 2)}

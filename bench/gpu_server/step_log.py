"""The server side of the cost set: sglang's own decode step time from its log, and each step's kernels.

Step time. sglang's scheduler logs a ``Decode batch`` line every ``--decode-log-interval`` decode steps, with
the requests running N and the generation throughput T of the steps since its previous line (tokens over
wall time). While N requests decode, every step makes N tokens, so that window's step is N / T. A window is
clean when each of its steps decoded the visit's whole batch: its line shows N equal to the batch, and it is
not the visit's first line, whose window reaches back over the idle gap and the previous visit's last steps.

Prefill pace. :func:`prefill_pace` reads sglang's ``Prefill batch`` lines as the time each batch took while
requests waited (the ``agents`` set's server-side figure beside its clients'). Two servers under the same
traffic do not run the same batches: which histories are on the device, on the host or gone differs, and a
batch's time grows with its cached tokens too (its new tokens attend over them), so their new tokens a second
differ by what their batches held (two servers of one configuration by 13% on an H100). :func:`matched_ratio`
compares them on one batch instead: each server's batch time is fitted as ``a + b * new + c * cached`` (least
squares over its busy batches), both fits are read at the two servers' mean batch, and the ratio of the two
times is given with a bootstrap 95% interval (batches resampled within each server).

Kernels. A torch profile of a few decode steps (sglang's ``/start_profile``) holds every GPU kernel the steps
ran; :func:`kernel_table` gives each kernel's launches and GPU time per step, the package's own kernels
marked, and :func:`kernel_diff` the difference of two servers' tables, kernel by kernel, largest first, with
the kernels that run on one side only.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import defaultdict

LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?gen throughput \(token/s\): ([0-9.]+)")
PREFILL = re.compile(r"^(?:\[([0-9-]+ [0-9:]+)[^\]]*\] )?Prefill batch, #new-seq: \d+, #new-token: (\d+), #cached-token: (\d+),.*?#queue-req: (\d+)"
                     r".*?input throughput \(token/s\): ([0-9.]+)", re.M)
BUSY_GAP_S = 1.0  # a gap longer than this between prefill lines is idle time between visits, not a batch
# The package's Triton kernels (src/dsv4_sm120/kernels): logits, key store, query, page checksum, page copy.
PACKAGE_KERNELS = re.compile(r"^_(logits|store|query|checksum|copy_pages)_kernel")


def window_steps_ms(log_text: str, batch: int) -> list[float]:
    """The step (ms) of every clean logged window in ``log_text``, the log written during one visit."""
    windows = LINE.findall(log_text)[1:]  # the first reaches back before the visit
    return [int(n) * 1e3 / float(t) for n, t in windows if int(n) == batch and float(t) > 0]


def visit_step_ms(log_text: str, batch: int) -> float | None:
    """One visit's server-side step: the median of its clean windows (None: the visit logged none)."""
    steps = window_steps_ms(log_text, batch)
    return round(statistics.median(steps), 4) if steps else None


def busy_batches(log_text: str, spans: list[tuple[str, str]] | None = None) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens, seconds) of each prefill batch logged with requests queued behind it; with
    ``spans`` ((start, end) as sglang stamps its lines, ``YYYY-mm-dd HH:MM:SS``, both ends included), only the
    batches logged within one of them."""
    out = []
    for stamp, n, c, queued, thr in PREFILL.findall(log_text):
        if spans is not None and not any(start <= stamp <= end for start, end in spans):
            continue
        n, thr = int(n), float(thr)
        if int(queued) > 0 and thr > 0 and n / thr < BUSY_GAP_S:
            out.append((n, int(c), n / thr))
    return out


MIN_FIT_BATCHES = 12  # fewer busy batches than this give no fit
BOOTSTRAP = 400


def _batch_time(batches, at) -> float:
    """The least-squares ``a + b * new + c * cached`` of these batches' seconds, read at ``at`` = (new, cached)."""
    import numpy as np

    x = np.asarray(batches, dtype=float)
    design = np.c_[np.ones(len(x)), x[:, 0] / 1e3, x[:, 1] / 1e3]
    coef = np.linalg.lstsq(design, x[:, 2], rcond=None)[0]
    return float(coef @ [1.0, at[0] / 1e3, at[1] / 1e3])


def matched_ratio(num: list, den: list, seed: int = 0) -> dict | None:
    """Prefill speed of ``num`` over ``den`` (:func:`busy_batches` of each) on the same batch: the fitted time of
    ``den``'s batches over ``num``'s at the mean batch of both, with its bootstrap 95% interval; None with fewer
    than ``MIN_FIT_BATCHES`` on either side."""
    import numpy as np

    if min(len(num), len(den)) < MIN_FIT_BATCHES:
        return None
    both = np.asarray(num + den, dtype=float)
    at = (both[:, 0].mean(), both[:, 1].mean())
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(BOOTSTRAP):
        a = [num[i] for i in rng.integers(0, len(num), len(num))]
        b = [den[i] for i in rng.integers(0, len(den), len(den))]
        draws.append(_batch_time(b, at) / _batch_time(a, at))
    return {"ratio": round(_batch_time(den, at) / _batch_time(num, at), 4),
            "low": round(float(np.percentile(draws, 2.5)), 4), "high": round(float(np.percentile(draws, 97.5)), 4),
            "at_new_tokens": round(at[0]), "at_cached_tokens": round(at[1]), "batches": [len(num), len(den)]}


def prefill_pace(batches: list[tuple[int, int, float]]) -> dict:
    """The prefill's own pace over a log's :func:`busy_batches`: the batches it ran with requests queued behind them.

    sglang's ``Prefill batch`` line gives the batch's new tokens and ``input throughput``, new tokens over the
    time since the previous prefill line, so new / throughput is the time between the two lines: the batch's
    forward and whatever the scheduler did around it (result processing, HiCache bookkeeping, the next batch's
    admission). Only batches with a queue behind them are taken (the scheduler was never idle between the
    two lines), and gaps over ``BUSY_GAP_S``. Returns their count, the mean and median ms a batch, new tokens a
    second over them and their cached tokens per new token (the same traffic gives the same ratio)."""
    gaps, new, cached = [t for _, _, t in batches], sum(n for n, _, _ in batches), sum(c for _, c, _ in batches)
    if not gaps:
        return {"batches": 0}
    return {"batches": len(gaps), "ms_per_batch": round(1e3 * sum(gaps) / len(gaps), 2),
            "median_ms": round(1e3 * statistics.median(gaps), 2), "new_tokens_per_s": round(new / sum(gaps), 1),
            "cached_per_new": round(cached / max(new, 1), 3)}


def kernel_table(trace_path, steps: int) -> list[dict]:
    """Every GPU kernel of one profile (``*.trace.json.gz``) of ``steps`` decode steps: name, launches and GPU
    time per step, the package's own marked; the most time first."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    launches: dict[str, int] = defaultdict(int)
    gpu_us: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.get("cat") == "kernel" and "dur" in ev:
            launches[ev["name"]] += 1
            gpu_us[ev["name"]] += float(ev["dur"])
    return [{"name": name, "launches_per_step": round(launches[name] / steps, 2),
             "us_per_step": round(gpu_us[name] / steps, 2), "package": bool(PACKAGE_KERNELS.match(name))}
            for name in sorted(gpu_us, key=gpu_us.get, reverse=True)]


def kernel_diff(ours: list[dict], theirs: list[dict], keep: int = 25) -> dict:
    """``ours`` minus ``theirs`` per step: the totals, and per kernel name the GPU time and launches each side
    spends, largest absolute difference first (``keep`` of them), with the names on one side only."""
    a, b = {k["name"]: k for k in ours}, {k["name"]: k for k in theirs}
    rows = []
    for name in set(a) | set(b):
        us_a, us_b = (a[name]["us_per_step"] if name in a else 0.0), (b[name]["us_per_step"] if name in b else 0.0)
        rows.append({"name": name[:120], "ours_us": us_a, "theirs_us": us_b, "delta_us": round(us_a - us_b, 2),
                     "ours_launches": a[name]["launches_per_step"] if name in a else 0.0,
                     "theirs_launches": b[name]["launches_per_step"] if name in b else 0.0,
                     "side": "both" if name in a and name in b else "ours only" if name in a else "theirs only"})
    rows.sort(key=lambda r: abs(r["delta_us"]), reverse=True)
    total_a, total_b = sum(k["us_per_step"] for k in ours), sum(k["us_per_step"] for k in theirs)
    return {"ours_us_per_step": round(total_a, 2), "theirs_us_per_step": round(total_b, 2),
            "delta_us_per_step": round(total_a - total_b, 2), "kernels": rows[:keep],
            "ours_only_us": round(sum(r["ours_us"] for r in rows if r["side"] == "ours only"), 2),
            "theirs_only_us": round(sum(r["theirs_us"] for r in rows if r["side"] == "theirs only"), 2)}

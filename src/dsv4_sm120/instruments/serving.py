"""``dsv4-sm120 bench-serving``: upstream's serving benchmark at each concurrency, its JSON kept with the context.

Why a wrapper and not a benchmark: upstream's ``python -m sglang.benchmark.serving``
already measures throughput, TTFT, TPOT and ITL well; what a fix needs on top is the
same run at low and high concurrency (C = 1 and C = 64 by default) and a record
that says what was measured — the launch flags and the ``DSV4_SM120_*`` switches —
so that "before" and "after" files can be compared later. This module only builds
upstream's command line (printed first, so it can be re-run by hand), runs it once
per concurrency in a child process, and collects the JSON line upstream writes.

Arguments after ``--`` go to upstream unchanged (e.g. ``-- --pd-separated
--flush-cache``); ``--dry-run`` prints the commands without running them.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from dsv4_sm120.instruments import common

UPSTREAM_MODULE = "sglang.benchmark.serving"
SUMMARY_KEYS = (
    "completed",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)
_TAIL_LINES = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_endpoint_arguments(parser)
    pos = common.positive
    parser.add_argument("--concurrency", type=pos(int), nargs="+", default=[1, 64], help="concurrency levels (default 1 64)")
    parser.add_argument(
        "--num-prompts", type=pos(int), default=None, help="requests per level (default: max(16, 4 x concurrency))"
    )
    parser.add_argument(
        "--backend", default="sglang-oai-chat", help="upstream --backend (default sglang-oai-chat: /v1/chat/completions)"
    )
    parser.add_argument(
        "--dataset-name", default="random", help="upstream --dataset-name (default random; random-ids needs no download)"
    )
    parser.add_argument("--dataset-path", default=None, help="upstream --dataset-path (a local ShareGPT JSON avoids the hub)")
    parser.add_argument("--random-input-len", type=pos(int), default=1024)
    parser.add_argument("--random-output-len", type=pos(int), default=1024)
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer path or hub id (default: upstream asks the server, then uses --model)"
    )
    parser.add_argument("--out-dir", default="bench/results/serving", help="where the run's JSON goes")
    parser.add_argument("--tag", default=None, help="a word for the file name and upstream's --tag, e.g. fixes-on")
    parser.add_argument("--level-timeout", type=pos(float), default=3600.0, help="seconds one level may run")
    parser.add_argument("--python", default=sys.executable, help="interpreter that has sglang (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="print the upstream commands and exit")
    parser.add_argument("upstream_args", nargs=argparse.REMAINDER, help="after --: passed to upstream unchanged")


def _extra(args) -> list[str]:
    extra = list(args.upstream_args)
    return extra[1:] if extra[:1] == ["--"] else extra


def upstream_argv(args: argparse.Namespace, concurrency: int, output_file: str) -> list[str]:
    """The upstream benchmark command for one concurrency level."""
    argv = [
        args.python, "-m", UPSTREAM_MODULE,
        "--backend", args.backend,
        "--base-url", args.base_url,
        "--model", args.model,
        "--dataset-name", args.dataset_name,
        "--num-prompts", str(args.num_prompts or max(16, 4 * concurrency)),
        "--max-concurrency", str(concurrency),
        "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len),
        "--output-file", output_file,
        "--disable-tqdm",
    ]  # fmt: skip
    if args.dataset_path:
        argv += ["--dataset-path", args.dataset_path]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.tag:
        argv += ["--tag", args.tag]
    return argv + _extra(args)


def _run_upstream(argv: list[str], timeout_s: float, env: dict[str, str]) -> tuple[int, list[str]]:
    """Run upstream, echoing its output to stderr; (return code, last lines of output)."""
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    killer = threading.Timer(timeout_s, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        killer.cancel()
    if rc < 0:
        tail.append(f"[dsv4-sm120] upstream killed by signal {-rc} (level timeout {timeout_s:.0f} s?)")
    return rc, list(tail)


def _last_json_line(path: Path) -> dict | None:
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1]) if lines else None


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        for c in args.concurrency:
            print(shlex.join(upstream_argv(args, c, f"<out-dir>/upstream_c{c}.jsonl")))
        return 0

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_path = Path(args.out_dir) / f"serving_{stamp}{'_' + args.tag if args.tag else ''}.json"
    record = common.provenance("dsv4-sm120 bench-serving", args)
    record.update(upstream=UPSTREAM_MODULE, levels=[], summary=[])
    env = dict(os.environ)
    if args.api_key:
        env["OPENAI_API_KEY"] = args.api_key  # upstream reads the key from the environment only

    ok = True
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-serving-") as tmp:
        for c in args.concurrency:
            jsonl = Path(tmp) / f"upstream_c{c}.jsonl"
            argv = upstream_argv(args, c, str(jsonl))
            common.log(f"[C={c}] {shlex.join(argv)}")
            rc, tail = _run_upstream(argv, args.level_timeout, env)
            result = _last_json_line(jsonl) if rc == 0 else None
            level = {"concurrency": c, "argv": argv, "returncode": rc, "result": result}
            if result is None:
                ok = False
                level["error"] = "upstream wrote no result; the last lines it printed:\n" + "\n".join(tail)
                common.log(f"[C={c}] FAILED (exit {rc}); see 'error' in {out_path}")
            record["levels"].append(level)
            record["summary"].append({"concurrency": c, **{k: (result or {}).get(k) for k in SUMMARY_KEYS}})
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(record, indent=2, default=str) + "\n")  # kept level by level
    common.log(f"wrote {out_path}")
    for row in record["summary"]:
        common.log("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(json.dumps({"file": str(out_path), "summary": record["summary"]}, indent=2))
    return 0 if ok else 1

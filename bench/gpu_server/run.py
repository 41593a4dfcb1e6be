"""``python -m bench.gpu_server run``: start real sglang servers on this GPU host, run scenarios, stop them all.

Run it from the repository root with the unpacked bundle's environment (``source <root>/env.sh``). It starts
every server of the chosen scenario set at once on 127.0.0.1 (they share the GPU; each takes a fixed share
of its memory), waits until each answers ``/health_generate``, sends the scenario's traffic to one server at
a time, stops every process it started (by process group, also on errors and Ctrl-C) and writes one JSON:
date, device, commit, the versions that ran, each server's exact launch line and environment, start-up
times, what (if anything) was replaced, and the scenario's figures. Server logs are kept in ``--logs``.
The ``pd`` set starts and stops its own processes (a router after its pair, a decode killed and started
again, a second pair with a fix off) and fills the same record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench.gpu_server import abort_safety, agents, hicache, incident, longctx, pd, restore, scenarios
from bench.gpu_server.servers import Started, launch_line, log_tail, start, wait_healthy
from harness import dsv4_checkpoints, run_record

SETS = {"serve": (scenarios.serve_specs, scenarios.run_serve), "cost": (scenarios.cost_specs, scenarios.run_cost),
        "hicache": (hicache.specs, hicache.run), "longctx": (longctx.specs, longctx.run),
        "restore": (restore.specs, restore.run)}
# Sets that start their own processes: run(models_root, log_dir, startup_timeout, servers record, results,
# mem_fraction=None, ready=None); ready(), when given, is called once their servers serve, before their traffic
OWN_PROCESSES = {"pd": pd.run, "incident": incident.run, "agents": agents.run, "abort_safety": abort_safety.run}
VERSIONS_PY = (
    "import json, importlib.metadata as m\n"
    "names = ['torch', 'triton', 'sglang', 'sglang-kernel', 'sgl-kernel', 'sgl-deep-gemm', 'deep-gemm',\n"
    "         'sgl-flash-mla', 'tilelang', 'apache-tvm-ffi', 'transformers', 'dsv4-sm120', 'nvidia-nccl-cu13']\n"
    "out = {}\n"
    "for n in names:\n"
    "    try: out[n] = m.version(n)\n"
    "    except m.PackageNotFoundError: pass\n"
    "import torch\n"
    "out['torch.cuda'] = torch.version.cuda\n"
    "out['nccl'] = '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None\n"
    "try:\n"
    "    import dsv4_sm120\n"
    "    out['dsv4_sm120_path'] = dsv4_sm120.__file__\n"
    "except ImportError: pass\n"
    "print(json.dumps(out))\n"
)


def _sh(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


CPU_FACTS = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)")


def host_facts() -> dict:
    """Device, driver, the host's CPUs (``lscpu``: servers that share a GPU share these too), versions of what
    this environment imports (read in a child interpreter)."""
    gpu = _sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    versions = _sh([sys.executable, "-c", VERSIONS_PY])
    cpu = dict(line.split(":", 1) for line in _sh(["lscpu"]).splitlines() if ":" in line)
    return {"device": gpu, "python": sys.version.split()[0],
            "cpu": {k: cpu[k].strip() for k in CPU_FACTS if k in cpu},
            "versions": json.loads(versions) if versions.startswith("{") else {"error": "could not read versions"}}


def package_commit(record: dict, bundle: Path) -> str | None:
    """The commit of the package the servers import: the bundle's wheel, which may be older than the checkout that
    drives them, unless a checkout's ``src`` stands before it on ``PYTHONPATH`` (then the run's own commit)."""
    path = record.get("versions", {}).get("dsv4_sm120_path") or ""
    if path and not path.startswith(str(bundle)):
        return record["commit"]
    return ((record["bundle"] or {}).get("project") or {}).get("commit", "")[:7] or None


def ensure_checkpoints(models: set[str], models_root: Path) -> list[str]:
    """Write the config of each of ``models`` that ``models_root`` lacks (a bundle finished before the checkpoint
    was added to ``harness/dsv4_checkpoints.py``); the names written. No folder, no bundle: nothing written."""
    if not Path(models_root).is_dir():
        return []
    missing = sorted(m for m in models if not (Path(models_root) / m / "config.json").exists())
    for name in missing:
        dsv4_checkpoints.write(name, models_root)
    return missing


def wait_for_file(path: Path, timeout: float) -> float:
    """Seconds waited until ``path`` existed; raises TimeoutError after ``timeout``."""
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


def _stop_on_sigterm(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def _keep_logs(log_dir: Path, out_dir: Path) -> None:
    """The run's server logs (a set started more than once keeps each start's in a folder of its own) as one xz
    tar beside the JSON (a GPU host may give back only a few files)."""
    with tarfile.open(out_dir / f"{log_dir.name}.tar.xz", "w:xz") as tar:
        for log in sorted(log_dir.rglob("*.log")):
            tar.add(log, arcname=f"{log_dir.name}/{log.relative_to(log_dir)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_server run", description=__doc__.splitlines()[0])
    ap.add_argument("set", choices=sorted(SETS | OWN_PROCESSES),
                    help="serve: scenarios a, b, e, f (tiny); cost: scenario c (flash12); hicache: the HiCache storm; "
                         "longctx: bf16 keys against upstream's fp8 indexers, prefill 16k-256k and decode at 16k-256k "
                         "(DSV4_GPU_LONGCTX_MODEL, default flash12); "
                         "pd: a prefill/decode pair over NIXL behind the PD router under the PD scenarios (tiny); "
                         "incident: PD pairs with HiCache and decode graphs under killed 80-session agents (hicache); "
                         "agents: HiCache's gain and the fixes' price on an agent workload at C=4 and C=64 (flash12); "
                         "abort_safety: late NIXL writes under killed agents, two prefills and a decode (hicache)")
    ap.add_argument("--bundle", type=Path, default=Path(os.environ.get("DSV4_BUNDLE_ROOT", "/tmp/dsv4-bundle/root")),
                    help="the unpacked bundle (its models/ holds the checkpoints)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--logs", type=Path, default=None, help="server logs (default: beside --out)")
    ap.add_argument("--commit", default=None, help="the project's commit being run (default: $COMMIT, else this checkout's)")
    ap.add_argument("--startup-timeout", type=float, default=float(os.environ.get("DSV4_GPU_STARTUP_TIMEOUT", 480)),
                    help="seconds for every server to answer /health_generate (env DSV4_GPU_STARTUP_TIMEOUT)")
    ap.add_argument("--only", default="", help="comma-separated server names of the set (default: all)")
    ap.add_argument("--after", type=Path, default=None,
                    help="once the servers are healthy, wait until this file exists before the scenarios (a GPU "
                         "shared with another job until then: timings are taken on a quiet GPU, startup is not)")
    ap.add_argument("--after-timeout", type=float, default=900.0, help="seconds to wait for --after at most")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="every server's --mem-fraction-static instead of its set's own: a set started beside "
                         "servers that are still loading or capturing needs a share that covers their growth")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a bounded run still stops its servers and writes its JSON
    log_dir = args.logs or args.out.parent / f"logs_{args.set}"
    log_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "date": run_record.now_utc(),
        "commit": run_record.commit(args.commit), "set": args.set, **host_facts(),
        "bundle": json.loads((args.bundle / "bundle.json").read_text()) if (args.bundle / "bundle.json").exists() else None,
        "replaced": [],  # upstream calls routed elsewhere: none; a run that needs one names it here
        "servers": {},
    }
    record["package_commit"] = package_commit(record, args.bundle)
    started: list[Started] = []
    t0 = time.monotonic()
    try:
        record["results"] = {}
        if args.set in OWN_PROCESSES:
            def ready() -> None:  # the set's servers serve: wait for --after before the timed traffic
                if args.after is not None:
                    record["waited_for"] = {"file": str(args.after),
                                            "seconds": wait_for_file(args.after, args.after_timeout)}

            OWN_PROCESSES[args.set](args.bundle / "models", log_dir, args.startup_timeout, record["servers"],
                                    record["results"], mem_fraction=args.mem_fraction, ready=ready)
        else:
            make_specs, run_set = SETS[args.set]
            specs = [s for s in make_specs() if not args.only or s.name in args.only.split(",")]
            if args.mem_fraction is not None:
                specs = [dataclasses.replace(s, mem_fraction=args.mem_fraction) for s in specs]
            record["checkpoints_written"] = ensure_checkpoints({s.model for s in specs}, args.bundle / "models")
            started = [start(s, args.bundle / "models", log_dir) for s in specs]
            wait_healthy(started, args.startup_timeout)
            record["servers"] = {s.spec.name: {"launch": launch_line(s), "healthy_after_s": s.healthy_after_s}
                                 for s in started}
            if args.after is not None:
                record["waited_for"] = {"file": str(args.after), "seconds": wait_for_file(args.after, args.after_timeout)}
            urls = {s.spec.name: s.url for s in started}
            logs = {s.spec.name: (lambda p=s.proc.log: p.read_text(errors="replace")) for s in started}
            run_set(urls, logs, log_dir / "work", record["results"])
            record["dead_after_traffic"] = [s.spec.name for s in started if not s.proc.alive()]
    except (Exception, SystemExit) as exc:  # the JSON says what failed; the logs are kept either way
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["log_tails"] = {s.spec.name: log_tail(s.proc.log, 80) for s in started}
    finally:
        for s in started:
            s.proc.stop()
        record["wall_s"] = round(time.monotonic() - t0, 1)
        run_record.write(args.out, record)
        _keep_logs(log_dir, args.out.parent)
    print(json.dumps({k: record[k] for k in ("date", "device", "set", "wall_s") if k in record}))
    if "error" in record:
        print(record["error"][:4000], file=sys.stderr)
        return 1
    return 0

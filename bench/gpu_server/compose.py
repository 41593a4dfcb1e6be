"""``python -m bench.gpu_server.compose``: the one record of a GPU host's serving scenarios, (a) to (f), from the runs that measured them.

The scenarios run as separate sets (``run serve`` for a, b, e and f on the tiny checkpoint, ``run cost`` for c on
``flash12``, ``python -m bench.indexer --eager-only`` for d), each writing its own JSON with its date, device,
commit and versions. This puts their figures side by side with each one's source file and provenance, and
holds each against its bar: c decode step <= 1.03x and prefill <= 1.05x of upstream's TileLang fp8 path, d an
eager call adds <= 20 us of host time, e a package server's first request of a shape <= 2x its steady state.
It copies figures; it measures nothing.

    python -m bench.gpu_server.compose --serve S.json --cost C.json --eager E.json --out OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from harness import run_record

BARS = {"c_decode_vs_tilelang": 1.03, "c_prefill_vs_tilelang": 1.05, "d_host_added_us": 20.0, "e_first_over_steady": 2.0}
PACKAGE_SERVERS = ("dsv4",)  # server names of the package start so; upstream's start "sglang"


def _source(path: Path, record: dict) -> dict:
    return {"file": str(path), **{k: record.get(k) for k in ("date", "commit", "device", "versions", "torch", "triton")
                                  if k in record}}


def _worst(values) -> float | None:
    found = [v for v in values if isinstance(v, (int, float))]
    return max(found) if found else None


def _meets(worst: float | None, bar: float) -> bool | None:
    return None if worst is None else worst <= bar


def cost_figures(results: dict) -> dict:
    vs = results.get("ratios", {}).get("dsv4_bf16/sglang_tilelang", {})
    decode = _worst(v for k, v in vs.items() if k.startswith("decode"))
    prefill = _worst(v for k, v in vs.items() if k.startswith("prefill"))
    return {"decode": results.get("decode"), "prefill": results.get("prefill"), "ratios": results.get("ratios"),
            "indexer_share": results.get("indexer_share"),
            "worst_decode_vs_tilelang": decode, "meets_decode_bar": _meets(decode, BARS["c_decode_vs_tilelang"]),
            "worst_prefill_vs_tilelang": prefill, "meets_prefill_bar": _meets(prefill, BARS["c_prefill_vs_tilelang"])}


def eager_figures(record: dict) -> dict:
    rows = [{k: r.get(k) for k in ("B", "live", "eager_us", "eager_before_us", "graph_us", "kernel_us", "host_added_us",
                                   "host_added_before_us")} for r in record.get("eager", [])]
    worst = _worst(r["host_added_us"] for r in rows)
    return {"shapes": rows, "worst_host_added_us": worst, "meets_bar": _meets(worst, BARS["d_host_added_us"])}


def first_request_figures(*per_server: dict) -> dict:
    """The worst first-over-steady figure of the package's servers over every source, against the bar."""
    def flat(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from flat(v)
        elif isinstance(value, (int, float)):
            yield value

    package = [x for figures in per_server for name, v in figures.items() if name.startswith(PACKAGE_SERVERS)
               for x in flat(v)]
    worst = _worst(package)
    return {"worst_package": worst, "meets_bar": _meets(worst, BARS["e_first_over_steady"])}


def compose(serve_path: Path, cost_path: Path, eager_path: Path) -> dict:
    serve, cost, eager = (json.loads(Path(p).read_text()) for p in (serve_path, cost_path, eager_path))
    s, c = serve.get("results", {}), cost.get("results", {})
    serve_first, cost_first = s.get("e_first_over_steady", {}), c.get("first_vs_steady", {})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "composed_by": "python -m bench.gpu_server.compose",
        "bars": BARS,
        "sources": {"a_b_e_f": _source(serve_path, serve), "c": _source(cost_path, cost), "d": _source(eager_path, eager)},
        "replaced": sorted({json.dumps(r, sort_keys=True) for r in serve.get("replaced", []) + cost.get("replaced", [])}),
        "launches": {"serve": serve.get("servers"), "cost": cost.get("servers")},
        "a_served": s.get("a_served"),
        "b_fp8_equals_upstream": s.get("b_fp8_equals_upstream"),
        "b_topk_overlap_bf16_vs_fp8": s.get("b_topk_overlap_bf16_vs_fp8"),
        "c_cost": cost_figures(c),
        "d_eager_host": eager_figures(eager),
        "e_first_over_steady": {"serve": serve_first, "cost": cost_first,
                                **first_request_figures(serve_first, cost_first)},
        "f_model_built_lines": s.get("f_model_built_lines"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_server.compose", description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=Path, required=True, help="a `run serve` JSON (scenarios a, b, e, f)")
    ap.add_argument("--cost", type=Path, required=True, help="a `run cost` JSON (scenario c)")
    ap.add_argument("--eager", type=Path, required=True, help="a `python -m bench.indexer --eager-only` JSON (scenario d)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    record = compose(args.serve, args.cost, args.eager)
    run_record.write(args.out, record)
    print(json.dumps({k: {m: v for m, v in record[k].items() if m.startswith("meets")}
                      for k in ("c_cost", "d_eager_host", "e_first_over_steady")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

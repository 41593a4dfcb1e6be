"""``python -m bench.gpu_server.brief RUN.json``: the few lines of a run's JSON a person reads first (startup,
error, and each set's headline figures), for a terminal that shows only the end of the output."""

from __future__ import annotations

import json
import sys

HEADLINES = ("ratios", "decode", "prefill", "indexer_share", "outputs_vs_off", "storm_budget_s", "mismatch_lines",
             "a_served", "b_fp8_equals_upstream", "e_first_over_steady")
PD_SCENARIOS = ("a_abort_storm", "b_hostile_frames", "c_pd_checksum", "d_decode_killed", "b_hostile_frames_hardening_off")


def brief(record: dict) -> dict:
    results = record.get("results") or {}
    out = {"set": record.get("set"), "wall_s": record.get("wall_s"), "error": (record.get("error") or "")[:1500],
           "healthy_after_s": {n: s.get("healthy_after_s") for n, s in record.get("servers", {}).items()},
           "dead_after_traffic": record.get("dead_after_traffic")}
    out.update({k: results[k] for k in HEADLINES if k in results})
    out.update({n: {k: v for k, v in results[n].items() if k != "metric_deltas"} for n in PD_SCENARIOS if n in results})
    if "storms" in results:
        out["storms"] = {n: {k: v for k, v in s.items() if k not in ("failed_waves", "waves")}
                         | {"failed_waves": len(s.get("failed_waves", []))}
                         for n, s in results["storms"].items()}
    return out


if __name__ == "__main__":
    print(json.dumps(brief(json.loads(open(sys.argv[1]).read())), default=str)[:9000])

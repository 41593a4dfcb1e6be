"""One prefill launch of the logits kernel for Nsight Compute (where its time goes: tensor-pipe use, stalls).

    ncu --kernel-name _logits_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats python3 bench/profile_prefill_h200.py

Dense prefill of ``--rows`` query rows against as many keys (bench/indexer_h200.py's prefill case); the first
launch compiles, the second is the one profiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_common  # noqa: E402,F401  (puts src/ on sys.path)
import indexer_h200 as ih  # noqa: E402
import torch  # noqa: E402
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=8192)
args = ap.parse_args()
gen = torch.Generator(device="cuda").manual_seed(1234)
n = args.rows
pool = torch.randn((n // ih.PAGE + 8, ih.PAGE, ih.D), generator=gen, device="cuda").to(torch.bfloat16)
q, w, sl, pt = ih.case(pool.shape[0], n, [n] * n, n, gen, shared=True)
out = torch.empty((n, n), device="cuda")
for _ in range(2):
    bf16_paged_mqa_logits(q, pool, w, sl, pt, n, out=out)
torch.cuda.synchronize()
print("done", n)

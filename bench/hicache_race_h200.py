"""GPU stress test of the HiCache ordering contract for bf16 index-K pages (GPU side).

Standalone torch + the package's kernels (no sglang). A device pool of bf16
index-K pages [P, 64, 128] and a pinned host mirror exchange pages on two side
streams (load-back: host -> device; back-up: device -> host) while indexer reads
run on the compute stream. Every page carries known content; the compute stream
checksums each page it reads (``page_checksum``) and compares it with the
checksum the page must have, so any read of a page before its load landed, any
load that overwrote a page still being read or not yet backed up, and any
back-up that copied a half-loaded page shows up as a mismatch.

The contract (``--fence``, the default) is three event edges per page batch:
  1. a read waits for the load that filled its pages (upstream's per-layer
     ``wait_layer_transfer`` fence);
  2. a load into a device page waits for the last read of that page and for the
     page's last back-up to land;
  3. a back-up of a device page waits for the load that filled it, and a host
     page is not loaded from while a back-up into it is in flight (and vice versa).
``--no-fence`` (test-only) drops all three edges: the run must report mismatches.

Then integrity mode: checksums taken at back-up are verified at load-back after
corruptions are planted in host pages; every planted corruption must be caught.
Finally the copy bandwidth of bf16 pages against pinned memcpy, and the checksum
overhead against the copy it guards, all in the same run. Writes
bench/results/hicache/hicache_race_h200_<date>.json (or $OUT_JSON).

    PYTHONPATH=src COMMIT=$(git rev-parse HEAD) python -m bench.hicache_race_h200
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
from pathlib import Path

import torch

from bench import _gpu_common as g
from dsv4_sm120.kernels.mqa_logits import bf16_paged_mqa_logits
from dsv4_sm120.kernels.page_checksum import page_checksum, page_checksum_ref
from dsv4_sm120.kernels.page_copy import copy_pages
from harness import run_record

SLOTS, D = 64, 128
PAGE_BYTES = SLOTS * D * 2


def rows(pages: torch.Tensor) -> torch.Tensor:
    return pages.view(pages.shape[0], -1).view(torch.uint8)


class RaceRun:
    """One stress run: ``iters`` iterations, each one load-back and one back-up of ``batch`` pages."""

    def __init__(self, dev_pages: int, host_pages: int, batch: int, fence: bool, seed: int):
        self.b, self.fence = batch, fence
        self.nd, self.nh = dev_pages // batch, host_pages // batch
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.dev = torch.randn((dev_pages, SLOTS, D), generator=gen, device="cuda").to(torch.bfloat16)
        host_init = torch.randn((host_pages, SLOTS, D), generator=gen, device="cuda").to(torch.bfloat16)
        self.host = torch.empty((host_pages, SLOTS, D), dtype=torch.bfloat16, pin_memory=True)
        self.host.copy_(host_init)
        self.exp_dev = page_checksum(rows(self.dev))
        self.exp_host = page_checksum(rows(host_init))
        del host_init
        self.mism = torch.zeros((), dtype=torch.int64, device="cuda")
        self.load_s, self.back_s = torch.cuda.Stream(), torch.cuda.Stream()
        self.comp = torch.cuda.current_stream()
        self.rng = random.Random(seed)
        self.dev_loaded, self.dev_read, self.dev_backed = {}, {}, {}
        self.host_reading, self.host_writing = {}, {}
        self.q = torch.randn((1, 64, D), generator=gen, device="cuda").to(torch.bfloat16)
        self.w = torch.randn((1, 64), generator=gen, device="cuda")
        self.seq = torch.full((1,), batch * SLOTS, dtype=torch.int32, device="cuda")
        self.tables = torch.arange(dev_pages, dtype=torch.int32, device="cuda").view(self.nd, batch)
        self.page_ops = 0

    def _wait(self, stream, events):
        if self.fence:
            for ev in events:
                if ev is not None:
                    stream.wait_event(ev)

    def _sl(self, idx):
        return slice(idx * self.b, (idx + 1) * self.b)

    def step(self, i: int) -> None:
        d = i % self.nd
        h_src = self.rng.randrange(self.nh)
        h_dst = self.rng.randrange(self.nh)
        while h_dst == h_src:
            h_dst = self.rng.randrange(self.nh)
        # load-back host[h_src] -> dev[d]
        self._wait(self.load_s, (self.dev_read.get(d), self.dev_backed.get(d), self.host_writing.get(h_src)))
        with torch.cuda.stream(self.load_s):
            self.dev[self._sl(d)].copy_(self.host[self._sl(h_src)], non_blocking=True)
            ev = self.load_s.record_event()
        self.dev_loaded[d] = ev
        self.host_reading[h_src] = ev
        self.page_ops += self.b
        # reads of dev[d] on the compute stream, issued right behind the load: the verifying
        # checksum first (so a missing fence shows within microseconds), then an indexer pass
        self._wait(self.comp, (ev,))
        cs = page_checksum(rows(self.dev[self._sl(d)]))
        self.exp_dev[self._sl(d)] = self.exp_host[self._sl(h_src)]
        self.mism += (cs != self.exp_dev[self._sl(d)]).sum()
        bf16_paged_mqa_logits(self.q, self.dev, self.w, self.seq, self.tables[d : d + 1], self.b * SLOTS)
        self.dev_read[d] = self.comp.record_event()
        # back-up of the batch loaded last iteration: dev[p] -> host[h_dst]
        p = (i - 1) % self.nd
        if i == 0:
            return
        self._wait(self.back_s, (self.dev_loaded.get(p), self.host_reading.get(h_dst), self.host_writing.get(h_dst)))
        with torch.cuda.stream(self.back_s):
            self.host[self._sl(h_dst)].copy_(self.dev[self._sl(p)], non_blocking=True)
            ev = self.back_s.record_event()
        self.dev_backed[p] = ev
        self.host_writing[h_dst] = ev
        self.exp_host[self._sl(h_dst)] = self.exp_dev[self._sl(p)]
        self.page_ops += self.b

    def finish(self) -> int:
        torch.cuda.synchronize()
        # the host mirror must hold exactly what the bookkeeping says it holds
        host_cs = torch.empty_like(self.exp_host)
        chunk = 1024
        for s in range(0, self.host.shape[0], chunk):
            host_cs[s : s + chunk] = page_checksum(rows(self.host[s : s + chunk].to("cuda")))
        host_bad = int((host_cs != self.exp_host).sum())
        return int(self.mism) + host_bad


def race(iters, fence, args, seed):
    run = RaceRun(args.dev_pages, args.host_pages, args.batch, fence, seed)
    for i in range(iters):
        run.step(i)
    bad = run.finish()
    return run.page_ops, bad


def plant(host_rows: torch.Tensor, page: int, kind: str, rng: random.Random) -> None:
    """Corrupt one host page in place (the kinds a late or stale transfer produces, and bit rot)."""
    row = host_rows[page]
    if kind == "bit":
        pos = rng.randrange(row.numel())
        row[pos] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        pos = rng.randrange(row.numel())
        row[pos] ^= rng.randrange(1, 256)
    elif kind == "swap":
        a = rng.randrange(row.numel())
        b = (a + rng.randrange(1, row.numel())) % row.numel()
        if row[a] == row[b]:
            row[a] ^= 0x55
        else:
            row[a], row[b] = row[b].clone(), row[a].clone()
    elif kind == "stale_slot":  # one 256-byte compressed slot from another page
        slot = rng.randrange(SLOTS)
        other = (page + 1) % host_rows.shape[0]
        src = host_rows[other, slot * 256 : (slot + 1) * 256].clone()
        if torch.equal(src, row[slot * 256 : (slot + 1) * 256]):
            src[0] ^= 1
        row[slot * 256 : (slot + 1) * 256] = src
    elif kind == "zero_tail":  # a transfer that stopped early
        cut = rng.randrange(1, row.numel())
        if bool((row[cut:] == 0).all()):
            row[-1] ^= 1
        else:
            row[cut:] = 0


def integrity(args, seed):
    """Checksums taken at back-up, verified at load-back, with corruptions planted in between."""
    n = args.integrity_pages
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.randn((n, SLOTS, D), generator=gen, device="cuda").to(torch.bfloat16)
    sums = page_checksum(rows(dev))  # taken when the page is backed up
    host = torch.empty((n, SLOTS, D), dtype=torch.bfloat16, pin_memory=True)
    host.copy_(dev)
    rng = random.Random(seed)
    kinds = ("bit", "byte", "swap", "stale_slot", "zero_tail")
    victims = rng.sample(range(n), args.planted)
    hrows = rows(host)
    for j, page in enumerate(victims):
        plant(hrows, page, kinds[j % len(kinds)], rng)
    back = host.to("cuda")  # load-back
    bad = page_checksum(rows(back)) != sums  # verified at load-back
    flagged = set(torch.nonzero(bad).flatten().tolist())
    caught = len(flagged & set(victims))
    false_alarms = len(flagged - set(victims))
    ref_agrees = bool(torch.equal(page_checksum_ref(rows(back[:256]).cpu()), page_checksum(rows(back[:256])).cpu()))
    return {"planted": len(victims), "caught": caught, "false_alarms": false_alarms,
            "kinds": list(kinds), "triton_matches_torch_ref": ref_agrees}


def bandwidth(args):
    """Pinned memcpy vs bf16 page copies (both directions), and checksum time vs guarded copy time."""
    n = args.bw_pages
    big_h = torch.empty(n * PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
    big_d = torch.empty(n * PAGE_BYTES, dtype=torch.uint8, device="cuda")
    big_h.fill_(7)
    pin_h2d = g.median_ms(lambda: big_d.copy_(big_h, non_blocking=True))
    pin_d2h = g.median_ms(lambda: big_h.copy_(big_d, non_blocking=True))
    del big_h, big_d
    host = torch.empty((2 * n, SLOTS, D), dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.uint8).fill_(3)
    dev = torch.randn((2 * n, SLOTS, D), device="cuda").to(torch.bfloat16)
    src = torch.randperm(2 * n, device="cuda")[:n].to(torch.int32)
    dst = torch.randperm(2 * n, device="cuda")[:n].to(torch.int32)
    out = {}
    try:  # random page lists in one launch through UVA (the HiCache shape of a transfer)
        out["page_gather_h2d_ms"] = g.median_ms(lambda: copy_pages(host, dev, src, dst))
        out["page_gather_d2h_ms"] = g.median_ms(lambda: copy_pages(dev, host, src, dst))
        check_idx = torch.arange(64, device="cuda", dtype=torch.int32)
        copy_pages(host, dev, check_idx, check_idx)
        torch.cuda.synchronize()
        out["page_gather_exact"] = bool(torch.equal(dev[:64].cpu(), host[:64]))
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the memcpy rows still stand
        out["page_gather_error"] = repr(exc)[:300]
    batch = args.batch  # contiguous runs of `batch` pages, one cudaMemcpyAsync each

    def runs(to_dev):
        for s in range(0, n, batch):
            if to_dev:
                dev[s : s + batch].copy_(host[n + s : n + s + batch], non_blocking=True)
            else:
                host[n + s : n + s + batch].copy_(dev[s : s + batch], non_blocking=True)

    out["page_runs_h2d_ms"] = g.median_ms(lambda: runs(True))
    out["page_runs_d2h_ms"] = g.median_ms(lambda: runs(False))
    cs_out = torch.empty(n, dtype=torch.int64, device="cuda")
    out["checksum_ms"] = g.median_ms(lambda: page_checksum(rows(dev[:n]), out=cs_out))
    out["checksum_gbps"] = n * PAGE_BYTES / out["checksum_ms"] / 1e6
    from dsv4_sm120.kernels import page_checksum as pc

    words = rows(dev[:n]).view(torch.int32)
    out["checksum_sweep"] = [
        {"block_words": blk, "num_warps": nw, "ms": g.median_ms(
            lambda blk=blk, nw=nw: pc._checksum_kernel[(n,)](words, cs_out, words.shape[1], words.stride(0),
                                                             BLOCK=blk, num_warps=nw))}
        for blk, nw in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8))
    ]
    h2d = min(out["page_runs_h2d_ms"], out.get("page_gather_h2d_ms", float("inf")))
    d2h = min(out["page_runs_d2h_ms"], out.get("page_gather_d2h_ms", float("inf")))
    out.update({
        "pinned_h2d_gbps": n * PAGE_BYTES / pin_h2d / 1e6,
        "pinned_d2h_gbps": n * PAGE_BYTES / pin_d2h / 1e6,
        "pages_h2d_gbps": n * PAGE_BYTES / h2d / 1e6,
        "pages_d2h_gbps": n * PAGE_BYTES / d2h / 1e6,
        "copy_fraction_h2d": pin_h2d / h2d,
        "copy_fraction_d2h": pin_d2h / d2h,
        "checksum_overhead": out["checksum_ms"] / min(h2d, d2h),
        "bw_pages": n,
    })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-ops", type=int, default=1_000_000, help="page operations (loads + back-ups) with the fence")
    ap.add_argument("--no-fence-iters", type=int, default=300)
    ap.add_argument("--dev-pages", type=int, default=8192)
    ap.add_argument("--host-pages", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=512, help="pages per transfer (8 MiB)")
    ap.add_argument("--integrity-pages", type=int, default=8192)
    ap.add_argument("--planted", type=int, default=1000)
    ap.add_argument("--bw-pages", type=int, default=8192)
    args = ap.parse_args()
    meta = g.run_meta()
    print(meta, flush=True)
    iters = -(-args.page_ops // (2 * args.batch)) + 1
    ops_fence, bad_fence = race(iters, True, args, seed=1)
    print(f"fence: {ops_fence} page ops, {bad_fence} mismatches", flush=True)
    ops_nofence, bad_nofence = race(args.no_fence_iters, False, args, seed=2)
    print(f"no fence: {ops_nofence} page ops, {bad_nofence} mismatches", flush=True)
    integ = integrity(args, seed=3)
    print("integrity", integ, flush=True)
    bw = bandwidth(args)
    print("bandwidth", bw, flush=True)
    result = {
        **meta,
        "page_ops": ops_fence,
        "mismatches_with_fence": bad_fence,
        "page_ops_without_fence": ops_nofence,
        "mismatches_without_fence": bad_nofence,
        "planted": integ["planted"],
        "caught": integ["caught"],
        "integrity": integ,
        "copy_fraction_h2d": bw["copy_fraction_h2d"],
        "copy_fraction_d2h": bw["copy_fraction_d2h"],
        "checksum_overhead": bw["checksum_overhead"],
        "bandwidth": bw,
        "config": vars(args),
    }
    date = datetime.date.today().isoformat()
    path = Path(os.environ.get("OUT_JSON", g.REPO / "bench" / "results" / "hicache" / f"hicache_race_h200_{date}.json"))
    run_record.write(path, result)
    print("SUMMARY page_ops %d mism(fence) %d mism(no fence) %d caught %d/%d copy h2d %.2f d2h %.2f cs_overhead %.4f"
          % (ops_fence, bad_fence, bad_nofence, integ["caught"], integ["planted"], bw["copy_fraction_h2d"],
             bw["copy_fraction_d2h"], bw["checksum_overhead"]))


if __name__ == "__main__":
    main()

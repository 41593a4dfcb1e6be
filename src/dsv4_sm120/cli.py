"""The ``dsv4-sm120`` command.

Each subcommand lives in the module that owns its fix and is imported only when
used, so ``dsv4-sm120 doctor`` does not pay for NIXL or gloo, and a broken area
cannot break the others' commands.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# name -> (module exposing add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("dsv4_sm120.cli", "say in one screen whether this install will work"),
    "abort-storm": ("dsv4_sm120.loopback.abort_storm", "abort storms over a real NIXL loopback PD pair: zero wedges, zero leaks"),
    "patch": ("dsv4_sm120.patching", "apply | check | revert the collective-guard diffs on the installed sglang"),
    "bench-serving": ("dsv4_sm120.instruments.serving", "live server: upstream serving bench at C=1 and C=64, JSON kept with flags and switches"),
    "storm-client": ("dsv4_sm120.instruments.storm_client", "live server: cancel N streaming sessions at once, time until a fresh request completes"),
    "agent-bench": ("dsv4_sm120.instruments.agent_bench", "live server: multi-turn agents returning to evicted histories, TTFT/ITL/throughput/cache hits per concurrency"),
    "toolcall-check": ("dsv4_sm120.instruments.toolcall_check", "live server: tool-call corruption rate (DSML markup in content) per concurrency"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``doctor``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--require-gpu", action="store_true", help="treat a missing CUDA device as a failure")
    parser.add_argument("--model-path", help="also say whether --model-impl dsv4 serves this checkpoint (dir or HF id)")
    parser.add_argument("--selftest", action="store_true",
                        help="only run each Triton kernel once on this GPU against its torch reference (no sglang needed)")


def run(args: argparse.Namespace) -> int:
    """``doctor``: exit 0 when the install is consistent (``--selftest``: when every kernel passes)."""
    if args.selftest:
        from dsv4_sm120.kernels import selftest

        return selftest.main(as_json=args.json, require_gpu=args.require_gpu)
    from dsv4_sm120 import doctor

    ok, sections = doctor.collect(require_gpu=args.require_gpu, model_path=args.model_path)
    if args.json:
        print(json.dumps(doctor.as_json(ok, sections), indent=2, default=str))
    else:
        print(doctor.render(ok, sections))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4-sm120", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        # Only the chosen subcommand's module is imported to build its arguments.
        if argv and argv[0] == name:
            importlib.import_module(module).add_arguments(sp)
    args = parser.parse_args(argv)
    return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    sys.exit(main())

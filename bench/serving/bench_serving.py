"""Checkout entry point for ``dsv4-sm120 bench-serving`` (same arguments; see --help).

Run from the repository root as ``python -m bench.serving.bench_serving --base-url ... --model ...``
or ``python bench/serving/bench_serving.py ...``. The code lives in
``dsv4_sm120.instruments.serving`` so an installed package has it too.
"""

import sys

from dsv4_sm120.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-serving", *sys.argv[1:]]))

"""Checkout entry point for ``dsv4-sm120 storm-client`` (same arguments; see --help).

Run from the repository root as ``python -m bench.serving.storm_client --base-url ... --model ...``
or ``python bench/serving/storm_client.py ...``. The code lives in
``dsv4_sm120.instruments.storm_client`` so an installed package has it too.
"""

import sys

from dsv4_sm120.cli import main

if __name__ == "__main__":
    sys.exit(main(["storm-client", *sys.argv[1:]]))

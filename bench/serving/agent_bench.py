"""Checkout entry point for ``dsv4-sm120 agent-bench`` (same arguments; see --help).

Run from the repository root as ``python -m bench.serving.agent_bench --base-url ... --model ...``
or ``python bench/serving/agent_bench.py ...``. The code lives in
``dsv4_sm120.instruments.agent_bench`` so an installed package has it too.
"""

import sys

from dsv4_sm120.cli import main

if __name__ == "__main__":
    sys.exit(main(["agent-bench", *sys.argv[1:]]))

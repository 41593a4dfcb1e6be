"""Checkout entry point for ``dsv4-sm120 toolcall-check`` (same arguments; see --help).

Run from the repository root as ``python -m bench.serving.toolcall_check --base-url ... --model ...``
or ``python bench/serving/toolcall_check.py ...``. The code lives in
``dsv4_sm120.instruments.toolcall_check`` so an installed package has it too.
"""

import sys

from dsv4_sm120.cli import main

if __name__ == "__main__":
    sys.exit(main(["toolcall-check", *sys.argv[1:]]))

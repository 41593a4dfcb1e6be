"""``python -m bench.gpu_server run SET``: serve and measure on a GPU host set up with ``python -m tools.airgap``.

``run`` owns its arguments (``bench/gpu_server/run.py``); the bundle those servers import is made and set up by
the air-gap tool (``tools/airgap``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["run"]:
        print("usage: python -m bench.gpu_server run SET ... (serve and measure; see run --help). The bundle's "
              "pack, unpack, rehearse and cache moved to: python -m tools.airgap", file=sys.stderr)
        return 2
    from bench.gpu_server import run

    return run.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())

"""The pin's pristine ``prefill.py`` / ``decode.py``, whatever the venv's sglang looks like.

CI (and a user following the README) may run ``dsv4-sm120 patch apply`` on the installed sglang
before the suite; the guard tests must still start from the files the diffs are written against.
The installed files are copied, and when the copy carries the patches it is reverted with the
package's own revert, which restores the original bytes exactly (``test_patching`` holds it to
that). A file that is neither pristine nor patched by these diffs (a local edit, another version,
an older revision of the diffs) is refused with what to do; it is never guessed at.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dsv4_sm120 import patching

DISAGG = "sglang/srt/disaggregation"
FILES = ("prefill.py", "decode.py")


def pristine_tree(dest: Path) -> Path:
    """Write the pristine pinned files under ``dest/sglang/srt/disaggregation``; returns ``dest``."""
    src = patching.installed_root() / DISAGG
    (dest / DISAGG).mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(src / name, dest / DISAGG / name)
    states = {fp.name: patching.state(dest, fp) for fp in patching.patches()}
    if set(states.values()) <= {patching.PRISTINE, patching.APPLIED}:
        patching.change(dest, reverse=True, explicit_root=True)
        return dest
    raise RuntimeError(
        f"the installed sglang's loop files ({src}) are neither the pristine pin nor patched by this "
        f"checkout's diffs: {states}. Run `dsv4-sm120 patch revert` with the dsv4-sm120 that applied "
        f"them, or reinstall the pin: pip install --force-reinstall --no-deps sglang=={patching.pin.SGLANG_PIN}"
    )


def patched_tree(dest: Path) -> Path:
    """``pristine_tree`` with this checkout's diffs applied."""
    pristine_tree(dest)
    patching.change(dest, reverse=False, explicit_root=True)
    return dest

"""dsv4-sm120 as users install it: the built wheel in a fresh environment, its CLI working from there.

The e2e environment (``environment.build``) is made exactly this way once per
session; this test checks what it recorded, and what the wheel does and does
not carry (the CPU test kit is test infrastructure and must never ship).
"""

from __future__ import annotations

import zipfile


def test_the_wheel_carries_the_patches_and_its_cli_applies_checks_and_reverts_them(e2e_env):
    with zipfile.ZipFile(e2e_env.wheel) as zf:
        names = zf.namelist()
    assert {"dsv4_sm120/patches/collective_guard_prefill.diff", "dsv4_sm120/patches/collective_guard_decode.diff"} <= set(names)
    assert not [n for n in names if "testkit" in n or n.startswith("common_ops") or n.startswith("tests/")], names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(e2e_env.wheel) as zf:
        assert "dsv4 = dsv4_sm120.plugin:register" in zf.read(entry_points).decode()
    steps = {(cmd, i): (rc, out) for i, (cmd, rc, out) in enumerate(e2e_env.steps)}
    ran = [cmd for cmd, _ in steps]
    assert ran == ["doctor", "patch apply", "patch check --require-applied", "patch revert",
                   "patch check --require-applied", "patch apply", "patch check --require-applied"], ran
    codes = [rc for rc, _ in steps.values()]
    assert codes == [0, 0, 0, 0, 1, 0, 0], codes
    outputs = [out for _, out in steps.values()]
    assert str(e2e_env.site_packages) in outputs[1]  # it patched the environment's own sglang, nothing else
    assert outputs[-1].count(": applied") == 2 and outputs[4].count("not applied") == 2, outputs

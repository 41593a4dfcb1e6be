"""The e2e suite's own Python environment: dsv4-sm120 installed from its built wheel, the way users install it.

Why not the test venv: there the package is an editable checkout, and the
overlap-loop patch would have to be applied to the venv's own sglang. Instead,
once per session, into a temporary folder:

1. the checkout is built into a wheel (``pip wheel``), and the wheel is checked
   to carry ``patches/*.diff``;
2. a virtual environment is made whose ``site-packages`` sees the test venv's
   packages through a ``.pth`` line (torch, NIXL, the router: nothing is
   reinstalled), with its own copy of the ``sglang`` package in front of them
   (files hard-linked where the filesystem allows; ``patch apply`` replaces the
   files it changes, so the test venv's sglang is never written);
3. the wheel and the CPU test kit the caller names (``tests/e2e/cpu_testkit``, test-only sglang
   plugin and ``common_ops``) are ``pip install``-ed into it;
4. ``dsv4-sm120 doctor`` and ``dsv4-sm120 patch apply`` / ``check`` / ``revert`` run
   from it, as a user runs them after ``pip install dsv4-sm120``; the servers then run
   the patched loops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class EnvironmentFailed(RuntimeError):
    """A setup step of the e2e environment failed; the message carries the command and its output."""


def _run(argv: list, cwd: Path | None = None, timeout: float = 600) -> str:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise EnvironmentFailed(f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


@dataclass(frozen=True)
class E2EEnv:
    root: Path
    python: Path
    bin: Path
    wheel: Path
    site_packages: Path
    steps: list = field(default_factory=list)  # (dsv4-sm120 command, exit status, stdout) run from the wheel

    @property
    def cli_argv(self) -> list[str]:
        """``dsv4-sm120``: the installed wheel's console script."""
        return [str(self.bin / "dsv4-sm120")]

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``dsv4-sm120 ARGS``, run to its end."""
        return subprocess.run([*self.cli_argv, *args], capture_output=True, text=True, timeout=timeout)


def _link_tree(src: Path, dst: Path) -> None:
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:  # another filesystem: a real copy
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def build(root: Path, testkit: Path) -> E2EEnv:
    """Build the wheel and the environment under ``root``, with the CPU test kit at ``testkit`` installed too;
    raise :class:`EnvironmentFailed` on any step."""
    root.mkdir(parents=True, exist_ok=True)
    # Built from a copy of what a source distribution holds, so no build/ folder of an earlier
    # build (setuptools keeps deleted modules there) can leak into the wheel, and the checkout is not written.
    src = root / "source"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src])
    wheel = next(dist.glob("dsv4_sm120-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        shipped = sorted(n for n in zf.namelist() if n.startswith("dsv4_sm120/patches/") and n.endswith(".diff"))
    if not shipped:
        raise EnvironmentFailed(f"{wheel.name} carries no dsv4_sm120/patches/*.diff: `dsv4-sm120 patch apply` cannot work from it")

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    base_site = Path(sysconfig.get_paths()["purelib"])
    (site / "zz_dsv4_e2e_test_venv.pth").write_text(f"{base_site}\n")
    _link_tree(base_site / "sglang", site / "sglang")

    pip = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--no-build-isolation",
           "--disable-pip-version-check", "--quiet"]
    _run(pip + [wheel])
    kit = root / "cpu_testkit"
    shutil.copytree(testkit, kit, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    _run(pip + [kit])
    env = E2EEnv(root=root, python=python, bin=venv / "bin", wheel=wheel, site_packages=site)

    where = _run([python, "-c", "import dsv4_sm120, sglang; print(dsv4_sm120.__file__); print(sglang.__file__)"]).split()
    if not where[0].startswith(str(site)) or not where[1].startswith(str(site)):
        raise EnvironmentFailed(f"the e2e environment imports {where}, not its own wheel and sglang copy under {site}")
    # As a user would after `pip install dsv4-sm120`: doctor, patch apply, check, revert, and apply again.
    for step, want in ((("doctor",), 0), (("patch", "apply"), 0), (("patch", "check", "--require-applied"), 0),
                       (("patch", "revert"), 0), (("patch", "check", "--require-applied"), 1), (("patch", "apply"), 0),
                       (("patch", "check", "--require-applied"), 0)):
        out = env.cli(*step)
        env.steps.append((" ".join(step), out.returncode, out.stdout))
        if out.returncode != want:
            raise EnvironmentFailed(f"dsv4-sm120 {' '.join(step)} from the wheel exited {out.returncode}, "
                                    f"not {want}:\n{out.stdout}\n{out.stderr}")
    return env

"""The rehearsal's import probe, run as a script by the bundle's interpreter with ``python -S``: only the
bundle's site and the image stand-in are on its path, not this checkout.

``python -S probe.py ARCH MODULE...`` imports torch, makes torch's device probes answer as one GPU of
sm_ARCH would (so that upstream's architecture switches take the branches the GPU host takes, e.g.
sgl_kernel loading ``sm90/common_ops``), imports each module, and prints one JSON line per module:
``ok``, ``device`` (an error about the missing GPU or driver: expected on a CPU host), ``missing``
(a module nobody carries) or ``error``. Then a line with the versions and the checks that need no
GPU: the NCCL that torch loaded, and the plugin's entry point. With ``--pd`` first among the modules
(a bundle packed ``--with-pd``), also a NIXL agent with its UCX backend on this host's memory, and the
PD router's ``--help``.
"""

import importlib
import json
import re
import subprocess
import sys
import traceback

_DEVICE = re.compile(r"cuda|nvidia|driver|gpu|libcuda|nvml|device|nccl", re.IGNORECASE)


def fake_device(torch, arch: int) -> None:
    class Properties:
        name = "rehearsal sm_%d" % arch
        major, minor = divmod(arch, 10)
        total_memory = 140 << 30
        multi_processor_count = 132

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: divmod(arch, 10)
    torch.cuda.get_device_name = lambda *a, **k: Properties.name
    torch.cuda.get_device_properties = lambda *a, **k: Properties()


def classify(error: BaseException) -> str:
    if isinstance(error, ModuleNotFoundError) and not _DEVICE.search(error.name or ""):
        return "missing"
    return "device" if _DEVICE.search(str(error)) else "error"


def probe(module: str) -> dict:
    try:
        importlib.import_module(module)
        return {"module": module, "status": "ok"}
    except BaseException as error:  # noqa: BLE001 - SystemExit and the like are findings too
        where = traceback.extract_tb(error.__traceback__)[-1]
        return {"module": module, "status": classify(error), "error": f"{type(error).__name__}: {error}"[:400],
                "at": f"{where.filename}:{where.lineno}"}


def checks() -> dict:
    import importlib.metadata as md

    found = {}
    for name in ("torch", "triton", "torchvision", "sglang", "sglang-kernel", "sgl-deep-gemm", "sgl-flash-mla",
                 "tilelang", "transformers", "dsv4-sm120"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    torch = sys.modules.get("torch")
    try:
        found["nccl_loaded"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:  # noqa: BLE001
        found["nccl_loaded"] = f"{type(error).__name__}: {error}"
    plugins = [ep.name for ep in md.entry_points(group="sglang.srt.plugins")]
    found["sglang_plugins"] = plugins
    return found


def pd_checks() -> dict:
    """What the PD pair needs to start, short of a GPU: a NIXL agent whose UCX backend comes up (on a CPU
    host with DRAM only; the memory kinds it lists say whether UCX found its CUDA modules), and the router."""
    found = {}
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("rehearsal", nixl_agent_config(backends=["UCX"]))
        found["nixl_backend_module"] = type(agent).__module__
        found["nixl_plugins"] = sorted(agent.get_plugin_list())
        found["nixl_ucx_mem_types"] = agent.get_plugin_mem_types("UCX")
        found["nixl_ucx_backend"] = "UCX" in agent.backends
    except Exception as error:  # noqa: BLE001 - the finding is the error
        found["nixl_error"] = f"{type(error).__name__}: {error}"[:400]
    router = subprocess.run([sys.executable, "-S", "-m", "sglang_router.launch_router", "--help"],
                            capture_output=True, text=True, timeout=120)
    lines = (router.stdout or router.stderr).splitlines()
    found["router_help"] = {"returncode": router.returncode, "lines": len(lines), "head": lines[:3],
                            "pd_flags": sorted({f for f in re.findall(r"--(?:pd-disaggregation|prefill|decode)\b",
                                                                    router.stdout)})}
    return found


def main(argv: list[str]) -> None:
    arch, modules = int(argv[0]), argv[1:]
    pd = modules[:1] == ["--pd"]
    modules = modules[1:] if pd else modules
    first = probe("torch")
    print(json.dumps(first), flush=True)
    if first["status"] == "ok":
        fake_device(sys.modules["torch"], arch)
    for module in modules:
        print(json.dumps(probe(module)), flush=True)
    found = checks()
    if pd:
        found["pd"] = pd_checks()
    print(json.dumps({"checks": found}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""``dsv4-sm120 doctor``: one screen that says whether this install will work.

Each check yields a :class:`~dsv4_sm120.doctor_rows.Section` of rows
(:mod:`dsv4_sm120.doctor_rows`).
No GPU is a ``warn`` unless ``--require-gpu`` asks for one.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata

from dsv4_sm120 import pin, settings
from dsv4_sm120.doctor_rows import FAIL, OK, WARN, Row, Section

# Sections contributed by fix areas: "module:function" returning a Section.
AREA_SECTIONS: tuple[str, ...] = (
    "dsv4_sm120.patching:doctor_section",
    "dsv4_sm120.index_k.report:doctor_section",
    "dsv4_sm120.nixl.report:doctor_section",
)

SUPPORTED_SM = {
    (9, 0): "sm_90 (Hopper): Triton bf16 indexer kernels; upstream DeepGEMM fp8 paths",
    (12, 0): "sm_120 (Blackwell RTX PRO): Triton bf16 indexer kernels; upstream's fp8 indexer runs TileLang there",
}


def _sglang() -> Section:
    version = pin.installed_sglang_version()
    problem = pin.pin_mismatch(version)
    return Section(
        "sglang",
        {"installed": version, "pin": pin.SGLANG_PIN, "matches": problem is None},
        [Row("sglang", OK if problem is None else FAIL, problem or f"{version} (the pin)")],
    )


def _plugin() -> Section:
    eps = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.value.startswith("dsv4_sm120.")]
    allowed_env = os.environ.get("SGLANG_PLUGINS", "")
    allowed = {x.strip() for x in allowed_env.split(",") if x.strip()}
    names = [ep.name for ep in eps]
    data = {"entry_points": [f"{ep.name} = {ep.value}" for ep in eps], "SGLANG_PLUGINS": allowed_env or None}
    if not eps:
        row = Row("plugin", FAIL, "no dsv4_sm120 entry point in group sglang.srt.plugins: reinstall with `pip install dsv4-sm120`")
    elif allowed and not allowed & set(names):
        row = Row("plugin", FAIL, f"SGLANG_PLUGINS={allowed_env!r} excludes {names[0]!r}: add it to the list or unset SGLANG_PLUGINS")
    else:
        row = Row("plugin", OK, f"entry point {data['entry_points'][0]}" + (", allowed by SGLANG_PLUGINS" if allowed else ""))
    data["loaded_by_sglang"] = row.status == OK
    return Section("plugin", data, [row])


def _manifest() -> Section:
    missing = {}
    for touch in pin.MANIFEST:
        error = pin.resolve(touch.target)
        if error is not None:
            missing[touch.target] = error
    total = len(pin.MANIFEST)
    rows = [Row("upstream symbols", OK if not missing else FAIL, f"{total - len(missing)}/{total} resolve on the installed sglang")]
    rows += [Row("  missing", FAIL, f"{target} ({err})") for target, err in missing.items()]
    return Section("manifest", {"symbols": total, "missing": missing}, rows)


def _settings() -> Section:
    values = settings.in_force()
    rows = [
        Row(env, FAIL if value.startswith("INVALID") else OK, value) for env, value in values.items()
    ]
    return Section("settings", values, rows)


def _torch_and_gpu(require_gpu: bool) -> list[Section]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    sw = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton_version}
    sw_rows = [Row("torch", OK, f"{torch.__version__} (CUDA {torch.version.cuda})"),
               Row("triton", OK if triton_version else WARN, triton_version or "not installed: the bf16 indexer kernels need Triton")]
    no_gpu = WARN if not require_gpu else FAIL
    if not torch.cuda.is_available():
        gpu = {"available": False, "name": None, "capability": None, "supported": False}
        gpu_rows = [Row("gpu", no_gpu, "no GPU: CPU-side checks only (fine for doctor, tests and abort-storm)")]
    else:
        major, minor = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        paths = SUPPORTED_SM.get((major, minor))
        gpu = {"available": True, "name": name, "capability": f"sm_{major}{minor}", "supported": paths is not None}
        detail = paths or (f"sm_{major}{minor} is not a supported target: the Triton bf16 indexer kernels are "
                           f"untested here and DeepGEMM/FlashMLA paths may be missing; supported: sm_90, sm_120")
        gpu_rows = [Row("gpu", OK if paths else WARN, f"{name}: {detail}")]
    return [Section("software", sw, sw_rows), Section("gpu", gpu, gpu_rows)]


def _nixl() -> Section:
    try:
        nixl = importlib.import_module("nixl")
    except ImportError as exc:
        return Section("nixl", {"importable": False, "error": str(exc)},
                       [Row("nixl", WARN, f"not importable ({exc}): needed only for PD disaggregation over NIXL")])
    try:
        version = metadata.version("nixl")
    except metadata.PackageNotFoundError:
        version = getattr(nixl, "__version__", "unknown")
    return Section("nixl", {"importable": True, "version": version}, [Row("nixl", OK, f"{version} importable")])


def model_section(model_path: str) -> Section:
    """``--model-path``: would ``--model-impl dsv4`` serve this checkpoint under the switches in force?

    The checkpoint's config is read by the pin's own ``ModelConfig``, as the server
    reads it, and judged by the same function the model-load hook refuses with.
    """
    from dsv4_sm120.model import v41
    from dsv4_sm120.model.resolve import checkpoint_refusal

    data: dict = {"path": model_path}
    try:
        dtype = settings.load().index_k_dtype
    except settings.SettingsError as exc:
        return Section("model", data, [Row("model", FAIL, f"cannot judge {model_path!r} until the switches are valid: {exc}")])
    try:
        from sglang.srt.configs.model_config import ModelConfig

        hf_config = ModelConfig(model_path, model_impl="dsv4").hf_config
    except Exception as exc:  # noqa: BLE001 - any failure to read the checkpoint is the answer
        return Section("model", data, [Row("model", FAIL, f"cannot read the config of {model_path!r} "
                                       f"({type(exc).__name__}: {exc}); pass a checkpoint directory holding a "
                                       f"config.json, or a Hugging Face model id")])
    refusal = checkpoint_refusal(hf_config, model_path, dtype)
    data.update(model_type=v41.model_type_of(hf_config), architectures=list(hf_config.architectures or []),
                index_k_dtype=dtype, served_by_model_impl_dsv4=refusal is None, refusal=refusal)
    if v41.is_deepseek_v41(hf_config):
        data["v41_pieces"] = [{"piece": p.name, "holds": p.holds, "evidence": p.evidence} for p in v41.PIECES]
    detail = refusal or (f"{data['model_type']} ({', '.join(data['architectures'])}): --model-impl dsv4 serves it "
                         f"with {dtype} index keys" + (", as upstream" if dtype == "fp8" else ""))
    return Section("model", data, [Row("model (--model-impl dsv4)", FAIL if refusal else OK, detail)])


def collect(require_gpu: bool = False, model_path: str | None = None) -> tuple[bool, list[Section]]:
    """Run every check; the bool says whether the install is consistent (and serves ``model_path``)."""
    sections = [_sglang(), _plugin()]
    if sections[0].data["matches"] or settings.in_force()[pin.PIN_OVERRIDE_ENV] == "1":
        sections.append(_manifest())
    sections += [_settings(), *_torch_and_gpu(require_gpu), _nixl()]
    for spec in AREA_SECTIONS:
        module, func = spec.split(":")
        sections.append(getattr(importlib.import_module(module), func)())
    if model_path is not None:
        sections.append(model_section(model_path))
    ok = all(row.status != FAIL for s in sections for row in s.rows)
    return ok, sections


def as_json(ok: bool, sections: list[Section]) -> dict:
    return {"ok": ok, **{s.key: s.data for s in sections}}


def render(ok: bool, sections: list[Section]) -> str:
    marks = {OK: "  ok ", WARN: " warn", FAIL: " FAIL"}
    width = max(len(r.name) for s in sections for r in s.rows)
    lines = ["dsv4-sm120 doctor"]
    for s in sections:
        lines += [f"{marks[r.status]}  {r.name.ljust(width)}  {r.detail}" for r in s.rows]
    lines.append("verdict: " + ("this install is consistent" if ok else "this install will NOT work as configured (see FAIL rows)"))
    return "\n".join(lines)

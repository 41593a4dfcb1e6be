"""Make ``--model-impl dsv4`` mean something.

Upstream declares ``--model-impl`` as a free string, so ``dsv4`` parses and then
silently behaves like ``sglang``. The AROUND hook on upstream's
``get_model_architecture`` returns the package's class for a DeepSeek-V4
checkpoint, refuses any other checkpoint with an error that names its
architecture, refuses a DeepSeek-V4.1 checkpoint while bf16 index keys are in
force (:mod:`.v41` says why), and leaves every other ``--model-impl`` value
untouched.
"""

from __future__ import annotations

from dsv4_sm120.settings import is_dsv4_impl

# The main model gets the package's class; the MTP draft keeps upstream's.
MAIN_ARCH = "DeepseekV4ForCausalLM"


class UnsupportedCheckpointError(ValueError):
    """--model-impl dsv4 was given a checkpoint it does not serve under the switches in force."""


def checkpoint_refusal(hf_config, model_path, index_k_dtype: str) -> str | None:
    """Why ``--model-impl dsv4`` refuses this checkpoint with these index keys, or None."""
    from sglang.srt.configs.model_config import is_deepseek_v4

    from dsv4_sm120.model import v41

    if not is_deepseek_v4(hf_config):
        archs = list(getattr(hf_config, "architectures", None) or [])
        return (
            f"--model-impl dsv4 serves DeepSeek-V4 checkpoints only (architectures "
            f"DeepseekV4ForCausalLM and its NextN draft), but {model_path!r} "
            f"declares architectures {archs or '(none)'}. Launch this checkpoint with "
            f"--model-impl sglang (or leave --model-impl unset)."
        )
    return v41.refusal(hf_config, model_path, index_k_dtype)


def resolve_model_architecture(original, model_config, *args, **kwargs):
    """AROUND hook for ``sglang.srt.model_loader.utils.get_model_architecture``."""
    if not is_dsv4_impl(model_config.model_impl):
        return original(model_config, *args, **kwargs)

    from sglang.srt.configs.model_config import ModelImpl

    from dsv4_sm120 import settings

    cfg = settings.load()  # a bad DSV4_SM120_* value stops a dsv4 launch here, with its message
    hf_config = model_config.hf_config
    message = checkpoint_refusal(hf_config, model_config.model_path, cfg.index_k_dtype)
    if message:
        raise UnsupportedCheckpointError(message)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs[0] != MAIN_ARCH:
        return original(model_config, *args, **kwargs)

    from dsv4_sm120.model.deepseek_v4 import DeepseekV4ForCausalLMSM120

    model_config._resolved_model_arch = MAIN_ARCH
    model_config._resolved_model_impl = ModelImpl.SGLANG
    return DeepseekV4ForCausalLMSM120, MAIN_ARCH

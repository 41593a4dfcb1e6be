"""The model class that ``--model-impl dsv4`` resolves to.

A subclass of upstream's ``DeepseekV4ForCausalLM`` so that everything upstream
keys on the checkpoint's architecture (``is_deepseek_v4``, the DSV4 KV pool and
planner, PD and HiCache wiring) still applies; the package's index-key changes
hang off this class and the pools built for it.
"""

from __future__ import annotations

from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM


class DeepseekV4ForCausalLMSM120(DeepseekV4ForCausalLM):
    """DeepSeek-V4 with the dsv4-sm120 indexer path (bf16 index keys when configured)."""

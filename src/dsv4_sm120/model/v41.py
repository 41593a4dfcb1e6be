"""DeepSeek-V4.1 checkpoints under ``--model-impl dsv4``: the per-piece verdict and the refusal.

The pin normalises a V4.1 checkpoint's ``DeepseekV41ForCausalLM`` to the
architecture ``DeepseekV4ForCausalLM`` and marks it with ``model_type
"deepseek_v41"`` (``configs/deepseek_v41.py``), so ``is_deepseek_v4`` holds and,
without this module, ``--model-impl dsv4`` would give V4.1 the package's class
with bf16 C4 keys, untested. V4.1 adds ratio-1/2 layers with their own fp4
indexers (``DeepseekV41Indexer``), V4.1-only KV layouts and V4.1-only forward
paths, while its C4 layers still build upstream's ``C4Indexer``, which the
package swaps to bf16.

A piece counts as holding only when a test shows it on V4.1's layouts or on the
model built from a V4.1 config (``tests/index_k/test_v41_*.py``). The bf16 C4
indexer inside a V4.1 forward cannot be shown on this project's machines, so
bf16 keys on a V4.1 checkpoint are refused at model load. With ``DSV4_SM120_INDEX_K_DTYPE=fp8`` the package is
upstream for V4.1 too (same model, pools, plan, PD layout and HiCache stack,
tested), so that route stays open.
"""

from __future__ import annotations

from dataclasses import dataclass

# Upstream keys V4.1 on ``hf_config.model_type == "deepseek_v41"``; its text-config
# class declares the ``_text`` variant.
V41_MODEL_TYPES = frozenset({"deepseek_v41", "deepseek_v41_text"})


@dataclass(frozen=True)
class Piece:
    """One part of the bf16 index-key path, judged on V4.1 checkpoints."""

    name: str
    holds: bool
    evidence: str


PIECES: tuple[Piece, ...] = (
    Piece("bf16 C4 index pool next to V4.1's fp4 ratio-1/2 index pools (V4 main KV layout)", True,
          "test_v41_layouts: C4 pool 16384 B rows, ratio-1/2 pools upstream's fp4 (68 B/slot, RNE)"),
    Piece("memory planner bytes per token", True,
          "test_v41_layouts: C4 indexer 256 B, low-ratio fp4 68 B; capacity and pool bytes equal the hand calculation"),
    Piece("PD layout tag and handshake", True,
          "test_v41_layouts: index_k:bf16 appended after c1/c2/c4/c128; bf16 vs fp8 refused"),
    Piece("HiCache strategy and host mirrors", True,
          "test_v41_layouts: bf16 strategy chosen; C4 mirror 16384 B page-aligned; c1/c2 mirrors upstream's "
          "(stack built; no copy run)"),
    Piece("integrity mode labels only bf16 C4 pages (CUDA layouts)", True,
          "test_v41_layouts: only the C4 buffers are checksummed; c1/c2 items are 17408/8704 B"),
    Piece("model class swaps C4 indexers only", True,
          "test_v41_model_build: upstream's __init__, no weights: C4Indexer becomes BF16C4Indexer; "
          "DeepseekV41Indexer and every parameter stay upstream's"),
    Piece("V4.1 KV layouts V41 / V41_NEW / V41_FP4", False,
          "upstream builds them only on SM100/SM103 or gfx950 GPUs, none of which is here"),
    Piece("PD integrity mode on HIP's split fp4 index pools", False,
          "a ratio-1 fp4 payload item is also 16384 B there (4 index pages of 4096 B per full page), "
          "and PD integrity picks bf16 index-K buffers by that item length"),
    Piece("bf16 C4 indexer inside a V4.1 forward", False,
          "V4.1-only backend paths: flashmla_mega, candidate blocks, DSpark, encoder replay; "
          "no V4.1 forward can run here"),
)


def model_type_of(hf_config) -> str:
    return str(getattr(hf_config, "model_type", None) or "")


def is_deepseek_v41(hf_config) -> bool:
    """True for a checkpoint the pin reads as DeepSeek-V4.1."""
    return model_type_of(hf_config) in V41_MODEL_TYPES


def refusal(hf_config, model_path, index_k_dtype: str) -> str | None:
    """Why ``--model-impl dsv4`` cannot serve this V4.1 checkpoint with these keys, or None."""
    if index_k_dtype != "bf16" or not is_deepseek_v41(hf_config):
        return None
    missing = "; ".join(f"{p.name} ({p.evidence})" for p in PIECES if not p.holds)
    return (
        f"--model-impl dsv4 does not serve DeepSeek-V4.1 checkpoints with bf16 index keys "
        f"(DSV4_SM120_INDEX_K_DTYPE=bf16, the default): {model_path!r} has model_type "
        f"{model_type_of(hf_config)!r}. Not supported for V4.1: {missing}. Launch it with "
        f"--model-impl sglang, or keep --model-impl dsv4 with DSV4_SM120_INDEX_K_DTYPE=fp8 "
        f"(upstream's fp8 index keys; the package then behaves as upstream)."
    )

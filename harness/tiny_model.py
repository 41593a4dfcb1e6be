"""A tiny dummy-weight Llama checkpoint for real sglang servers on CPU: config, tokenizer, chat template.

No model ships on this machine and nothing can be downloaded, so the e2e suite
writes one: a 2-layer Llama ``config.json`` (served with ``--load-format dummy``,
random weights) and a byte-level BPE tokenizer trained here, offline, on a few
lines of text. The model's output is noise; the servers, schedulers, KV pools,
NIXL transfers and router around it are the real ones, which is what the suite tests.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "prefill and decode servers exchange kv cache pages over nixl",
    "an agent with eighty sessions was killed in the middle of a run",
    "hello world, this is a tiny tokenizer for tests; 0123456789",
] * 50


def write_tiny_llama(dirpath: Path) -> Path:
    """Write config.json, tokenizer.json and tokenizer_config.json into ``dirpath``; return it."""
    dirpath.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (dirpath / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(dirpath, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    (dirpath / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return dirpath


def write_tokenizer(dirpath: Path, named: dict[str, str], more_special: tuple[str, ...] = ()) -> None:
    """tokenizer.json and tokenizer_config.json of a byte-level BPE of at most VOCAB ids trained on _CORPUS.

    ``named`` (``bos_token``: spelling, ...) then ``more_special`` are its special tokens, with the first ids
    in that order, so a model config can name them by id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    dirpath.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[*named.values(), *more_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(dirpath / "tokenizer.json"))
    (dirpath / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))

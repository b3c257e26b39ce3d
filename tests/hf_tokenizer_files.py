"""Hugging Face tokenizer.json files built locally, for the tokenizer tests of both tiers
(tests/unit/test_data_tokenizer.py, tests/integration/test_tokenizer_training.py)."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

SAMPLE_TEXTS = [
    "the thing is in the ring",
    "Héllo wörld! 🚀 ünïcode\n\n\tindented    spaces\r\nend",
    "",
    "<|begin_of_text|> special-token text is plain text <|eot_id|>",
    "numbers 1234567 and code: def f(x): return x ** 2\n",
]

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's: no BOS token
HF_VOCAB = 300  # 256 bytes, the special tokens and merges
HF_WORDS = ["token", "model", "train", "the", "data", "mesh", "shard", "loss", "step", "qwen"]


def train_hf_tokenizer(specials: list[str], vocab_size: int = HF_VOCAB) -> tokenizers.Tokenizer:
    """A tiny byte-level BPE (GPT-2/Qwen style) trained offline on a few KB of text."""
    text = [
        " ".join(HF_WORDS[(i * 7 + j * 3) % len(HF_WORDS)] for j in range(12)) for i in range(300)
    ]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text + SAMPLE_TEXTS, trainer)
    return tok


def save_hf(folder: Path, tok: tokenizers.Tokenizer, config: dict | None = None) -> Path:
    """Save `tok` as folder/tokenizer.json, with a tokenizer_config.json beside it if given."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def qwen_like_tokenizer(folder: Path) -> Path:
    """Qwen-style tokenizer.json: <|endoftext|> and chat tokens, no BOS, no config."""
    return save_hf(folder, train_hf_tokenizer(QWEN_SPECIALS))

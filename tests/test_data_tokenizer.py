"""Tokenizer tests: tiktoken (Llama 3 format) and sentencepiece files built locally."""

import base64
import io
from pathlib import Path

import pytest
import sentencepiece as spm

from data.tokenizer import (
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    llama3_special_tokens,
)

MERGES = [b"th", b"the", b" the", b"in", b"ing"]
SAMPLE_TEXTS = [
    "the thing is in the ring",
    "Héllo wörld! 🚀 ünïcode\n\n\tindented    spaces\r\nend",
    "",
    "<|begin_of_text|> special-token text is plain text <|eot_id|>",
    "numbers 1234567 and code: def f(x): return x ** 2\n",
]


def write_tiktoken_file(path: Path, merges: list[bytes]) -> Path:
    """Write a Llama 3 format BPE file: 256 byte-level ranks, then the given merges."""
    tokens = [bytes([b]) for b in range(256)] + merges
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiktoken_path(tmp_path_factory) -> Path:
    return write_tiktoken_file(tmp_path_factory.mktemp("tt") / "tokenizer.model", MERGES)


@pytest.fixture(scope="module")
def sentencepiece_path(tmp_path_factory) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "token", "model", "train", "the", "of", "data"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=300,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "sp.model"
    path.write_bytes(model.getvalue())
    return path


def test_llama3_special_tokens():
    tokens = llama3_special_tokens()
    assert len(tokens) == 256 == len(set(tokens))
    assert tokens[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert tokens[6:10] == [
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    assert tokens[-1] == "<|reserved_special_token_250|>"


def test_tiktoken_ids_bos_eos(tiktoken_path):
    tok = build_tokenizer(str(tiktoken_path))
    assert isinstance(tok, TiktokenTokenizer)
    num_base = 256 + len(MERGES)
    assert tok.vocab_size == num_base + 256
    assert (tok.bos_id, tok.eos_id) == (num_base, num_base + 1)
    # "the" is one merge; " thing" -> " ", "th", "ing"
    assert tok.encode("the thing", bos=False, eos=False) == [257, 32, 256, 260]
    assert tok.encode("the", bos=True, eos=True) == [tok.bos_id, 257, tok.eos_id]
    assert tok.encode("", bos=True, eos=False) == [tok.bos_id]
    # special-token strings in raw text are ordinary text, never control tokens
    ids = tok.encode("<|end_of_text|>", bos=False, eos=False)
    assert max(ids) < num_base
    assert tok.decode([tok.eos_id]) == "<|end_of_text|>"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_tiktoken_round_trip(tiktoken_path, text):
    tok = build_tokenizer(str(tiktoken_path))
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text


def test_tiktoken_long_runs_round_trip(tiktoken_path):
    tok = build_tokenizer(str(tiktoken_path))
    text = "a" * 30_000 + " " * 30_000 + "the end" + "b" * 420_000
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_sentencepiece_round_trip_and_ids(sentencepiece_path):
    tok = build_tokenizer(str(sentencepiece_path))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (300, 1, 2)
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == 1 and ids[-1] == 2
        assert tok.decode(ids[1:-1]) == text
    assert tok.encode("alpha beta", bos=False, eos=False)[0] not in (1, 2)
    batch = tok.encode_batch(SAMPLE_TEXTS, bos=True, eos=True)
    assert batch == [tok.encode(t, bos=True, eos=True) for t in SAMPLE_TEXTS]


def test_folder_with_tokenizer_model(tiktoken_path):
    tok = build_tokenizer(str(tiktoken_path.parent))
    assert tok.path == str(tiktoken_path)


def test_fingerprint_depends_on_file(tiktoken_path, sentencepiece_path, tmp_path):
    other = write_tiktoken_file(tmp_path / "other.model", MERGES[:2])
    prints = {
        build_tokenizer(str(p)).fingerprint for p in (tiktoken_path, sentencepiece_path, other)
    }
    assert len(prints) == 3
    assert (
        build_tokenizer(str(tiktoken_path)).fingerprint
        == build_tokenizer(str(tiktoken_path)).fingerprint
    )


def test_missing_file_error(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(ValueError, match="nope.model"):
        build_tokenizer(str(missing))


@pytest.mark.parametrize("content", [b"", b"\x00\x01\x02 not a model", b"hello world\nfoo bar\n"])
def test_unrecognised_file_error(tmp_path, content):
    path = tmp_path / "weird.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"weird\.bin.*neither"):
        build_tokenizer(str(path))


def test_bad_tiktoken_ranks_error(tmp_path):
    path = tmp_path / "gaps.model"
    path.write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match=r"gaps\.model.*ranks"):
        build_tokenizer(str(path))

"""Tokenizer tests: tiktoken (Llama 3 format), sentencepiece and Hugging Face tokenizer.json
files built locally."""

import base64
import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import tokenizers
from hf_tokenizer_files import (
    HF_VOCAB,
    QWEN_SPECIALS,
    SAMPLE_TEXTS,
    qwen_like_tokenizer,
    save_hf,
    train_hf_tokenizer,
)

from data.tokenizer import (
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    llama3_special_tokens,
)

MERGES = [b"th", b"the", b" the", b"in", b"ing"]


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
    with pytest.raises(ValueError, match=r"weird\.bin.*neither.*tokenizer\.json"):
        build_tokenizer(str(path))


def test_bad_tiktoken_ranks_error(tmp_path):
    path = tmp_path / "gaps.model"
    path.write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match=r"gaps\.model.*ranks"):
        build_tokenizer(str(path))


# --- Hugging Face tokenizer.json ---------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory) -> Path:
    """Qwen-style tokenizer.json: <|endoftext|> and chat tokens, no BOS, no config."""
    return qwen_like_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory) -> Path:
    """A tokenizer.json whose post-processor frames sequences as `<s> $A </s>` and that (like
    some downloads) enables truncation to 8 tokens."""
    tok = train_hf_tokenizer(["<unk>", "<s>", "</s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tok.enable_truncation(8)
    return save_hf(tmp_path_factory.mktemp("llama"), tok)


def test_hf_detected_from_file_and_folder(qwen_like):
    for path in (qwen_like, qwen_like.parent):
        tok = build_tokenizer(str(path))
        assert isinstance(tok, HuggingFaceTokenizer)
        assert tok.path == str(qwen_like)
        assert tok.decode(tok.encode("the mesh", bos=False, eos=False)) == "the mesh"


def test_folder_prefers_tokenizer_model_over_json(qwen_like, tmp_path):
    save_hf(tmp_path, train_hf_tokenizer(QWEN_SPECIALS))
    write_tiktoken_file(tmp_path / "tokenizer.model", MERGES)
    assert isinstance(build_tokenizer(str(tmp_path)), TiktokenTokenizer)


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_hf_round_trip(qwen_like, text):
    tok = build_tokenizer(str(qwen_like))
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
    assert tok.decode(ids[:-1]) == text
    assert tok.encode_batch([text], bos=True, eos=True) == [ids]


def test_hf_without_bos_frames_documents_by_eos_only(qwen_like):
    library = tokenizers.Tokenizer.from_file(str(qwen_like))
    tok = build_tokenizer(str(qwen_like))
    assert tok.bos_id is None
    assert tok.eos_id == library.token_to_id("<|endoftext|>")
    assert tok.vocab_size == library.get_vocab_size(with_added_tokens=True) == HF_VOCAB
    plain = tok.encode("the model", bos=False, eos=False)
    assert plain and max(plain) < tok.vocab_size
    assert tok.encode("the model", bos=True, eos=True) == plain + [tok.eos_id]
    assert tok.encode("", bos=True, eos=True) == [tok.eos_id]
    # special-token strings in the text are plain text, never control tokens
    ids = tok.encode("<|endoftext|><|im_end|>", bos=False, eos=False)
    assert len(ids) > 2 and not set(ids) & {library.token_to_id(t) for t in QWEN_SPECIALS}
    assert tok.decode(ids + [tok.eos_id]) == "<|endoftext|><|im_end|><|endoftext|>"


@pytest.mark.parametrize(
    ("config", "bos", "eos"),
    [
        ({"bos_token": None, "eos_token": "<|im_end|>"}, None, "<|endoftext|>"),  # Qwen3 chat
        ({"bos_token": None, "eos_token": "<|endoftext|>"}, None, "<|endoftext|>"),  # Qwen3 base
        (
            {"bos_token": "<|im_start|>", "eos_token": {"content": "<|endoftext|>"}},
            "<|im_start|>",
            "<|endoftext|>",
        ),
    ],
)
def test_hf_bos_eos_from_tokenizer_config(tmp_path, config, bos, eos):
    library = train_hf_tokenizer(QWEN_SPECIALS)
    tok = build_tokenizer(str(save_hf(tmp_path, library, config).parent))
    assert tok.bos_id == (None if bos is None else library.token_to_id(bos))
    assert tok.eos_id == library.token_to_id(eos)


def test_hf_post_processor_bos_eos_are_not_added_twice(llama_like):
    library = tokenizers.Tokenizer.from_file(str(llama_like))
    bos, eos = library.token_to_id("<s>"), library.token_to_id("</s>")
    tok = build_tokenizer(str(llama_like))
    assert (tok.bos_id, tok.eos_id) == (bos, eos)
    text = "the token model trains the mesh shard loss step by step"
    assert library.encode(text).ids[0] == bos  # the file itself would add <s> ... </s>
    for ids in (tok.encode(text, bos=True, eos=True), tok.encode_batch([text], True, True)[0]):
        assert ids[0] == bos and ids[-1] == eos
        assert ids.count(bos) == 1 and ids.count(eos) == 1
        assert len(ids) > 8 + 2  # the file's truncation to 8 tokens is not applied
        assert tok.decode(ids[1:-1]) == text
    assert bos not in tok.encode(text, bos=False, eos=False)


def test_hf_config_overrides_post_processor(tmp_path):
    library = train_hf_tokenizer(["<unk>", "<s>", "</s>"])
    library.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tok = build_tokenizer(str(save_hf(tmp_path, library, {"bos_token": None})))
    assert (tok.bos_id, tok.eos_id) == (None, 2)


def test_hf_encode_batch_uses_the_library_batch_encoder(qwen_like):
    tok = build_tokenizer(str(qwen_like))
    calls = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode_batch(self, texts, **kwargs):
            calls.append((list(texts), kwargs))
            return self.inner.encode_batch(texts, **kwargs)

    expected = [tok.encode(t, bos=True, eos=True) for t in SAMPLE_TEXTS]
    tok._tok = Spy(tok._tok)
    assert tok.encode_batch(SAMPLE_TEXTS, bos=True, eos=True) == expected
    assert calls == [(SAMPLE_TEXTS, {"add_special_tokens": False})]
    # one thread (a pre-tokenisation task's share of the cores): the same ids, on this thread
    assert tok.encode_batch(SAMPLE_TEXTS, bos=True, eos=True, threads=1) == expected
    assert len(calls) == 1


def test_hf_fingerprint(qwen_like, tiktoken_path, sentencepiece_path, tmp_path):
    first = build_tokenizer(str(qwen_like)).fingerprint
    assert build_tokenizer(str(qwen_like)).fingerprint == first
    assert first not in {
        build_tokenizer(str(p)).fingerprint for p in (tiktoken_path, sentencepiece_path)
    }
    copy = save_hf(tmp_path / "copy", tokenizers.Tokenizer.from_file(str(qwen_like)))
    assert build_tokenizer(str(copy)).fingerprint == first
    changed = save_hf(
        tmp_path / "changed", train_hf_tokenizer(QWEN_SPECIALS, vocab_size=HF_VOCAB - 10)
    )
    assert build_tokenizer(str(changed)).fingerprint != first
    # a tokenizer_config.json that changes the framing changes the token stream, so the print
    (copy.parent / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    assert build_tokenizer(str(copy)).fingerprint != first


@pytest.mark.parametrize(
    ("specials", "config", "match"),
    [
        (["<pad>"], None, "no end-of-document token"),
        (QWEN_SPECIALS, {"eos_token": "<|missing|>"}, "<|missing|>.*not in the vocabulary"),
    ],
)
def test_hf_bad_special_tokens(tmp_path, specials, config, match):
    path = save_hf(tmp_path, train_hf_tokenizer(specials), config)
    with pytest.raises(ValueError, match=match):
        build_tokenizer(str(path))


def test_json_that_is_not_a_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer(str(path))

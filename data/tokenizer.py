"""Tokenizers behind one interface: Llama 3 tiktoken BPE files and sentencepiece models."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm
import tiktoken

# Pre-tokenisation regex of Llama 3 (from its reference tokenizer).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_LLAMA3_SPECIAL_TOKENS = 256

# tiktoken's Rust core can overflow its stack on huge inputs or very long runs of (non-)whitespace,
# so, like Llama 3, long texts are encoded in pieces.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{_TIKTOKEN_MAX_RUN + 1}}}|\S{{{_TIKTOKEN_MAX_RUN + 1}}}")
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=*[ \t]+[0-9]+")


def llama3_special_tokens() -> list[str]:
    """Return the 256 Llama 3 special tokens in id order (appended after the base ranks)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, NUM_LLAMA3_SPECIAL_TOKENS - 5)]
    return named + reserved


class Tokenizer(ABC):
    """Text <-> token ids, with the BOS/EOS ids used to frame documents."""

    def __init__(self, path: str, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint  # sha256 of the model file; keys the token caches

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""

    @property
    @abstractmethod
    def bos_id(self) -> int:
        """Id prepended to a document when `bos=True`."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """Id appended to a document when `eos=True`."""

    @abstractmethod
    def _encode_plain(self, text: str) -> list[int]:
        """Encode text without BOS/EOS; special-token strings are treated as plain text."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text."""

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Encode text, optionally framed by BOS and EOS."""
        ids = self._encode_plain(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        """Encode several texts (subclasses may use a faster native batch path)."""
        return [self.encode(text, bos=bos, eos=eos) for text in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer(Tokenizer):
    """Llama 3 style BPE: tiktoken ranks from a file plus the 256 Llama 3 special tokens."""

    def __init__(self, path: str, ranks: dict[bytes, int], fingerprint: str) -> None:
        super().__init__(path, fingerprint)
        num_base = len(ranks)
        specials = {tok: num_base + i for i, tok in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(
            name=Path(path).name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._vocab_size = num_base + len(specials)
        self._bos_id = specials["<|begin_of_text|>"]
        self._eos_id = specials["<|end_of_text|>"]

    @property
    def vocab_size(self) -> int:
        """Base ranks + 256 special tokens."""
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        """Id of `<|begin_of_text|>`."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of `<|end_of_text|>`."""
        return self._eos_id

    def _encode_plain(self, text: str) -> list[int]:
        """Encode piecewise so tiktoken never sees an over-long input."""
        ids: list[int] = []
        for piece in _tiktoken_pieces(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids (invalid UTF-8 byte sequences become U+FFFD)."""
        return self._encoding.decode([int(i) for i in ids])


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (Llama 2 style); BOS/EOS ids come from the model."""

    def __init__(self, path: str, model_proto: bytes, fingerprint: str) -> None:
        super().__init__(path, fingerprint)
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
            raise ValueError(
                f"sentencepiece model {path!r} defines no BOS/EOS piece; "
                "train it with bos_id and eos_id >= 0"
            )

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model."""
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        """The model's BOS id."""
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        """The model's EOS id."""
        return self._sp.eos_id()

    def _encode_plain(self, text: str) -> list[int]:
        """Encode with the model (no sampling)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        """Encode several texts with sentencepiece's multi-threaded batch encoder."""
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids with the model."""
        return self._sp.decode([int(i) for i in ids])


def build_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer file, detecting tiktoken-BPE text vs sentencepiece protobuf by content.

    A folder holding a `tokenizer.model` (as in a Llama 3 download) is accepted too; '' is the
    bundled sample tokenizer (model.tokenizer_path's default), built on first use.
    """
    if not path:
        from data.sample_corpus import default_cache_dir, ensure_sample_tokenizer

        path = ensure_sample_tokenizer(default_cache_dir())
    file = Path(path)
    if file.is_dir() and (file / "tokenizer.model").is_file():
        file = file / "tokenizer.model"
    expected = "a Llama 3 tiktoken BPE file (lines 'base64 rank') or a sentencepiece .model"
    if not file.is_file():
        raise ValueError(
            f"tokenizer path {path!r} does not exist or is not a file; expected {expected}"
        )
    data = file.read_bytes()
    fingerprint = hashlib.sha256(data).hexdigest()
    ranks = _parse_tiktoken_ranks(data, str(file))
    if ranks is not None:
        return TiktokenTokenizer(str(file), ranks, fingerprint)
    if _is_sentencepiece(data):
        return SentencePieceTokenizer(str(file), data, fingerprint)
    raise ValueError(f"tokenizer file {str(file)!r} is neither {expected}")


def _parse_tiktoken_ranks(data: bytes, path: str) -> dict[bytes, int] | None:
    """Parse `base64(token) rank` lines; None if the data is not in that format."""
    lines = [line.strip() for line in data.splitlines() if line.strip()]
    if not lines or not all(_TIKTOKEN_LINE.fullmatch(line) for line in lines[:100]):
        return None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not _TIKTOKEN_LINE.fullmatch(line):
            raise ValueError(f"tiktoken file {path!r}: line {number} is not 'base64 rank'")
        token, rank = line.split()
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except binascii.Error as err:
            raise ValueError(f"tiktoken file {path!r}: bad base64 on line {number}") from err
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(
            f"tiktoken file {path!r}: ranks must be unique tokens numbered 0..{len(ranks) - 1}"
        )
    return ranks


def _is_sentencepiece(data: bytes) -> bool:
    """True if `data` is a loadable sentencepiece model with at least one piece."""
    if not data:
        return False
    try:
        sp = spm.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, OSError, TypeError):
        return False
    return sp.get_piece_size() > 0


def _tiktoken_pieces(text: str) -> Iterator[str]:
    """Split text into chunks of <= 400k chars without runs of > 25k (non-)whitespace chars."""
    for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
        chunk = text[start : start + _TIKTOKEN_MAX_CHARS]
        if _LONG_RUN.search(chunk) is None:
            yield chunk
        else:
            yield from _split_long_runs(chunk)


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut text so that no piece has more than _TIKTOKEN_MAX_RUN consecutive chars of one kind."""
    piece_start, run_length, run_is_space = 0, 0, False
    for i, char in enumerate(text):
        is_space = char.isspace()
        run_length = run_length + 1 if is_space == run_is_space else 1
        run_is_space = is_space
        if run_length > _TIKTOKEN_MAX_RUN:
            yield text[piece_start:i]
            piece_start, run_length = i, 1
    yield text[piece_start:]

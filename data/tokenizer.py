"""Tokenizers behind one interface: Llama 3 tiktoken BPE files, sentencepiece models and Hugging
Face `tokenizer.json` files."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm
import tiktoken
import tokenizers

logger = logging.getLogger("meshtrain")

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

# Hugging Face tokenizers: special tokens that end a document (GPT-2/Qwen, Llama 3, Llama 2 and
# Mistral, Gemma), in order of preference, and chat end-of-turn tokens that a chat model's
# tokenizer_config.json names as its eos_token (Qwen3's <|im_end|>, Llama 3 Instruct's
# <|eot_id|>, Gemma's <end_of_turn>) but that do not end a pre-training document.
_END_OF_DOCUMENT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")

_FORMATS = (
    "a Llama 3 tiktoken BPE file (lines 'base64 rank')",
    "a sentencepiece .model",
    "a Hugging Face tokenizer.json",
)


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
    """Text <-> token ids, with the BOS/EOS ids used to frame documents.

    Every tokenizer has an EOS; BOS may be None (a tokenizer without one, such as Qwen's), and
    then `bos=True` adds nothing.
    """

    def __init__(self, path: str, fingerprint: str) -> None:
        self.path = path
        # sha256 of the tokenizer file (and of whatever else changes its ids); keys the caches
        self.fingerprint = fingerprint

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None:
        """Id prepended to a document when `bos=True`; None if the tokenizer has no BOS."""

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
        return self._frame(self._encode_plain(text), bos, eos)

    def _frame(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        """`ids` preceded by BOS (if asked and there is one) and followed by EOS (if asked)."""
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def encode_batch(
        self, texts: Sequence[str], bos: bool, eos: bool, threads: int = 0
    ) -> list[list[int]]:
        """Encode several texts (subclasses may use a faster native batch path). `threads`:
        how many threads a native batch encoder may use (0: the library's default, usually
        every core; 1 in processes that already run one per core, which would otherwise
        oversubscribe the machine)."""
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

    def encode_batch(
        self, texts: Sequence[str], bos: bool, eos: bool, threads: int = 0
    ) -> list[list[int]]:
        """Encode several texts with sentencepiece's multi-threaded batch encoder."""
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos, num_threads=threads or -1)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids with the model."""
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (Qwen3, Llama 3 and Mistral downloads), via `tokenizers`.

    Encoding adds none of the file's own special tokens (its post-processor is skipped: the
    framework frames documents itself), ignores any truncation or padding the file configures
    and, like the other tokenizers, reads special-token strings in the text as plain text.

    BOS and EOS: a `tokenizer_config.json` beside the file decides when it names them
    (`bos_token`/`eos_token`, a string, an AddedToken dict or null); otherwise the token the
    post-processor puts before (BOS) and after (EOS) a sequence; otherwise, for EOS only, the
    first of `_END_OF_DOCUMENT` that is a special token. A tokenizer without a BOS (Qwen's) gets
    none: documents are then separated by EOS alone, `tokens + [EOS]`, as its family was
    pre-trained (prepending EOS or some other token would be invented framing); nothing in the
    pipeline needs a BOS. EOS ends a pre-training document, not a chat turn: a configured
    end-of-turn token (`_END_OF_TURN`, e.g. Qwen3's `<|im_end|>`) gives way to an
    end-of-document special token of the vocabulary (`<|endoftext|>`) when there is one. A
    tokenizer with no EOS at all is refused. The chosen ids are logged and, since they change
    the token stream, are part of the fingerprint along with the file's bytes.
    """

    def __init__(self, path: str, data: bytes, config: dict) -> None:
        try:
            self._tok = tokenizers.Tokenizer.from_buffer(data)
        except Exception as err:  # the library raises plain Exceptions on malformed files
            raise ValueError(
                f"tokenizer file {path!r} is JSON but not a Hugging Face tokenizer.json: {err}"
            ) from err
        self._tok.no_truncation()
        self._tok.no_padding()
        before, after = self._post_processor_framing()
        self._bos_id = (
            self._configured(config, "bos_token", path) if "bos_token" in config else before
        )
        eos = self._configured(config, "eos_token", path) if "eos_token" in config else after
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        document_end = next(
            (self._tok.token_to_id(t) for t in _END_OF_DOCUMENT if t in specials), None
        )
        if eos is None or (self._tok.id_to_token(eos) in _END_OF_TURN and document_end is not None):
            eos = document_end
        if eos is None:
            raise ValueError(
                f"tokenizer {path!r} names no end-of-document token: no eos_token in a "
                "tokenizer_config.json beside it, none appended by its post-processor and none "
                f"of {', '.join(_END_OF_DOCUMENT)} among its special tokens; add a "
                'tokenizer_config.json with "eos_token"'
            )
        self._eos_id = eos
        self._tok.encode_special_tokens = True  # special-token strings in text are plain text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(
            self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1
        )
        digest = hashlib.sha256(data)
        digest.update(f"\nbos={self._bos_id} eos={self._eos_id}".encode())
        super().__init__(path, digest.hexdigest())
        logger.info(
            "tokenizer %s: %d tokens, BOS %s, EOS %r (id %d)",
            path,
            self._vocab_size,
            "none" if self._bos_id is None else f"{self._tok.id_to_token(self._bos_id)!r}",
            self._tok.id_to_token(self._eos_id),
            self._eos_id,
        )

    def _post_processor_framing(self) -> tuple[int | None, int | None]:
        """The single ids the post-processor puts before and after a sequence (None if not)."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        framed = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(framed) - len(plain) + 1):
            if plain and framed[start : start + len(plain)] == plain:
                before, after = framed[:start], framed[start + len(plain) :]
                return (
                    before[0] if len(before) == 1 else None,
                    after[0] if len(after) == 1 else None,
                )
        return None, None

    def _configured(self, config: dict, key: str, path: str) -> int | None:
        """Id of tokenizer_config.json's `key` token (None when it is null)."""
        token = config[key]
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            return None
        token_id = self._tok.token_to_id(str(token))
        if token_id is None:
            raise ValueError(
                f"tokenizer_config.json beside {path!r}: {key} {token!r} is not in the vocabulary"
            )
        return token_id

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (base vocabulary and added tokens)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        """The configured or post-processor BOS id; None if the tokenizer has none."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """The end-of-document id (see the class docstring)."""
        return self._eos_id

    def _encode_plain(self, text: str) -> list[int]:
        """Encode without the post-processor's special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(
        self, texts: Sequence[str], bos: bool, eos: bool, threads: int = 0
    ) -> list[list[int]]:
        """Encode several texts with the library's parallel batch encoder (its thread pool is
        process-wide: with threads = 1 each text is encoded on the calling thread)."""
        if threads == 1:
            return [self._frame(self._tok.encode(t, add_special_tokens=False).ids, bos, eos)
                    for t in texts]  # fmt: skip
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [self._frame(e.ids, bos, eos) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids, special tokens included."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer file, detecting Hugging Face JSON, tiktoken-BPE text or sentencepiece
    protobuf by content.

    A folder holding a `tokenizer.model` (as in a Llama 3 download) or else a `tokenizer.json`
    (a Hugging Face model folder) is accepted too; '' is the bundled sample tokenizer
    (model.tokenizer_path's default), built on first use.
    """
    if not path:
        from data.sample_corpus import default_cache_dir, ensure_sample_tokenizer

        path = ensure_sample_tokenizer(default_cache_dir())
    file = Path(path)
    if file.is_dir():
        file = next(
            (file / n for n in ("tokenizer.model", "tokenizer.json") if (file / n).is_file()), file
        )
    kinds = ", ".join(_FORMATS[:-1])
    if not file.is_file():
        raise ValueError(
            f"tokenizer path {path!r} does not exist or is not a file; "
            f"expected {kinds} or {_FORMATS[-1]}"
        )
    data = file.read_bytes()
    if data.lstrip()[:1] == b"{":
        return HuggingFaceTokenizer(str(file), data, _tokenizer_config(file))
    fingerprint = hashlib.sha256(data).hexdigest()
    ranks = _parse_tiktoken_ranks(data, str(file))
    if ranks is not None:
        return TiktokenTokenizer(str(file), ranks, fingerprint)
    if _is_sentencepiece(data):
        return SentencePieceTokenizer(str(file), data, fingerprint)
    raise ValueError(f"tokenizer file {str(file)!r} is neither {kinds} nor {_FORMATS[-1]}")


def _tokenizer_config(file: Path) -> dict:
    """The `tokenizer_config.json` beside a tokenizer.json ({} if there is none)."""
    config_file = file.parent / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(config_file)!r} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{str(config_file)!r} is not a JSON object")
    return config


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

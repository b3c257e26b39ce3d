"""Bundled sample corpus and tokenizer: deterministic, split ~99/1 (concurrent builders:
tests/integration/test_data_corpus_concurrency.py)."""

import json
from pathlib import Path

import pytest

from data.sample_corpus import (
    SAMPLE_TOKENIZER_VOCAB_SIZE,
    default_cache_dir,
    ensure_sample_corpus,
    ensure_sample_tokenizer,
)
from data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MESHTRAIN_CACHE", raising=False)
    assert Path(default_cache_dir()) == REPO / ".cache"
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)


def test_corpus_split_and_content(cache):
    train_path, val_path = ensure_sample_corpus(str(cache))
    train, val = read_records(train_path), read_records(val_path)
    assert len(train) > 100 and len(val) >= 2
    train_chars = sum(len(r["text"]) for r in train)
    val_chars = sum(len(r["text"]) for r in val)
    assert 2_000_000 < train_chars + val_chars < 20_000_000
    assert 0.005 < val_chars / (train_chars + val_chars) < 0.02
    sources = [r["source"] for r in train + val]
    assert len(set(sources)) == len(sources)  # every document lands in exactly one split
    assert any(s.startswith("pydoc_topics/") for s in sources)
    assert any(s.startswith("stdlib/") for s in sources)
    assert not any("/test/" in s or "site-packages" in s for s in sources)


def test_corpus_is_cached_and_deterministic(cache, tmp_path):
    first = ensure_sample_corpus(str(cache))
    mtimes = [Path(p).stat().st_mtime_ns for p in first]
    assert ensure_sample_corpus(str(cache)) == first
    assert [Path(p).stat().st_mtime_ns for p in first] == mtimes  # not rebuilt
    fresh = ensure_sample_corpus(str(tmp_path))
    for a, b in zip(first, fresh):
        assert Path(a).read_bytes() == Path(b).read_bytes()


def test_sample_tokenizer(cache):
    path = ensure_sample_tokenizer(str(cache))
    tok = build_tokenizer(path)
    assert tok.vocab_size == SAMPLE_TOKENIZER_VOCAB_SIZE
    assert 2000 <= SAMPLE_TOKENIZER_VOCAB_SIZE <= 8000
    _, val_path = ensure_sample_corpus(str(cache))
    text = read_records(val_path)[0]["text"]
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text
    assert len(ids) < len(text) / 2  # it actually learned merges

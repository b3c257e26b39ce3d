"""Bundled sample corpus and tokenizer: deterministic, split ~99/1, safe under concurrency."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data.sample_corpus import (
    SAMPLE_TOKENIZER_VOCAB_SIZE,
    default_cache_dir,
    ensure_sample_corpus,
    ensure_sample_tokenizer,
)
from data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parent.parent


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


def test_concurrent_builders_agree(cache, tmp_path):
    """Four processes racing on an empty cache all get the same complete files."""
    code = (
        "import sys; from data.sample_corpus import ensure_sample_corpus, ensure_sample_tokenizer;"
        "print(*ensure_sample_corpus(sys.argv[1]), ensure_sample_tokenizer(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(out == outputs[0] for out in outputs)
    reference = [*ensure_sample_corpus(str(cache)), ensure_sample_tokenizer(str(cache))]
    for built, ref in zip(outputs[0], reference):
        assert Path(built).read_bytes() == Path(ref).read_bytes()
    leftovers = [p.name for p in Path(outputs[0][0]).parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []

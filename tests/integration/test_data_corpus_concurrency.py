"""The sample corpus and tokenizer built by several processes at once."""

import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import ROOT

from data.sample_corpus import (
    ensure_sample_corpus,
    ensure_sample_tokenizer,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_concurrent_builders_agree(cache, tmp_path):
    """Four processes racing on an empty cache all get the same complete files."""
    code = (
        "import sys; from data.sample_corpus import ensure_sample_corpus, ensure_sample_tokenizer;"
        "print(*ensure_sample_corpus(sys.argv[1]), ensure_sample_tokenizer(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
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

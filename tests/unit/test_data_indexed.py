"""Pre-tokenised Megatron indexed corpora (.bin/.idx) and document boundaries from the index.

The corpora here are written by `tests/megatron_files.py`, a writer of the tests' own that
follows the published layout, not by `data.indexed`, so a misreading of the format cannot cancel
itself out."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_files import documents, write_megatron
from test_data_loader import byte_tokenizer, rows, take
from test_data_loader import loader as base_loader

from data.indexed import TokenStream, open_indexed, resolve_prefixes
from data.tokenizer import Tokenizer
from job_config import parse_args
from job_config.loader import ConfigError
from training.inputs import SequenceSplit, sequence_inputs
from training.preflight import check_data_files
from training.trainer import build_loaders

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SEQ_LEN = 8
DOCS_A, DOCS_B = documents(30, 1), documents(25, 2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder of two indexed datasets (`a`: one sequence per document; `b`: documents split
    into sentences, uint16)."""
    folder = tmp_path_factory.mktemp("megatron")
    write_megatron(folder / "a", DOCS_A)
    write_megatron(folder / "b", DOCS_B, sentences=True)
    return folder


def loader(tokenizer, path, **kwargs):
    """A megatron loader of the corpus at `path` (kwargs: test_data_loader's `loader`)."""
    kwargs.setdefault("dataset", "megatron")
    return base_loader(tokenizer, kwargs.pop("cache_dir", None), path, **kwargs)


def expected_documents(docs: list[list[int]], count: int) -> list[list[int]]:
    """Each input token's document index within its window, for the first `count` windows."""
    owner = [d for d, doc in enumerate(docs) for _ in doc]
    out = []
    for i in range(count):
        window = owner[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN]
        out.append([w - window[0] for w in window])
    return out


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_reader_follows_the_published_layout(tmp_path, dtype):
    docs = documents(12, 3, vocab=250)
    write_megatron(tmp_path / "c", docs, dtype=dtype, sentences=True, modes=True)
    file = open_indexed(str(tmp_path / "c"))
    assert file.tokens.dtype == np.dtype(dtype)
    assert file.tokens.tolist() == [t for d in docs for t in d]
    assert file.doc_starts.tolist() == np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist()
    assert isinstance(file.tokens, np.memmap)  # read by memory map, not into memory


def test_many_files_are_one_stream_across_file_ends(corpus, tokenizer):
    """Windows that straddle the end of `a` and the start of `b` hold both files' tokens, and
    the document indices count documents from the index (no end-of-document tokens exist)."""
    docs = DOCS_A + DOCS_B
    stream = [t for d in docs for t in d]
    count = (len(stream) - 1) // SEQ_LEN
    got = take(loader(tokenizer, corpus, batch=count, documents=True), 1)[0]
    assert rows(got) == [stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(count)]
    assert got[2].tolist() == expected_documents(docs, count)
    assert got[2].dtype == torch.int32


def test_prefix_forms(corpus):
    a, b = str(corpus / "a"), str(corpus / "b")
    assert resolve_prefixes(str(corpus)) == [a, b]
    assert resolve_prefixes(f"{corpus}/*") == [a, b]
    assert resolve_prefixes(f"{b}.idx, {a}") == [b, a]  # the order given
    assert resolve_prefixes(f"{a}.bin") == [a]
    with pytest.raises(ValueError, match="names no Megatron indexed dataset"):
        resolve_prefixes(str(corpus / "missing"))


@pytest.mark.parametrize("dp", [2, 4])
def test_layout_independent_and_resumes_at_other_dp(corpus, tokenizer, dp):
    """Rank r of dp holds rows r::dp of the dp=1 global batch, with their document indices,
    across an epoch wrap; a state saved at dp resumes at dp=1 at the same global batch."""
    steps = 6  # the corpus holds ~38 windows: 6 x 8 crosses the epoch end
    reference = take(loader(tokenizer, corpus, batch=8, documents=True), steps)
    ranks = [
        loader(tokenizer, corpus, batch=8 // dp, rank=r, dp=dp, documents=True) for r in range(dp)
    ]
    per_rank = [take(data, steps - 2) for data in ranks]
    for step in range(steps - 2):
        for r in range(dp):
            want = reference[step]
            got = per_rank[r][step]
            assert rows(got) == rows(want)[r::dp]
            assert torch.equal(got[2], want[2][r::dp])
    resumed = loader(tokenizer, corpus, batch=8, documents=True)
    resumed.load_state_dict({f"dp_rank_{r}": d.state_dict() for r, d in enumerate(ranks)})
    for want, got in zip(reference[steps - 2 :], take(resumed, 2)):
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def _eos_scan(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The test's oracle: a document ends with its end token, the next token starts the next."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends


def test_index_boundaries_equal_the_end_of_document_scan(tokenizer, tmp_path):
    """For a corpus tokenised on first use (the cache, now an indexed dataset) and for a
    stream, the loader's document indices are what scanning for EOS gives: the index carries
    the same boundaries, and document masking hands them to the model unchanged."""
    docs = [f"doc {i} " + "ab" * (i % 7) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "train.jsonl").write_text((tmp_path / "d.jsonl").read_text())
    for dataset, path in [("jsonl", tmp_path / "d.jsonl"), ("huggingface", tmp_path / "hf")]:
        data = loader(
            tokenizer, path, dataset=dataset, batch=6, cache_dir=str(tmp_path), documents=True
        )
        for inputs, labels, docs_ids in take(data, 3):
            assert torch.equal(docs_ids, _eos_scan(inputs, tokenizer.eos_id))
            split = SequenceSplit(document_mask=True)
            _, _, kwargs = sequence_inputs(split, inputs, labels, docs_ids)
            assert torch.equal(kwargs["documents"], docs_ids)
    (idx,) = (tmp_path / "tokens").glob("*.idx")  # the cache is an indexed dataset itself
    cached = open_indexed(str(idx.with_suffix("")))
    assert len(cached.doc_starts) == len(docs)
    assert cached.tokens[cached.doc_starts].tolist() == [tokenizer.bos_id] * len(docs)


def test_sequence_inputs_take_the_given_boundaries_under_cp():
    """The loader's boundaries are the documents: a sequence without any EOS still splits
    into its documents, for the queries and the gathered keys of every CP rank."""
    tokens = torch.arange(16).reshape(1, 16)
    given = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4], dtype=torch.int32)
    for r in range(2):
        _, _, kw = sequence_inputs(SequenceSplit(r, 2, document_mask=True), tokens, tokens, given)
        assert torch.equal(kw["documents"], given[:, kw["positions"][0]])
        assert torch.equal(kw["key_documents"], given[:, kw["key_positions"][0]])


def test_refused_corpora(tmp_path, tokenizer):
    write_megatron(tmp_path / "ok", [[1, 2, 3], [4, 5]])
    idx = (tmp_path / "ok.idx").read_bytes()
    (tmp_path / "magic.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    (tmp_path / "magic.idx").write_bytes(b"XXXXXXXXX" + idx[9:])
    with pytest.raises(ValueError, match="not a Megatron indexed-dataset index"):
        open_indexed(str(tmp_path / "magic"))
    (tmp_path / "short.idx").write_bytes(idx)
    (tmp_path / "short.bin").write_bytes((tmp_path / "ok.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="its index describes 5 tokens"):
        open_indexed(str(tmp_path / "short"))
    # sequence pointers out of order: the second sequence stored before the first
    (tmp_path / "order.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    head = 9 + 8 + 1 + 8 + 8
    swapped = idx[: head + 8] + struct.pack("<2q", 4, 0) + idx[head + 24 :]
    (tmp_path / "order.idx").write_bytes(swapped)
    with pytest.raises(ValueError, match="not stored back to back"):
        open_indexed(str(tmp_path / "order"))
    # ids the run's tokenizer does not have (its vocabulary is 512 ids)
    write_megatron(tmp_path / "big", [[1, 600, 3] * 10], dtype=np.int32)
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        next(iter(loader(tokenizer, tmp_path / "big", batch=1)))
    # a recorded tokenizer fingerprint that is not the run's
    (tmp_path / "ok.meta.json").write_text(json.dumps({"tokenizer": "f" * 64}))
    with pytest.raises(ValueError, match="was tokenised with tokenizer ffff"):
        loader(tokenizer, tmp_path / "ok")


def test_token_stream_slices_any_range():
    parts = [np.arange(0, 5), np.arange(0), np.arange(5, 9), np.arange(9, 20)]
    stream = TokenStream(
        parts, [np.array([0, 3]), np.zeros(0, np.int64), np.array([0]), np.array([2])]
    )
    assert len(stream) == 20 and stream.doc_starts.tolist() == [0, 3, 5, 11]
    for start in range(20):
        for stop in range(start + 1, 21):
            assert stream.slice(start, stop).tolist() == list(range(start, stop))
    assert stream.starts_within(3, 11).tolist() == [2]  # 3 and 11 themselves are not inside


def test_config_reads_megatron_and_infers_it_from_the_suffix(corpus, tokenizer, tmp_path):
    """`training.dataset = megatron` reaches the loader the trainer builds; a .idx path alone
    selects it; a path naming no corpus is refused before any process group."""
    base = ["--model.tokenizer_path", tokenizer.path, "--training.seq_len", str(SEQ_LEN),
            "--training.local_batch_size", "2", "--training.shuffle", "false",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    stream = [t for d in DOCS_A + DOCS_B for t in d]
    for extra in (["--training.dataset", "megatron", "--training.dataset_path", str(corpus)],
                  ["--training.dataset_path", f"{corpus}/a.idx"]):  # fmt: skip
        cfg = parse_args(base + extra)
        assert cfg.training.dataset == "megatron"
        train, _ = build_loaders(cfg, tokenizer, 0, 1)
        assert rows(next(iter(train)))[0] == stream[: SEQ_LEN + 1]
    cfg = parse_args(base + ["--training.dataset", "megatron", "--training.dataset_path", "/no"])
    with pytest.raises(ConfigError, match="names no Megatron indexed dataset"):
        check_data_files(cfg)
    with pytest.raises(ConfigError, match="local files have no held-out split"):
        parse_args(
            base + ["--training.dataset_path", f"{corpus}/a.idx", "--validation.enable", "true"]
        )


def test_empty_documents_have_no_boundary_of_their_own(tmp_path):
    write_megatron(tmp_path / "e", [[1, 2], [], [3], [], [], [4, 5]], sentences=True)
    file = open_indexed(str(tmp_path / "e"))
    assert file.tokens.tolist() == [1, 2, 3, 4, 5] and file.doc_starts.tolist() == [0, 2, 3]

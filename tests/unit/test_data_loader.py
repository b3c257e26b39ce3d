"""Loader tests: stream definition, DP invariance, exact resume, epochs, sources and errors."""

import base64
import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.dataloader import SUPPORTED_DATASETS, build_dataloader
from data.dataset import ShardedReader
from data.sample_corpus import ensure_sample_tokenizer
from data.sources import _split_config
from data.tokenizer import Tokenizer, build_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SEQ_LEN = 8
DOCS = [f"doc {i}: " + "xyz" * (i % 5) + "!" * (i % 3) for i in range(24)]


def byte_tokenizer(folder: Path) -> Tokenizer:
    """Byte-level Llama 3 format tokenizer: ids are UTF-8 bytes, BOS=256, EOS=257."""
    path = folder / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return build_tokenizer(str(path))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def jsonl_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def expected_sequences(docs: list[str], seq_len: int = SEQ_LEN) -> list[list[int]]:
    """The documented global stream for the byte-level tokenizer, one epoch."""
    stream = [t for d in docs if d for t in [256, *d.encode(), 257]]
    count = (len(stream) - 1) // seq_len
    return [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)]


def loader(tokenizer, cache, path, *, dataset="jsonl", batch=4, rank=0, dp=1, **kwargs):
    return build_dataloader(
        dataset=dataset,
        dataset_path=str(path),
        tokenizer=tokenizer,
        seq_len=kwargs.pop("seq_len", SEQ_LEN),
        local_batch_size=batch,
        dp_rank=rank,
        dp_degree=dp,
        cache_dir=cache,
        **kwargs,
    )


def rows(batch) -> list[list[int]]:
    """Full sequences (inputs + last label) of a batch, as lists."""
    inputs, labels = batch[:2]
    return torch.cat([inputs, labels[:, -1:]], dim=1).tolist()


def take(data, steps: int) -> list:
    iterator = iter(data)
    return [next(iterator) for _ in range(steps)]


def test_supported_datasets():
    assert SUPPORTED_DATASETS == ("sample", "text", "jsonl", "parquet", "huggingface", "megatron")


def test_shapes_shift_and_stream(tokenizer, cache, jsonl_file):
    batches = take(loader(tokenizer, cache, jsonl_file, batch=3), 4)
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (3, SEQ_LEN)
        assert inputs.dtype == labels.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    seen = [row for b in batches for row in rows(b)]
    assert seen == expected_sequences(DOCS)[:12]
    assert seen[0][0] == tokenizer.bos_id
    # consecutive sequences overlap by exactly one token
    assert all(a[-1] == b[0] for a, b in zip(seen, seen[1:]))


def test_eos_between_documents(tokenizer, cache, jsonl_file):
    data = loader(tokenizer, cache, jsonl_file, batch=1, infinite=False)
    stream = [t for inputs, _ in data for t in inputs[0].tolist()]
    eos_positions = [i for i, t in enumerate(stream) if t == tokenizer.eos_id]
    assert all(stream[i + 1] == tokenizer.bos_id for i in eos_positions if i + 1 < len(stream))
    assert len(eos_positions) in (len(DOCS) - 1, len(DOCS))


@pytest.mark.parametrize("dp", [2, 4])
def test_rank_slices_partition_global_batch(tokenizer, cache, jsonl_file, dp):
    global_batch = 8
    steps = len(expected_sequences(DOCS)) // global_batch + 2  # crosses an epoch wrap
    reference = [
        rows(b) for b in take(loader(tokenizer, cache, jsonl_file, batch=global_batch), steps)
    ]
    per_rank = [
        [
            rows(b)
            for b in take(
                loader(tokenizer, cache, jsonl_file, batch=global_batch // dp, rank=r, dp=dp), steps
            )
        ]
        for r in range(dp)
    ]
    for step in range(steps):
        for r in range(dp):
            assert per_rank[r][step] == reference[step][r::dp]  # rank r takes j*dp + r


def test_exact_resume_in_fresh_loader(tokenizer, cache, jsonl_file):
    uninterrupted = take(loader(tokenizer, cache, jsonl_file, batch=2), 10)
    first = loader(tokenizer, cache, jsonl_file, batch=2)
    take(first, 6)
    state = json.loads(json.dumps(first.state_dict()))  # plain, serialisable
    resumed = loader(tokenizer, cache, jsonl_file, batch=2)
    resumed.load_state_dict(state)
    for expected, got in zip(uninterrupted[6:], take(resumed, 4)):
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_state_is_rank_independent_and_resumes_at_other_dp(tokenizer, cache, jsonl_file):
    reference = [rows(b) for b in take(loader(tokenizer, cache, jsonl_file, batch=8), 4)]
    old = [loader(tokenizer, cache, jsonl_file, batch=2, rank=r, dp=4) for r in range(4)]
    for data in old:
        take(data, 2)
    states = [data.state_dict() for data in old]
    assert all(s == states[0] for s in states)
    checkpoint = {f"dp_rank_{r}": s for r, s in enumerate(states)}  # a per-rank checkpoint
    new = [loader(tokenizer, cache, jsonl_file, batch=4, rank=r, dp=2) for r in range(2)]
    new[0].load_state_dict(checkpoint)
    new[1].load_state_dict(states[3])
    got = [take(data, 2) for data in new]
    for step in range(2):
        union = sorted(row for g in got for row in rows(g[step]))
        assert union == sorted(reference[2 + step])


def test_resume_with_changed_global_batch_skips_nothing(tokenizer, cache, jsonl_file):
    """Save at dp=2 x 3, resume at dp=3 x 2: all sequences appear once, in order."""
    expected = expected_sequences(DOCS)
    old = [loader(tokenizer, cache, jsonl_file, batch=3, rank=r, dp=2) for r in range(2)]
    seen = [take(data, 2) for data in old]
    first_part = [row for step in zip(*seen) for b in step for row in rows(b)]
    new = [loader(tokenizer, cache, jsonl_file, batch=2, rank=r, dp=3) for r in range(3)]
    for data in new:
        data.load_state_dict(old[0].state_dict())
    second = [take(data, 2) for data in new]
    second_part = [row for step in zip(*second) for b in step for row in rows(b)]
    assert sorted(first_part + second_part) == sorted(expected[:24])


def test_epoch_wrap_is_deterministic_and_logged(tokenizer, cache, jsonl_file, caplog):
    one_epoch = expected_sequences(DOCS)
    num = len(one_epoch)
    steps = num // 2 + 3
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        seen = [
            row
            for b in take(loader(tokenizer, cache, jsonl_file, batch=2), steps)
            for row in rows(b)
        ]
    assert seen[:num] == one_epoch and seen[num:] == one_epoch[: len(seen) - num]
    assert any("epoch 1" in r.getMessage() for r in caplog.records)


def test_finite_pass_drops_partial_batch_and_restarts(tokenizer, cache, jsonl_file, caplog):
    num = len(expected_sequences(DOCS))
    for dp in (1, 2):
        data = [
            loader(tokenizer, cache, jsonl_file, batch=3, rank=r, dp=dp, infinite=False)
            for r in range(dp)
        ]
        passes = [[rows(b) for b in d] for d in data]
        assert all(len(p) == num // (3 * dp) for p in passes)
        assert [[rows(b) for b in d] for d in data] == passes  # re-iterable from the start
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert list(loader(tokenizer, cache, jsonl_file, batch=1000, infinite=False)) == []
    assert any("fewer than one global batch" in r.getMessage() for r in caplog.records)
    partial = loader(tokenizer, cache, jsonl_file, batch=3, infinite=False)
    iterator = iter(partial)
    next(iterator)
    assert rows(next(iter(partial))) == rows(
        take(loader(tokenizer, cache, jsonl_file, batch=3), 1)[0]
    )


def test_huggingface_config_suffix(tmp_path):
    assert _split_config("allenai/c4:en") == ("allenai/c4", "en")
    assert _split_config("allenai/c4") == ("allenai/c4", None)
    odd = tmp_path / "with:colon"
    odd.mkdir()
    assert _split_config(str(odd)) == (str(odd), None)


def test_tokenizer_given_as_path(tokenizer, cache, jsonl_file):
    by_path = take(loader(tokenizer.path, cache, jsonl_file), 1)[0]
    assert torch.equal(by_path[0], take(loader(tokenizer, cache, jsonl_file), 1)[0][0])


def test_text_files_one_document_each(tokenizer, cache, tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    texts = {"b.txt": "second file\n\nwith a blank line", "a.txt": "first", "sub/c.txt": "third ☃"}
    for name, text in texts.items():
        (folder / name).write_text(text)
    (folder / "ignored.md").write_text("not a txt file")
    data = loader(tokenizer, cache, folder, dataset="text", batch=1, seq_len=4, infinite=False)
    ordered = [texts[n] for n in sorted(texts)]  # sorted paths: a.txt, b.txt, sub/c.txt
    assert [r for b in data for r in rows(b)] == expected_sequences(ordered, 4)


def test_jsonl_glob_and_parquet_match(tokenizer, cache, tmp_path):
    (tmp_path / "part1.jsonl").write_text(
        "".join(json.dumps({"body": d}) + "\n" for d in DOCS[:10])
    )
    (tmp_path / "part2.jsonl").write_text(
        "".join(json.dumps({"body": d}) + "\n\n" for d in DOCS[10:])
    )
    pq.write_table(pa.table({"body": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "docs.parquet")
    expected = expected_sequences(DOCS)
    for dataset, path in [
        ("jsonl", tmp_path / "part*.jsonl"),
        ("parquet", tmp_path / "docs.parquet"),
    ]:
        data = loader(
            tokenizer, cache, path, dataset=dataset, batch=2, text_field="body", infinite=False
        )
        assert [r for b in data for r in rows(b)] == expected[: len(expected) // 2 * 2]


def test_token_cache_reused_and_invalidated(tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hello world, a small document"}) + "\n")
    loader(tokenizer, cache, path, batch=1)
    bins = list(Path(cache, "tokens").glob("*.bin"))
    mtime = bins[0].stat().st_mtime_ns
    loader(tokenizer, cache, path, batch=1)
    assert list(Path(cache, "tokens").glob("*.bin")) == bins and bins[0].stat().st_mtime_ns == mtime
    path.write_text(json.dumps({"text": "changed contents, so a new token file"}) + "\n")
    assert next(iter(loader(tokenizer, cache, path, batch=1)))[0][0, 1] == ord("c")
    assert len(list(Path(cache, "tokens").glob("*.bin"))) == 2


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (folder / "validation.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    return folder


def test_huggingface_stream_matches_packed_files(tokenizer, cache, jsonl_file, hf_folder):
    steps = len(expected_sequences(DOCS)) // 4 + 2  # crosses an epoch wrap
    packed = take(loader(tokenizer, cache, jsonl_file, batch=4), steps)
    streamed = take(loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=4), steps)
    assert [rows(b) for b in streamed] == [rows(b) for b in packed]
    ranks = [
        take(loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=2, rank=r, dp=2), 3)
        for r in range(2)
    ]
    for step in range(3):
        assert sorted(rows(ranks[0][step]) + rows(ranks[1][step])) == sorted(rows(packed[step]))


def test_huggingface_resume_and_finite(tokenizer, cache, hf_folder):
    reference = take(loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=4), 10)
    first = loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=2, rank=1, dp=2)
    take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["cursor"]["doc_index"] > 0
    resumed = [
        loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=1, rank=r, dp=4)
        for r in range(4)
    ]
    for data in resumed:
        data.load_state_dict(state)
    got = [take(data, 2) for data in resumed]
    for step in range(2):
        assert sorted(row for g in got for row in rows(g[step])) == sorted(
            rows(reference[5 + step])
        )
    finite = loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=2, infinite=False)
    passes = [[rows(b) for b in finite] for _ in range(2)]
    assert passes[0] == passes[1] and len(passes[0]) == len(expected_sequences(DOCS)) // 2
    val = loader(
        tokenizer, cache, hf_folder, dataset="huggingface", split="validation", batch=1, seq_len=4
    )
    assert rows(next(iter(val)))[0] == [256, *b"held"]


def test_sample_dataset(cache):
    tok = build_tokenizer(ensure_sample_tokenizer(cache))
    data = build_dataloader(
        dataset="sample",
        dataset_path="",
        tokenizer=tok,
        seq_len=64,
        local_batch_size=4,
        dp_rank=0,
        dp_degree=1,
        split="validation",
        cache_dir=cache,
        infinite=False,
    )
    batches = list(data)
    assert len(batches) > 10
    inputs, labels = batches[0]
    assert inputs.shape == (4, 64) and inputs[0, 0] == tok.bos_id
    assert int(inputs.max()) < tok.vocab_size


# ------------------------------------------------------------------------------ error paths


def test_unknown_dataset(tokenizer, cache, jsonl_file):
    with pytest.raises(ValueError, match=r"unknown dataset 'csv'.*jsonl"):
        loader(tokenizer, cache, jsonl_file, dataset="csv")


@pytest.mark.parametrize("dataset", ["text", "jsonl", "parquet"])
def test_empty_glob_or_missing_path(tokenizer, cache, tmp_path, dataset):
    pattern = str(tmp_path / "nothing*.xyz")
    with pytest.raises(ValueError, match=r"nothing\*\.xyz.*matches no"):
        loader(tokenizer, cache, pattern, dataset=dataset)
    with pytest.raises(ValueError, match="needs dataset_path"):
        loader(tokenizer, cache, "", dataset=dataset)


def test_missing_text_field(tokenizer, cache, jsonl_file, hf_folder, tmp_path):
    with pytest.raises(ValueError, match=r"docs\.jsonl:1 has no field 'content'.*text_field"):
        loader(tokenizer, cache, jsonl_file, text_field="content")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet.*no column 'text'.*body"):
        loader(tokenizer, cache, tmp_path / "t.parquet", dataset="parquet")
    with pytest.raises(ValueError, match="has no field 'content'"):
        loader(tokenizer, cache, hf_folder, dataset="huggingface", text_field="content")


def test_bad_arguments(tokenizer, cache, jsonl_file, tmp_path):
    with pytest.raises(ValueError, match="split must be 'train' or 'validation'"):
        loader(tokenizer, cache, "", dataset="sample", split="test")
    with pytest.raises(ValueError, match="dp_rank"):
        loader(tokenizer, cache, jsonl_file, rank=2, dp=2)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        loader(tokenizer, cache, jsonl_file, seq_len=100_000)
    with pytest.raises(ValueError, match="cannot stream.*nonexistent"):
        loader(tokenizer, cache, tmp_path / "nonexistent", dataset="huggingface")
    state = loader(tokenizer, cache, jsonl_file).state_dict()
    with pytest.raises(ValueError, match="seq_len=8.*seq_len=4"):
        loader(tokenizer, cache, jsonl_file, seq_len=4).load_state_dict(state)
    with pytest.raises(ValueError, match="per-rank data loader states differ"):
        moved = {**state, "consumed_sequences": 4}
        loader(tokenizer, cache, jsonl_file).load_state_dict(
            {"dp_rank_0": state, "dp_rank_1": moved}
        )


# ------------------------------------------------------------------ sharded streams (#26 item 5)
SHARD_FILES = 4


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """A streamed dataset of SHARD_FILES train files (uneven lengths, so the shards wrap their
    epochs at different steps) and a validation file."""
    folder = tmp_path_factory.mktemp("hf_sharded")
    parts = [[f"file {f} doc {i} " + "ab" * ((i + f) % 4) for i in range(5 + 2 * f)]
             for f in range(SHARD_FILES)]  # fmt: skip
    for f, docs in enumerate(parts):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
        (folder / f"train-{f:05d}.jsonl").write_text(lines)
    (folder / "validation.jsonl").write_text(json.dumps({"text": "held out text"}) + "\n")
    return folder, parts


def sharded(tokenizer, cache, folder, *, batch, rank=0, dp=1, shards=SHARD_FILES):
    return loader(tokenizer, cache, folder, dataset="huggingface", batch=batch, rank=rank, dp=dp,
                  stream_shards=shards)  # fmt: skip


def defined_sharded_stream(parts: list[list[str]], count: int) -> list[list[int]]:
    """The definition: global sequence g is sequence g // S of shard g % S, each shard (here one
    file) packed on its own and repeating its epochs."""
    shards = [expected_sequences(docs) for docs in parts]
    return [shards[g % len(shards)][(g // len(shards)) % len(shards[g % len(shards)])]
            for g in range(count)]  # fmt: skip


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sharded_stream_follows_its_definition_on_every_layout(tokenizer, cache, hf_files, dp):
    folder, parts = hf_files
    steps, global_batch = 12, 8  # past every shard's first epoch
    want = defined_sharded_stream(parts, steps * global_batch)
    readers = [sharded(tokenizer, cache, folder, batch=global_batch // dp, rank=r, dp=dp)
               for r in range(dp)]  # fmt: skip
    got = [take(data, steps) for data in readers]
    for step in range(steps):
        batch_rows = want[step * global_batch : (step + 1) * global_batch]
        for r in range(dp):
            assert rows(got[r][step]) == batch_rows[r::dp], (step, r)
    for r, data in enumerate(readers):  # rank r opened (read, tokenised) only its own shards
        assert sorted(data._reader._readers) == list(range(r, SHARD_FILES, dp))


def test_sharded_stream_with_a_degree_not_dividing_the_shards_is_still_exact(
    tokenizer, cache, hf_files, caplog
):
    folder, parts = hf_files
    want = defined_sharded_stream(parts, 6 * 3)
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        readers = [sharded(tokenizer, cache, folder, batch=1, rank=r, dp=3) for r in range(3)]
    assert "not a multiple of the data-parallel degree 3" in caplog.text
    got = [take(data, 6) for data in readers]
    for step in range(6):
        for r in range(3):
            assert rows(got[r][step]) == want[step * 3 : step * 3 + 3][r::3]


@pytest.mark.parametrize("new_dp", [1, 4])
def test_sharded_stream_resumes_exactly_at_another_dp(tokenizer, cache, hf_files, new_dp):
    """Two ranks save after 5 steps (each holds its own shards' cursors); the joined state
    resumes one rank or four at the next global batch."""
    folder, parts = hf_files
    want = defined_sharded_stream(parts, 8 * 8)
    first = [sharded(tokenizer, cache, folder, batch=4, rank=r, dp=2) for r in range(2)]
    for data in first:
        take(data, 5)
    per_rank = json.loads(json.dumps({f"dp_rank_{r}": d.state_dict() for r, d in enumerate(first)}))
    assert set(per_rank["dp_rank_1"]["cursor"]["shards"]) == {"1", "3"}
    resumed = [sharded(tokenizer, cache, folder, batch=8 // new_dp, rank=r, dp=new_dp)
               for r in range(new_dp)]  # fmt: skip
    for data in resumed:
        data.load_state_dict(per_rank)  # every shard's cursor: no shard is re-read from its start
        assert sorted(data._reader._saved, key=int) == ["0", "1", "2", "3"]
    got = [take(data, 3) for data in resumed]
    for step in range(3):
        batch_rows = want[(5 + step) * 8 : (6 + step) * 8]
        for r in range(new_dp):
            assert rows(got[r][step]) == batch_rows[r::new_dp]


def test_sharded_stream_state_joins_every_ranks_cursors(tokenizer, cache, hf_files):
    """With `gather_cursors` (the trainer's all-gather over the DP ranks) each rank's state holds
    every shard's cursor, so the one state a checkpoint keeps resumes any layout."""
    folder, _ = hf_files
    first = [sharded(tokenizer, cache, folder, batch=2, rank=r, dp=2) for r in range(2)]
    for data in first:
        take(data, 3)
    cursors = [d._reader.cursor() for d in first]
    for data in first:
        data.gather_cursors = lambda mine: cursors
    states = [d.state_dict() for d in first]
    assert states[0] == states[1] and set(states[0]["cursor"]["shards"]) == {"0", "1", "2", "3"}


def test_sharded_stream_refusals(tokenizer, cache, hf_files, hf_folder):
    folder, _ = hf_files
    with pytest.raises(ValueError, match="has only 1 data file"):
        sharded(tokenizer, cache, hf_folder, batch=1, shards=2)
    with pytest.raises(ValueError, match="splits a streamed training dataset"):
        loader(tokenizer, cache, folder, dataset="huggingface", batch=1, stream_shards=2,
               infinite=False)  # fmt: skip


def test_a_state_saved_with_another_shard_count_is_refused(tokenizer, cache, hf_files):
    folder, _ = hf_files
    four = sharded(tokenizer, cache, folder, batch=2)
    take(four, 2)
    state = four.state_dict()
    for other in (sharded(tokenizer, cache, folder, batch=2, shards=2),
                  loader(tokenizer, cache, folder, dataset="huggingface", batch=2)):  # fmt: skip
        with pytest.raises(ValueError, match="resume with training.stream_shards = 4"):
            other.load_state_dict(state)
    one = loader(tokenizer, cache, folder, dataset="huggingface", batch=2)
    take(one, 2)
    with pytest.raises(ValueError, match="resume with training.stream_shards = 1"):
        four.load_state_dict(one.state_dict())


def test_one_stream_over_several_ranks_warns_of_its_cost(tokenizer, cache, hf_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        loader(tokenizer, cache, hf_folder, dataset="huggingface", batch=1, rank=0, dp=2)
    assert "grows with the DP degree" in caplog.text and "training.stream_shards" in caplog.text


def test_stream_shards_from_the_config_reach_the_training_loader(tokenizer, hf_files, tmp_path):
    from job_config import parse_args
    from training.trainer import build_loaders

    folder, parts = hf_files
    argv = ["--training.dataset", "huggingface", "--training.dataset_path", str(folder),
            "--training.shuffle", "false", "--training.seq_len", str(SEQ_LEN),
            "--training.local_batch_size", "4", "--validation.enable", "true"]  # fmt: skip
    one, _ = build_loaders(parse_args(argv), tokenizer, 0, 1)
    four, val = build_loaders(parse_args([*argv, "--training.stream_shards", "4"]), tokenizer, 0, 1)
    assert rows(next(iter(four))) == defined_sharded_stream(parts, 4)
    assert rows(next(iter(one))) != rows(next(iter(four)))
    assert val is not None and not isinstance(val._reader, ShardedReader)  # validation: one stream
    with pytest.raises(Exception, match="stream_shards"):
        parse_args(["--training.stream_shards", "4"])  # the sample corpus is no stream

"""scripts/pretokenize.py with datatrove's local executor (the SLURM job array:
tests/integration/test_slurm.py): a user's JSONL folder and the bundled corpus into indexed
shards that the trainer's loader reads, resume after a lost task, the tokenizer check."""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.dataloader import build_dataloader
from data.indexed import open_indexed
from data.sample_corpus import default_cache_dir, ensure_sample_corpus, ensure_sample_tokenizer
from data.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def pretokenize(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "scripts/pretokenize.py", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def user_folder(root: Path) -> Path:
    """Five JSONL files of 40 documents each (a `body` field), in nested folders."""
    folder = root / "corpus"
    for f in range(5):
        part = folder / f"part{f % 2}" / f"file{f}.jsonl"
        part.parent.mkdir(parents=True, exist_ok=True)
        docs = [{"body": f"file {f} document {i} " + "lorem ipsum " * (i % 9)} for i in range(40)]
        part.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder


def shard_documents(output: Path) -> list[list[int]]:
    """Every document of every shard, in shard order."""
    docs = []
    for idx in sorted(output.glob("*.idx")):
        file = open_indexed(str(idx.with_suffix("")))
        ends = [*file.doc_starts[1:].tolist(), len(file.tokens)]
        docs += [file.tokens[s:e].tolist() for s, e in zip(file.doc_starts.tolist(), ends)]
    return docs


def test_user_jsonl_folder_on_two_workers_resumes_and_trains(tmp_path):
    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    folder, output = user_folder(tmp_path), tmp_path / "tokens"
    args = ["--format", "jsonl", "--input", str(folder), "--output", str(output),
            "--tokenizer", tokenizer.path, "--text-field", "body", "--tasks", "3",
            "--workers", "2"]  # fmt: skip
    run = pretokenize(*args)
    assert "documents: 200" in run.stderr  # datatrove's progress and stats
    assert sorted(p.name for p in output.iterdir()) == [
        f"{t:05d}{s}" for t in range(3) for s in (".bin", ".idx", ".meta.json")
    ]
    texts = [json.loads(line)["body"] for f in folder.rglob("*.jsonl") for line in f.open()]
    want = sorted(tokenizer.encode(t, bos=True, eos=True) for t in texts)
    assert sorted(shard_documents(output)) == want  # every document once, framed as the trainer

    # A lost task (killed before it finished: no completion mark, no shard) is redone on the
    # next run with the same arguments; the finished shards are kept as they were.
    kept = {p.name: p.stat().st_mtime_ns for p in output.glob("0000[02].*")}
    for path in output.glob("00001.*"):
        path.unlink()
    (tmp_path / "tokens.logs" / "completions" / "00001").unlink()
    before = shard_documents(output)
    pretokenize(*args)
    assert {p.name: p.stat().st_mtime_ns for p in output.glob("0000[02].*")} == kept
    assert sorted(shard_documents(output)) == want and len(before) < len(want)
    # A shard lost after its task finished (its mark kept: the output folder was deleted, the
    # logs were not) is redone too, not skipped, and the script says so.
    for path in output.glob("00002.*"):
        path.unlink()
    rerun = pretokenize(*args)
    assert "tasks [2] were marked done" in rerun.stdout
    assert sorted(shard_documents(output)) == want

    # The trainer reads the folder; a run with another tokenizer is refused.
    data = build_dataloader(dataset="megatron", dataset_path=str(output), tokenizer=tokenizer,
                            seq_len=16, local_batch_size=2, dp_rank=0, dp_degree=1)  # fmt: skip
    stream = [t for doc in shard_documents(output) for t in doc]
    assert next(iter(data))[0][0].tolist() == stream[:16]
    other = tmp_path / "bytes.model"
    other.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    with pytest.raises(ValueError, match="was tokenised with tokenizer"):
        build_dataloader(dataset="megatron", dataset_path=str(output), tokenizer=str(other),
                         seq_len=16, local_batch_size=2, dp_rank=0, dp_degree=1)  # fmt: skip


def test_bundled_corpus_equals_the_first_use_tokenisation(tmp_path):
    """`--format sample` writes the tokens the trainer's first-use cache holds, in order."""
    output = tmp_path / "sample"
    pretokenize("--format", "sample", "--output", str(output))
    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    cache = str(tmp_path / "cache")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    first_use = build_dataloader(dataset="jsonl", dataset_path=ensure_sample_corpus()[0],
                                 tokenizer=tokenizer, seq_len=64, local_batch_size=1,
                                 dp_rank=0, dp_degree=1, cache_dir=cache)  # fmt: skip
    (cached,) = Path(cache, "tokens").glob("*.idx")
    a, b = open_indexed(str(cached.with_suffix(""))), open_indexed(str(output / "00000"))
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.doc_starts, b.doc_starts)
    assert first_use.source.num_sequences > 1000


def test_first_use_tokenisation_on_every_core_logs_progress_and_points_to_the_pipeline(
    tmp_path, monkeypatch, caplog
):
    """With the size thresholds at 0 the trainer's first-use cache is built by the process
    pool (2 workers here): the same files as one process writes, progress lines, and the
    pointer to the pipeline."""
    import data.dataset as dataset

    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    docs = [f"doc {i} " + "xy " * (i % 11) for i in range(600)]  # 3 batches of 256
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    def load(cache: str):
        return build_dataloader(dataset="jsonl", dataset_path=str(tmp_path / "d.jsonl"),
                                tokenizer=tokenizer, seq_len=16, local_batch_size=2, dp_rank=0,
                                dp_degree=1, cache_dir=str(tmp_path / cache))  # fmt: skip

    serial = load("a")
    monkeypatch.setattr(dataset, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(dataset, "PIPELINE_BYTES", 0)
    monkeypatch.setattr(dataset, "PROGRESS_S", 0.0)
    monkeypatch.setattr(dataset.os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level("INFO", logger="meshtrain"):
        pooled = load("b")
    assert "(2 processes" in caplog.text and "scripts/pretokenize.py" in caplog.text
    files = [sorted((tmp_path / d / "tokens").glob("*.[bi][id][nx]")) for d in "ab"]
    assert [p.suffix for p in files[0]] == [".bin", ".idx"]
    for a, b in zip(*files):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert next(iter(serial))[0].tolist() == next(iter(pooled))[0].tolist()


def test_threads_and_split_reach_the_pipeline(monkeypatch):
    """Each task's tokenizer threads: --threads, else the cores shared among the local workers,
    else --cpus-per-task on SLURM; --split reaches the Hugging Face reader."""
    from scripts.pretokenize import executor, parse

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    base = ["--format", "jsonl", "--input", str(ROOT / "README.md"), "--output", "/tmp/x"]

    def threads(*more: str) -> int:
        return executor(parse([*base, *more])).pipeline[-1].threads

    assert threads("--tasks", "4", "--workers", "2") == 4
    assert threads("--tasks", "2") == 4  # workers = tasks
    assert threads("--tasks", "16", "--workers", "16") == 1
    assert threads("--tasks", "4", "--threads", "3") == 3
    hf = ["--format", "huggingface", "--input", "some/dataset", "--output", "/tmp/x"]
    reader = executor(parse([*hf, "--split", "validation"])).pipeline[0]
    assert reader.dataset_options["split"] == "validation"


def test_one_thread_encodes_as_many_do():
    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    texts = [f"document {i} " + "some text " * i for i in range(50)]
    assert tokenizer.encode_batch(texts, True, True, threads=1) == tokenizer.encode_batch(
        texts, True, True
    )

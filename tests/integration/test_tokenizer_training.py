"""train.py with a Hugging Face tokenizer.json built locally (tests/hf_tokenizer_files.py):
the launch half of tests/unit/test_data_tokenizer.py."""

import math
from pathlib import Path

import pytest
from dist_utils import Run
from hf_tokenizer_files import HF_VOCAB, HF_WORDS, qwen_like_tokenizer


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory) -> Path:
    return qwen_like_tokenizer(tmp_path_factory.mktemp("qwen"))


def test_training_with_a_tokenizer_json(qwen_like, tmp_path, pool):
    """train.py on one process with `--model.tokenizer_path <tokenizer.json>`: the model gets
    the tokenizer's vocabulary (the parameter count layout.json records is the one for its 300 tokens) and the
    loss is finite."""
    from metrics.flops import count_params
    from models import build_model_args, get_model_spec

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(20):
        words = [HF_WORDS[(i + 3 * j) % len(HF_WORDS)] for j in range(60)]
        (docs / f"doc{i}.txt").write_text(" ".join(words) + " <|endoftext|> é🚀\n")
    run = Run(
        "hf_tokenizer",
        nproc=1,
        args=[
            "--model.tokenizer_path",
            str(qwen_like),
            "--training.dataset",
            "text",
            "--training.dataset_path",
            str(docs),
            "--training.steps",
            "3",
        ],  # fmt: skip
        env={"MESHTRAIN_CACHE": str(tmp_path / "cache")},
    )
    run = pool.launch(__name__, [run])["hf_tokenizer"].check()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3]
    assert all(math.isfinite(loss) for loss in losses.values())
    assert math.log(HF_VOCAB) - 1 < losses[1] < math.log(HF_VOCAB) + 1  # ~uniform over the vocab
    log = (run.folder / "logs" / "rank_0.log").read_text()
    assert f"tokenizer {qwen_like}: {HF_VOCAB} tokens, BOS none, EOS '<|endoftext|>'" in log

    def n_params(vocab: int) -> int:
        shape = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
        args = build_model_args("llama3", "debugmodel", 32, vocab, shape)
        return count_params(get_model_spec("llama3").model_cls(args))

    assert n_params(HF_VOCAB) != n_params(4096)
    assert run.param_counts()["total"] == n_params(HF_VOCAB)

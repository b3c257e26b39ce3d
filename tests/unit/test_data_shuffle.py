"""Seeded shuffling (data/shuffle.py): a permutation per epoch, O(1) per index, the same global
batches on every data-parallel layout, exactly resumable at another DP degree."""

import json

import pytest
from test_data_loader import DOCS, byte_tokenizer, expected_sequences, rows, take
from test_data_loader import loader as base_loader

from data.shuffle import permuted
from data.tokenizer import Tokenizer
from job_config import parse_args
from job_config.loader import ConfigError

SEED = 5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(jsonl file, token cache folder)."""
    folder = tmp_path_factory.mktemp("shuffle")
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path, str(folder / "cache")


def loader(tokenizer, corpus, **kwargs):
    path, cache = corpus
    return base_loader(tokenizer, cache, path, shuffle_seed=kwargs.pop("seed", SEED), **kwargs)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 64, 65, 1000, 4097])
def test_each_epoch_is_a_permutation(count):
    for epoch in range(3):
        order = [permuted(i, count, SEED, epoch) for i in range(count)]
        assert sorted(order) == list(range(count))
    if count > 5:  # epochs and seeds give other orders (not the identity)
        orders = {
            tuple(permuted(i, count, s, e) for i in range(count))
            for s, e in [(1, 0), (1, 1), (2, 0)]
        }
        assert len(orders) == 3 and tuple(range(count)) not in orders
    with pytest.raises(IndexError):
        permuted(count, count, SEED, 0)


def test_loader_reads_the_permuted_order_across_epochs(tokenizer, corpus):
    """Global sequence g of the shuffled stream is sequence permuted(g mod N, N, seed, epoch)
    of the corpus: every epoch holds each sequence once, in its own order."""
    sequences = expected_sequences(DOCS)
    count = len(sequences)
    epochs = 2
    steps = epochs * count // 4
    got = [row for b in take(loader(tokenizer, corpus, batch=4), steps) for row in rows(b)]
    want = [sequences[permuted(g % count, count, SEED, g // count)] for g in range(steps * 4)]
    assert got == want
    assert sorted(got[:count]) == sorted(sequences) and got[:count] != sequences
    assert got[:count] != got[count : 2 * count]


@pytest.mark.parametrize("dp", [2, 4])
def test_layout_independent_and_resumes_at_other_dp(tokenizer, corpus, dp):
    """Rank r of dp holds rows r::dp of the dp=1 global batch, across an epoch wrap; the
    state saved at dp resumes at dp=1 (and a dp=1 state at dp) at the same global batch."""
    steps = len(expected_sequences(DOCS)) // 8 + 3
    reference = [rows(b) for b in take(loader(tokenizer, corpus, batch=8), steps)]
    ranks = [loader(tokenizer, corpus, batch=8 // dp, rank=r, dp=dp) for r in range(dp)]
    per_rank = [[rows(b) for b in take(data, steps - 2)] for data in ranks]
    for step in range(steps - 2):
        for r in range(dp):
            assert per_rank[r][step] == reference[step][r::dp]
    one = loader(tokenizer, corpus, batch=8)
    one.load_state_dict(json.loads(json.dumps(ranks[1].state_dict())))
    assert [rows(b) for b in take(one, 2)] == reference[steps - 2 :]
    single = loader(tokenizer, corpus, batch=8)
    take(single, 1)
    again = [loader(tokenizer, corpus, batch=8 // dp, rank=r, dp=dp) for r in range(dp)]
    for data in again:
        data.load_state_dict(single.state_dict())
    got = [rows(take(data, 1)[0]) for data in again]
    assert all(got[r] == reference[1][r::dp] for r in range(dp))


def test_seed_and_switch(tokenizer, corpus):
    first = lambda **kw: rows(take(loader(tokenizer, corpus, batch=8, **kw), 1)[0])  # noqa: E731
    assert first(seed=None) == expected_sequences(DOCS)[:8]  # off: the corpus order
    assert first(seed=1) != first(seed=2)
    assert loader(tokenizer, corpus, seed=1).state_dict()["dataset"].endswith(":shuffle1")


def test_streamed_sources_refuse_it(tokenizer, corpus, tmp_path):
    (tmp_path / "train.jsonl").write_text(corpus[0].read_text())
    with pytest.raises(ValueError, match="set training.shuffle = false"):
        base_loader(tokenizer, corpus[1], tmp_path, dataset="huggingface", shuffle_seed=SEED)


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="training.dataset = 'huggingface' is streamed"):
        parse_args(["--training.dataset", "huggingface", "--training.dataset_path", "x"])
    parse_args(["--training.dataset", "huggingface", "--training.dataset_path", "x",
                "--training.shuffle", "false"])  # fmt: skip
    with pytest.raises(ConfigError, match="training.shuffle_seed set but"):
        parse_args(["--training.shuffle", "false", "--training.shuffle_seed", "3"])

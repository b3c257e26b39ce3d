"""Weighted mixtures (data/mixture.py): the greedy blend, each source's share in every window,
the same global batches on every DP layout, exact resume at another DP degree (shuffled too)."""

import json

import numpy as np
import pytest
from megatron_files import documents, write_megatron
from test_data_loader import byte_tokenizer, rows, take

from data.dataloader import build_dataloader
from data.mixture import blend_period, integer_weights, parse_mixture
from data.tokenizer import Tokenizer
from job_config import parse_args
from job_config.loader import ConfigError

SEQ_LEN = 8
# three corpora of distinct id ranges, so a row tells its source: a (ids < 50) is the smallest
SOURCES = {"a": (20, 0), "b": (60, 50), "c": (120, 100)}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("mix")
    out = {}
    for name, (count, base) in SOURCES.items():
        docs = [[base + t for t in doc] for doc in documents(count, seed=base, vocab=50)]
        write_megatron(folder / name, docs)
        out[name] = str(folder / name)
    return out


def mixture(corpora, weights=(5, 3, 2)) -> list[str]:
    return [f"megatron:{corpora[n]}:{w}" for n, w in zip("abc", weights)]


def loader(tokenizer, corpora, *, batch=10, rank=0, dp=1, seed=None, weights=(5, 3, 2)):
    return build_dataloader(dataset="", dataset_path="", tokenizer=tokenizer, seq_len=SEQ_LEN,
                            local_batch_size=batch, dp_rank=rank, dp_degree=dp,
                            shuffle_seed=seed, mixture=mixture(corpora, weights))  # fmt: skip


def source_of(row: list[int]) -> int:
    return min(row) // 50


def greedy(weights, count: int) -> list[int]:
    """The test's own statement of the rule: take from the source furthest below its share."""
    shares = np.asarray(weights) / sum(weights)
    taken, out = np.zeros(len(weights)), []
    for g in range(count):
        s = int(np.argmax(shares * (g + 1) - taken))
        taken[s] += 1
        out.append(s)
    return out


def test_parse_mixture():
    assert parse_mixture(["huggingface:allenai/c4:en:0.5", "jsonl:/d:2"]) == [
        ("huggingface", "allenai/c4:en", 0.5),
        ("jsonl", "/d", 2.0),
    ]
    for bad in ["jsonl:/d", "jsonl:/d:0", "jsonl:/d:x", ":/d:1"]:
        with pytest.raises(ValueError, match="KIND:PATH:WEIGHT"):
            parse_mixture([bad])


def test_every_window_follows_the_weights(tokenizer, corpora):
    """The sources of 30 global batches (300 sequences, past every source's epoch end) are the
    greedy rule's, and every window of w consecutive sequences holds each source's share
    within 2 sequences; the loader counts each source's tokens."""
    data = loader(tokenizer, corpora)
    got = [source_of(r) for b in take(data, 30) for r in rows(b)]
    assert got == greedy((5, 3, 2), 300)
    shares = np.asarray([0.5, 0.3, 0.2])
    onehot = np.eye(3)[got]
    for width in (1, 7, 10, 50, 300):
        sums = np.cumsum(np.vstack([np.zeros(3), onehot]), axis=0)
        windows = sums[width:] - sums[:-width]
        assert np.abs(windows - shares * width).max() < 2, width
    assert data.source_tokens() == {
        "tokens_mix0": 150 * 8,
        "tokens_mix1": 90 * 8,
        "tokens_mix2": 60 * 8,
    }


def test_each_source_is_read_in_its_own_order(tokenizer, corpora):
    mixed = [r for b in take(loader(tokenizer, corpora), 4) for r in rows(b)]
    for i, name in enumerate("abc"):
        alone = build_dataloader(dataset="megatron", dataset_path=corpora[name],
                                 tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=40,
                                 dp_rank=0, dp_degree=1)  # fmt: skip
        mine = [r for r in mixed if source_of(r) == i]
        assert mine == rows(next(iter(alone)))[: len(mine)]


@pytest.mark.parametrize("dp, seed", [(2, None), (5, 3)])
def test_layout_independent_and_resumes_at_other_dp(tokenizer, corpora, dp, seed):
    """Rank r of dp holds rows r::dp of the dp=1 global batch (shuffled or not); the state
    saved at dp resumes at dp=1, and a dp=1 state at dp, at the same global batch."""
    steps = 12
    reference = [rows(b) for b in take(loader(tokenizer, corpora, seed=seed), steps)]
    ranks = [
        loader(tokenizer, corpora, batch=10 // dp, rank=r, dp=dp, seed=seed) for r in range(dp)
    ]
    per_rank = [[rows(b) for b in take(d, steps - 3)] for d in ranks]
    for step in range(steps - 3):
        for r in range(dp):
            assert per_rank[r][step] == reference[step][r::dp]
    one = loader(tokenizer, corpora, seed=seed)
    one.load_state_dict(
        json.loads(json.dumps({f"dp_rank_{r}": d.state_dict() for r, d in enumerate(ranks)}))
    )
    assert [rows(b) for b in take(one, 3)] == reference[steps - 3 :]
    again = [
        loader(tokenizer, corpora, batch=10 // dp, rank=r, dp=dp, seed=seed) for r in range(dp)
    ]
    for d in again:
        d.load_state_dict(one.state_dict())
    nxt = [rows(take(d, 1)[0]) for d in again]
    want = rows(take(one, 1)[0])
    assert all(nxt[r] == want[r::dp] for r in range(dp))


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="KIND:PATH:WEIGHT"):
        parse_args(["--training.mixture", '["jsonl:/x"]'])
    with pytest.raises(ConfigError, match="unknown dataset kinds"):
        parse_args(["--training.mixture", '["csv:/x:1"]'])
    with pytest.raises(ConfigError, match="training.dataset_path set but"):
        parse_args(["--training.mixture", '["jsonl:/x:1"]', "--training.dataset_path", "/y"])
    with pytest.raises(ConfigError, match="huggingface' is streamed"):
        parse_args(["--training.mixture", '["jsonl:/x:1", "huggingface:c4:1"]'])
    with pytest.raises(ConfigError, match="needs validation.dataset"):
        parse_args(["--training.mixture", '["jsonl:/x:1"]', "--validation.enable", "true"])


def test_float_weights_and_the_period():
    """Float weights become shares of 65536; the tabulated period equals the greedy rule run
    on, so s(g) and n_s(g) are O(1) for any g."""
    ints = integer_weights([0.7, 0.2, 0.1])
    assert sum(ints) == 2**16 and abs(ints[0] / 2**16 - 0.7) < 1e-4
    assert integer_weights([4, 2, 2]) == [2, 1, 1]
    choice, counts = blend_period([2, 1, 1])
    assert choice.tolist() == greedy((2, 1, 1), 4)
    assert counts[-1].tolist() == [2, 1, 1]


def test_a_streamed_source_is_walked_and_resumes(tokenizer, corpora, tmp_path):
    """A mixture with a streamed (huggingface) source: the same rows on dp 1 and 2, and a
    resume from the saved cursor continues exactly."""
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * (i % 5 + 1)}) + "\n" for i in range(60))
    )
    entries = [f"megatron:{corpora['a']}:1", f"huggingface:{tmp_path}:1"]
    make = lambda batch, rank=0, dp=1: build_dataloader(  # noqa: E731
        dataset="",
        dataset_path="",
        tokenizer=tokenizer,
        seq_len=SEQ_LEN,
        cache_dir=str(tmp_path / "c"),
        local_batch_size=batch,
        dp_rank=rank,
        dp_degree=dp,
        mixture=entries,
    )
    reference = [rows(b) for b in take(make(4), 6)]
    ranks = [make(2, r, 2) for r in range(2)]
    for step, pair in enumerate(zip(*[take(d, 3) for d in ranks])):
        assert [rows(b) for b in pair] == [reference[step][0::2], reference[step][1::2]]
    resumed = make(4)
    resumed.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    assert [rows(b) for b in take(resumed, 3)] == reference[3:]


def test_a_rank_reads_only_its_own_rows(tokenizer, corpora):
    """Random-access sources: at DP 64 a rank reads its 2 rows of each global batch, not 128."""
    data = loader(tokenizer, corpora, batch=2, rank=5, dp=64)
    calls = []
    for part in data.source.sources:
        original = part.window
        part.window = lambda g, inf, original=original: calls.append(g) or original(g, inf)
    take(data, 3)
    assert len(calls) == 6

"""The per-tensor Hugging Face description (`HFAdapter.tensor`) every family gives, and the
streaming paths built on it: slices read from HF files equal the same slices of the whole-dict
conversion, for every family; the streaming converters keep their refusals."""

import dataclasses
import json
import random

import pytest
import torch

from checkpoint.hf import (
    HFFiles,
    read_slice,
    resolve_source,
    stream_hf_to_dcp,
    tensor_map,
    to_hf_tensors,
    write_hf_weights,
)
from checkpoint.hf_write import stream_dcp_to_hf
from checkpoint.storage import CheckpointError
from models import get_model_spec

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss", "deepseek_v3",
            "deepseek_v3+mtp"]  # fmt: skip


def random_state(spec, args, seed=0) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in spec.model_cls(args).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    for k in sd:
        if k.endswith("expert_bias"):  # Hugging Face has none: zero in, zero out
            sd[k].zero_()
    if getattr(args, "tie_embeddings", False):
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def family(name):
    """(spec, debugmodel args); "+mtp": with a multi-token-prediction module."""
    name, _, extra = name.partition("+")
    spec = get_model_spec(name)
    args = spec.flavors["debugmodel"]
    return spec, dataclasses.replace(args, mtp_depth=1) if extra == "mtp" else args


@pytest.mark.parametrize("name", FAMILIES)
def test_the_description_agrees_with_the_whole_dict_conversion(name):
    spec, args = family(name)
    sd = random_state(spec, args)
    where = tensor_map(spec, args)
    streamed = {}
    for n, t in sd.items():
        streamed.update(to_hf_tensors(where(n), t))
    whole = spec.hf.to_hf(sd, args)
    assert streamed.keys() == whole.keys()
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)


@pytest.mark.parametrize("name", FAMILIES)
def test_any_slice_reads_as_the_same_slice_of_the_whole_import(tmp_path, name):
    """Sharded HF files (several tensors per file, a tensor never split) -> random slices of
    each of our tensors, as FSDP and TP shards would ask: equal to the whole-dict import."""
    spec, args = family(name)
    hf = spec.hf.to_hf(random_state(spec, args, 1), args)
    if getattr(args, "tie_embeddings", False):
        hf.pop("lm_head.weight", None)  # as published tied checkpoints: the output is read tied
    assert len(write_hf_weights(hf, tmp_path, max_shard_bytes=40_000)) > 2
    ours = spec.hf.from_hf(dict(hf), args)
    files = HFFiles(tmp_path)
    where = tensor_map(spec, args)
    rnd = random.Random(0)
    for n, full in ours.items():
        src = resolve_source(files, where(n), n)
        for _ in range(3):
            offsets = tuple(rnd.randrange(0, s) for s in full.shape)
            shape = tuple(rnd.randrange(1, s - o + 1) for s, o in zip(full.shape, offsets))
            want = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
            assert torch.equal(read_slice(files, src, offsets, shape), want), (n, offsets, shape)
    files.close()


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe", "deepseek_v3+mtp"])
def test_streamed_round_trip_is_exact(tmp_path, name):
    """HF -> DCP -> HF with the streaming converters, several output files: bit for bit."""
    from checkpoint.hf import read_dcp_model, read_hf_weights

    spec, args = family(name)
    hf = spec.hf.to_hf(random_state(spec, args, 2), args)
    write_hf_weights(hf, tmp_path / "hf", max_shard_bytes=60_000)
    stream_hf_to_dcp(tmp_path / "hf", spec, args, tmp_path / "dcp", {"kind": "converted"})
    sd = read_dcp_model(tmp_path / "dcp" / "step-0")
    want = spec.hf.from_hf(dict(hf), args)
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in sd)
    files, _, _ = stream_dcp_to_hf(
        tmp_path / "dcp" / "step-0", spec, args, tmp_path / "back", max_shard_bytes=60_000
    )
    assert len(files) > 2
    back = read_hf_weights(tmp_path / "back")
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_streaming_refusals_name_the_tensor(tmp_path):
    spec, args = family("llama3")
    hf = spec.hf.to_hf(random_state(spec, args), args)
    layout = {"kind": "converted"}

    def folder(tensors, sub):
        write_hf_weights(tensors, tmp_path / sub)
        return tmp_path / sub

    gone = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        stream_hf_to_dcp(folder(gone, "a"), spec, args, tmp_path / "o1", layout)
    extra = {**hf, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model\.layers\.9"):
        stream_hf_to_dcp(folder(extra, "b"), spec, args, tmp_path / "o2", layout)
    small = dataclasses.replace(args, vocab_size=args.vocab_size - 2)
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight: .* needs"):
        stream_hf_to_dcp(folder(hf, "c"), spec, small, tmp_path / "o3", layout)


def test_a_family_without_a_description_is_refused():
    spec, args = family("qwen3")
    bare = dataclasses.replace(spec, hf=dataclasses.replace(spec.hf, tensor=None))
    with pytest.raises(CheckpointError, match="has no `tensor` description"):
        tensor_map(bare, args)


def test_hf_index_lists_every_tensor(tmp_path):
    spec, args = family("qwen3_moe")
    hf = spec.hf.to_hf(random_state(spec, args), args)
    write_hf_weights(hf, tmp_path, max_shard_bytes=50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf) == set(HFFiles(tmp_path).where)


def hf_folder(folder, name: str, **overrides):
    spec, args = family(name)
    args = dataclasses.replace(args, **overrides)
    write_hf_weights(spec.hf.to_hf(random_state(spec, args), args), folder)
    (folder / "config.json").write_text(json.dumps(spec.hf.config_from_args(args, torch.float32)))
    return folder


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model.dim", "128"], "config.json's model has other shapes than the run's"),
        (["--checkpoint.initial_load_model_only", "false"], "holds weights only"),
        (["--model.name", "qwen3"], "model_type = 'llama', but the run's model.name = qwen3"),
    ],
)
def test_a_run_refuses_an_hf_folder_that_does_not_fit_before_any_process_group(
    tmp_path, argv, message
):
    from job_config.loader import parse_args
    from job_config.problems import ConfigError
    from training.preflight import check_config

    folder = hf_folder(tmp_path / "hf", "llama3")
    base = ["--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(folder)]
    check_config(parse_args(base), 1)  # the debug model's own shape: fine
    with pytest.raises(ConfigError, match=message):
        check_config(parse_args([*base, *argv]), 1)

"""A small Llama (4 layers, dim 32, vocabulary 64) built the way the trainer builds one, and
random batches for it: shared by the unit and integration tests of the parallelisms."""

from __future__ import annotations

import torch

from models.init_weights import init_weights
from models.llama3 import ModelArgs, Transformer

ARGS = ModelArgs(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16
)


def tiny_model(args: ModelArgs = ARGS, wrap=None) -> Transformer:
    """Built on meta, optionally parallelised by `wrap`, then materialised and initialised."""
    with torch.device("meta"):
        model = Transformer(args)
    if wrap is not None:
        wrap(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        init_weights(model, 0)
    model.init_buffers("cpu")
    return model


def batch(n: int = 4, seed: int = 0, vocab: int = 63) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (n, 16), generator=g) for _ in range(2))

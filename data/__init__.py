"""Data pipeline: tokenizers, the bundled sample corpus and the stateful DP-invariant loader.

Import from the submodules, e.g. ``from data.tokenizer import build_tokenizer`` and
``from data.dataloader import build_dataloader``; this package file stays import-free so that
light users (the sample corpus builder) do not pay for importing torch.
"""

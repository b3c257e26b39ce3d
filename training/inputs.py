"""A loaded batch turned into this rank's model inputs, once per micro-batch: its context-parallel
shard of each sequence with their global positions (`parallelisms.context_parallel` decides
which positions a CP rank holds and how its attention gathers the keys), and, with
`training.document_mask`, each token's document index, for the queries and the (gathered)
keys. The model builds its attention's block masks from them (models/attention.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.context_parallel import gathered_positions, local_positions


@dataclass(frozen=True)
class SequenceSplit:
    """How this rank turns a loaded batch into model inputs: its CP shard of each sequence,
    and the attention coordinates. `document_mask`: attention stays within documents, whose
    index the loader gives with every batch; `positions`: give the
    positions even without CP (a pipeline stage after the first cannot tell the sequence
    length from its input, which tensor parallelism may have split along the sequence)."""

    cp_rank: int = 0
    cp: int = 1
    document_mask: bool = False
    positions: bool = False

    @property
    def plain(self) -> bool:
        """No CP, no document mask, no positions: the model's defaults."""
        return self.cp == 1 and not self.document_mask and not self.positions


def sequence_inputs(
    split: SequenceSplit,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(inputs, labels, model keyword arguments) of this rank for full sequences [batch, seq]:
    the rank's `positions` (its two chunks under CP), with document masking the `documents`
    of its tokens, and under CP the `key_positions` and `key_documents` of the keys its
    attention gathers (all [batch, tokens]). Plain layouts get the batch back unchanged and no
    keyword arguments. `documents`: the loader's document index of each input token (from the
    sources' indexes, `data.dataloader.DPDataLoader(documents=True)`), the one producer of
    document boundaries: no token is scanned for an end-of-document id."""
    if split.plain:
        return inputs, labels, {}
    batch, seq = inputs.shape  # seq_len % (2 cp) == 0: checked with the config
    if not split.document_mask:
        documents = None
    elif documents is None:
        raise ValueError("document masking needs the loader's document index of the batch")
    if split.cp == 1:
        kwargs = {"positions": torch.arange(seq, device=inputs.device).expand(batch, -1)}
        if documents is not None:
            kwargs["documents"] = documents
        return inputs, labels, kwargs
    mine = local_positions(seq, split.cp_rank, split.cp, inputs.device)
    keys = gathered_positions(seq, split.cp, inputs.device)
    kwargs = {"positions": mine.expand(batch, -1), "key_positions": keys.expand(batch, -1)}
    if documents is not None:
        kwargs["documents"], kwargs["key_documents"] = documents[:, mine], documents[:, keys]
    return inputs[:, mine], labels[:, mine], kwargs

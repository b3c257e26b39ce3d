"""A loaded batch turned into this rank's model inputs, once per micro-batch: its context-parallel
shard of each sequence with their global positions (`parallelisms.context_parallel` decides
which positions a CP rank holds and how its attention gathers the keys), and, with
`training.document_mask`, each token's document index, for the queries and the (gathered)
keys. The model builds its attention's block masks from them (models/attention.py). A model
with multi-token prediction (models/mtp.py) also gets the labels of the later positions each
of its depths predicts, cut from the whole sequence before the CP split."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.context_parallel import gathered_positions, local_positions
from training.loss import IGNORE_INDEX


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
    mtp_depth: int = 0  # the model's multi-token-prediction modules (`mtp_labels`)

    @property
    def plain(self) -> bool:
        """No CP, no document mask, no positions, no multi-token prediction: the model's
        defaults."""
        return self.cp == 1 and not (self.document_mask or self.positions or self.mtp_depth)


def later_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq, depth + 1]: column k holds the label k positions later (column 0 the
    labels), `IGNORE_INDEX` past the sequence's end: what multi-token prediction's depth k
    embeds (column k - 1) and predicts (column k)."""
    ignored = torch.full_like(labels[:, :depth], IGNORE_INDEX)
    padded = torch.cat([labels, ignored], 1)
    return torch.stack([padded[:, k : k + labels.shape[1]] for k in range(depth + 1)], -1)


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
    mtp = later_labels(labels, split.mtp_depth) if split.mtp_depth else None
    if not split.document_mask:
        documents = None
    elif documents is None:
        raise ValueError("document masking needs the loader's document index of the batch")
    if split.cp == 1:
        kwargs = {"positions": torch.arange(seq, device=inputs.device).expand(batch, -1)}
        if documents is not None:
            kwargs["documents"] = documents
        if mtp is not None:
            kwargs["mtp_labels"] = mtp
        return inputs, labels, kwargs
    mine = local_positions(seq, split.cp_rank, split.cp, inputs.device)
    keys = gathered_positions(seq, split.cp, inputs.device)
    kwargs = {"positions": mine.expand(batch, -1), "key_positions": keys.expand(batch, -1)}
    if documents is not None:
        kwargs["documents"], kwargs["key_documents"] = documents[:, mine], documents[:, keys]
    if mtp is not None:
        kwargs["mtp_labels"] = mtp[:, mine]
    return inputs[:, mine], labels[:, mine], kwargs

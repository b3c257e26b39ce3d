"""A loaded batch turned into this rank's model inputs, once per micro-batch: its context-parallel
shard of each sequence with their global positions (`parallelisms.context_parallel` decides
which positions a CP rank holds and how its attention gathers the keys), and, with
`training.document_mask`, the document-causal attention mask between the rank's queries and
the (gathered) keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.context_parallel import gathered_positions, local_positions


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[batch, seq] document index of each token of packed sequences: a document ends with its
    end-of-document token and the next token starts the next one (the data pipeline packs
    [BOS] text [EOS], or text [EOS] for tokenizers without BOS)."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends


def attention_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """[batch, 1, queries, keys] boolean: key j is visible to query i when it is at an earlier
    or the same position and, given documents [batch, tokens], in the same document."""
    visible = k_positions[None, None, :] <= q_positions[None, :, None]
    if q_documents is not None:
        visible = visible & (k_documents[:, None, :] == q_documents[:, :, None])
    return visible.unsqueeze(1)


@dataclass(frozen=True)
class SequenceSplit:
    """How this rank turns a loaded batch into model inputs: its CP shard of each sequence,
    and the attention coordinates. `eos_id`: set with document masking."""

    cp_rank: int = 0
    cp: int = 1
    eos_id: int | None = None

    @property
    def plain(self) -> bool:
        """No CP and no document mask: the model's default causal attention."""
        return self.cp == 1 and self.eos_id is None


def sequence_inputs(
    split: SequenceSplit, inputs: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(inputs, labels, model keyword arguments) of this rank for full sequences [batch, seq]:
    under CP the rank's two chunks with their `positions` (for RoPE); with document masking
    the `attention_mask` (between the rank's queries and the gathered keys under CP). Plain
    layouts get the batch back unchanged and no keyword arguments; plain CP gets no mask
    (`ContextParallelAttention` is causal chunk by chunk)."""
    if split.plain:
        return inputs, labels, {}
    batch, seq = inputs.shape  # seq_len % (2 cp) == 0: checked with the config
    documents = None if split.eos_id is None else document_ids(inputs, split.eos_id)
    if split.cp == 1:  # document masking alone
        positions = torch.arange(seq, device=inputs.device)
        return (
            inputs,
            labels,
            {"attention_mask": attention_mask(positions, positions, documents, documents)},
        )
    mine = local_positions(seq, split.cp_rank, split.cp, inputs.device)
    kwargs = {"positions": mine.expand(batch, -1)}
    if documents is not None:
        keys = gathered_positions(seq, split.cp, inputs.device)
        mask = attention_mask(mine, keys, documents[:, mine], documents[:, keys])
        kwargs["attention_mask"] = mask
    return inputs[:, mine], labels[:, mine], kwargs

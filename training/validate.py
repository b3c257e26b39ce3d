"""Validation loss on the held-out split, averaged over every token all DP ranks saw.

A validation step is one global batch (`training.global_batch_size` sequences: each DP rank's
`local_batch_size` rows, `micro_batches` times, as a training step reads them), so every
layout and accumulation evaluates the same sequences and reports the same loss."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from training.inputs import sequence_inputs
from training.loss import cross_entropy_sum, labelled_tokens
from training.step import pipeline_call


def global_batches(loader: Iterable, micro_batches: int, steps: int) -> Iterator[list]:
    """The loader's batches in groups of `micro_batches` (one global batch each), at most
    `steps` groups (-1: until the split ends); a last incomplete group is left out, so the
    sequences read do not depend on how a global batch is split over ranks and micro-steps."""
    batches, done = iter(loader), 0
    while steps < 0 or done < steps:
        group = list(itertools.islice(batches, micro_batches))
        if len(group) < micro_batches:
            return
        yield group
        done += 1


@torch.no_grad()
def evaluate(setup, loader, steps: int, device: torch.device, micro_batches: int = 1) -> float:
    """Mean token loss over `steps` global batches (-1 = the whole split, less its last
    incomplete global batch), each `micro_batches` of the loader's batches on every DP rank
    (each CP rank its shard of them).

    Loss and token sums are added over all ranks; TP copies scale both equally, and only
    the stage that computes the loss counts tokens, so the ratio is the global mean. A
    pipeline schedule's loss is the step's `StepLoss`, set here to the plain sum."""
    for part in setup.model_parts:
        part.eval()
    setup.loss_fn.per_rank_tokens = 1.0
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (loss sum, tokens)
    for batch in itertools.chain.from_iterable(global_batches(loader, micro_batches, steps)):
        inputs, labels, *documents = (t.to(device) for t in batch)
        inputs, labels, kwargs = sequence_inputs(setup.split, inputs, labels, *documents)
        with setup.loss_context(), setup.autocast():
            if setup.pp_schedule is None:
                logits = setup.model_parts[0](inputs, **kwargs)
                total[0] += cross_entropy_sum(logits, labels).double()
            else:
                args, target, losses = pipeline_call(setup, inputs, labels)
                setup.pp_schedule.eval(*args, target=target, losses=losses, **kwargs)
                if setup.pp_last_stage:
                    total[0] += torch.stack(losses).sum().double()
        if setup.pp_last_stage:
            total[1] += labelled_tokens(labels)
    for part in setup.model_parts:
        part.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item() if total[1] > 0 else float("nan")

"""Distributed checkpointing (torch.distributed.checkpoint): save, resume, reshard, export.

`CheckpointManager` (manager.py) is what the trainer uses; `storage.py` holds the on-disk
layout and commit protocol, `state.py` what a checkpoint contains, `staging.py` the host copy
an async save writes in the background, `seed.py` the seed checkpoint, and `hf.py` reads and
writes Hugging Face safetensors and model-only checkpoints for any family (the names map
through the family's `hf` adapter), for scripts/convert_from_hf.py and scripts/convert_to_hf.py.
"""

from checkpoint.storage import CheckpointError

__all__ = ["CheckpointError"]

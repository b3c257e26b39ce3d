"""Distributed checkpointing (torch.distributed.checkpoint): save, resume, reshard, export.

`CheckpointManager` (manager.py) is what the trainer uses; `storage.py` holds the on-disk
layout and commit protocol, `state.py` what a checkpoint contains, `seed.py` the seed
checkpoint and `hf.py` the Hugging Face Llama name/permutation mapping used by
scripts/convert_from_hf.py and scripts/convert_to_hf.py.
"""

from checkpoint.storage import CheckpointError

__all__ = ["CheckpointError"]

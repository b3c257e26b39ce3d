"""What the planning tests share: the tiny config the estimator is checked on, the estimate
CLI as a module, and the bytes autograd saves in one block's forward."""

import importlib.util

import torch
from dist_utils import TINY_SHAPE
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from job_config import parse_args
from models import arg_overrides, build_model_args

TINY = " ".join(TINY_SHAPE) + " --training.seq_len 32 --training.local_batch_size 2"


def estimate_script():
    """`scripts/estimate.py` loaded as a module."""
    spec = importlib.util.spec_from_file_location("estimate_cli", "scripts/estimate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_cfg(extra: str = ""):
    """The tiny run's config with `extra` options on top."""
    return parse_args((TINY + " " + extra).split())


def tiny_args(cfg):
    """The model arguments of a tiny config at 32 tokens."""
    return build_model_args(cfg.model.name, cfg.model.flavor, 32, None, arg_overrides(cfg))


def saved_bytes(block: torch.nn.Module, x: torch.Tensor, skip: set[int], *inputs) -> int:
    """Bytes of the tensors autograd saves for backward in one block's forward."""
    saved = {}

    def pack(t):
        if isinstance(t, AsyncCollectiveTensor):  # a gathered K/V (CP), saved as it came
            t = t.elem
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, *inputs)
    return sum(saved.values())

"""The `bare` row of scripts/bench.py: a plain PyTorch training loop over meshtrain's model class,
the reference that the framework's overhead is measured against.

    python scripts/bare_loop.py --config debug_model --job.dump_folder DIR \\
        [--training.steps 8] [--section.key value ...]     # train.py's options

Setup goes through meshtrain's job_config and model registry (the same model class, weights,
vocabulary and batch shape as train.py); after it, no meshtrain code runs between a batch and
the next: model, AdamW (foreach), fp32 cross-entropy, backward, grad-norm clip, step,
zero_grad, `loss.item()` each step (as train.py does at log_freq 1), on random tokens. With a
bf16 compute dtype (`--training.mixed_precision_param bfloat16`) the forward runs under
`torch.autocast`, plain PyTorch's mixed precision. It writes DIR/metrics.jsonl: one
train.py-style record per step (step, kind, loss, step_time_s, tokens_per_sec, memory_gib).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench_measure import compute_dtype, vocab_size  # scripts/bench_measure.py, next to this file


def build_model(cfg, args):
    """The configured model on CPU, initialised as train.py initialises it, in train mode."""
    import torch

    from models import get_model_spec
    from models.init_weights import init_weights
    from models.mixed_precision import in_weight_dtype

    with torch.device("meta"):  # float64 weights in the float64 mode, as train.py's
        model = in_weight_dtype(get_model_spec(cfg.model.name).model_cls(args), cfg.training)
    model.to_empty(device="cpu")
    with torch.no_grad():
        init_weights(model, cfg.debug.seed)
    model.init_buffers("cpu")
    model.train()
    return model


def train(cfg, model, vocab: int, dtype, out) -> None:
    """`training.steps` plain steps on random tokens; one JSON record per step to `out`."""
    import torch
    import torch.nn.functional as F

    from models.numerics import at_least_float32

    t, o = cfg.training, cfg.optimizer
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
        weight_decay=o.weight_decay, foreach=True,
    )  # fmt: skip
    b, s = t.local_batch_size, t.seq_len
    data = torch.randint(0, vocab, (t.steps, b, s + 1))
    params = list(model.parameters())
    for step in range(t.steps):
        t0 = time.perf_counter()
        batch = data[step]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != params[0].dtype):
            logits = model(inputs)
        loss = F.cross_entropy(at_least_float32(logits.flatten(0, 1)), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "kind": "train", "loss": value, "step_time_s": dt}
        rec["tokens_per_sec"] = b * s / dt
        rec["memory_gib"] = 0.0
        out.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    import torch

    from job_config import parse_args
    from models import model_args_for

    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    folder = Path(cfg.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.debug.seed)
    args = model_args_for(cfg, cfg.training.seq_len, vocab_size(cfg))
    model = build_model(cfg, args)
    dtype = compute_dtype(argv)  # bf16 compute: plain PyTorch's way is autocast
    with open(folder / "metrics.jsonl", "w") as out:
        train(cfg, model, args.vocab_size, dtype, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

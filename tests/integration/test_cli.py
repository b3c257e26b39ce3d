"""train.py's command line in a real process: --help, errors before any work, the 405B dry run."""

import subprocess
import sys

import torch
from dist_utils import ROOT


def _train(*args, **kw):
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def test_train_cli_help_and_errors_before_any_work():
    out = _train("--help")
    assert out.returncode == 0 and "--training.local_batch_size" in out.stdout
    out = _train("--model.flavor", "9B")
    assert out.returncode == 2
    assert "model.flavor = '9B' is not a flavor of 'llama3'" in out.stderr
    out = _train("--model.dim", "100")
    assert out.returncode == 2
    assert "model shape: dim = 100 is not a multiple of n_heads = 16" in out.stderr
    out = _train("--training.dataset", "text", "--training.dataset_path", "/nonexistent/*.txt")
    assert out.returncode == 2
    assert "training.dataset_path: dataset_path '/nonexistent/*.txt' matches no text" in out.stderr
    if not torch.cuda.is_available():
        out = _train("--training.device", "cuda")
        assert out.returncode == 2 and "no CUDA device is visible" in out.stderr
    env = {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "localhost", "PATH": ""}
    out = _train("--parallelism.tensor_parallel_degree", "2", env=env)
    assert out.returncode == 2
    assert "World size 3 is not divisible" in out.stderr


def test_dry_run_405b_counts_parameters_in_seconds():
    out = _train("--config", "llama3_405b", "--job.dry_run", "true")
    assert out.returncode == 0, out.stderr
    count = int(out.stdout.split("parameters")[0].split(":")[-1].replace(",", "").strip())
    assert count == 405_853_388_800  # Meta's published Llama 3.1 405B total

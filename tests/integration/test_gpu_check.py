"""scripts/gpu_check.sh runs only where a GPU is lent, so its arguments are checked here: the
config passes train.py's checks at the 8B shape, and the synthetic Llama 3-sized tokenizer
it builds trains on the bundled corpus."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dist_utils import Run

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_arguments_pass_the_config_checks(tmp_path):
    tokenizer = tmp_path / "shaped.tiktoken"
    env = {**os.environ, "CHECK_ONLY": "1", "PYTHON": sys.executable, "TOKENIZER": str(tokenizer)}
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # 20 layers of the 8B shape with the 128,256-token vocabulary
    assert "llama3 8B: 5,412,917,248 parameters" in out.stdout


def test_attention_check_passes_on_this_device(tmp_path):
    """The attention check gpu_check.sh runs first on CUDA, here on CPU (the block-sparse
    kernel and SDPA): every spec, sinks included, within its float32 tolerance of float64,
    table written."""
    table = tmp_path / "check.md"
    cmd = [sys.executable, "scripts/attention_check.py", "--device", "cpu", "--dtype",
           "float32", "--seq", "384", "--output", str(table)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [r for r in table.read_text().splitlines() if r.startswith("| ") and "yes" in r]
    assert len(rows) == 6 and any(r.startswith("| sinks") for r in rows), table.read_text()


def test_shaped_tokenizer_has_llama3_vocabulary_and_trains(tmp_path, pool):
    from data.tokenizer import build_tokenizer

    path = tmp_path / "shaped.tiktoken"
    cmd = [sys.executable, "scripts/make_shaped_tokenizer.py", str(path), "128000"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    tok = build_tokenizer(str(path))
    assert tok.vocab_size == 128_256
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids[1:-1]) > 255  # merges

    # bench.py counts FLOPs (and MFU) with the tokenizer's vocabulary, as train.py builds it
    from scripts import bench_measure

    shape = ["--config", "tests/tiny_model.toml"]
    _, sample_params = bench_measure.flops_per_token(shape)
    _, shaped_params = bench_measure.flops_per_token([*shape, "--model.tokenizer_path", str(path)])
    assert shaped_params - sample_params == 2 * 64 * (128_256 - 4096)  # embedding + output

    args = ["--model.tokenizer_path", str(path), "--training.steps", "2",
            "--training.local_batch_size", "2"]  # fmt: skip
    dump = pool.launch(__name__, [Run("shaped", 1, args)])["shaped"].check().folder
    records = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses) == 2 and 11.0 < losses[0] < 12.5  # ~ln(128,256) = 11.76 at init

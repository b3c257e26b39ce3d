"""Qwen3 dense family: model, published flavors, registry entry.

Published shapes from the Qwen3 model cards' configs (vocabulary 151,936, RMSNorm eps 1e-6,
RoPE theta 1e6, head_dim 128; the 0.6B, 1.7B and 4B models tie the output projection to the
embeddings). `vocab_size` is replaced by the tokenizer's when one is loaded.
"""

from models.qwen3.model import Qwen3, Qwen3Args

flavors = {
    # tied, and head_dim (32) != dim / n_heads (64): the tests exercise both
    "debugmodel": Qwen3Args(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=512, vocab_size=4096
    ),
    "debugmodel_untied": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=512,
        vocab_size=4096,
        tie_embeddings=False,
    ),  # fmt: skip
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728),
    "8B": Qwen3Args(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, tie_embeddings=False
    ),
    "14B": Qwen3Args(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408, tie_embeddings=False
    ),
    "32B": Qwen3Args(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600, tie_embeddings=False
    ),
}


def parallelize(*args, **kwargs):
    from models.qwen3.parallelize import parallelize_qwen3  # imports torch.distributed lazily

    return parallelize_qwen3(*args, **kwargs)


def pipeline(*args, **kwargs):
    from models.qwen3.parallelize import pipeline_qwen3

    return pipeline_qwen3(*args, **kwargs)


def validate(cfg, args) -> list[str]:
    from models.qwen3.parallelize import validate_qwen3

    return validate_qwen3(cfg, args)


def block_activation_bytes(*args) -> float:
    from models.qwen3.parallelize import qwen3_block_activation_bytes

    return qwen3_block_activation_bytes(*args)


__all__ = [
    "Qwen3",
    "Qwen3Args",
    "block_activation_bytes",
    "flavors",
    "parallelize",
    "pipeline",
    "validate",
]

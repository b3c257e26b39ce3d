"""What the framework needs to know to parallelize Llama 3, as data: its tensor-parallel plan
and the activation bytes one block saves (for the estimator). The generic decoder path
(`parallelisms/decoder.py`) applies them; nothing here composes parallelisms."""

from __future__ import annotations

from models.tp_plan import TPPlan, decoder_tp_plan


def llama_tp_plan(loss_parallel: bool) -> TPPlan:
    """The shared decoder's Megatron-style plan with sequence parallelism, as it is
    (`models.tp_plan.decoder_tp_plan`): Llama's blocks are the shared decoder blocks."""
    return decoder_tp_plan(loss_parallel)


def llama_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Llama block saves for backward (16-bit compute; attention keeps no
    scores), counted from the tensors autograd keeps: each RMSNorm its input and output in fp32
    and the 16-bit matmul input (2 x 10 h), attention q and its output (4 h), k and v at the
    key/value width kv (4 kv: grouped-query attention never repeats them), the attention's
    fp32 log-sum-exp per head (4 n_heads) and the norms' fp32 statistics (8), SwiGLU's w1 and
    w3 outputs, SiLU output and product (8 f), per token: sb(24 h + 4 kv + 8 f + 4 n_heads + 8)
    (sbh(28 + 8f/h) without grouping; Korthikanti's GPT count is 34 sbh with a 4h GeLU MLP);
    divided by t under TP + sequence parallelism. The estimator's activation figure per layer,
    in every AC mode but full."""
    kv = args.n_kv_heads * args.head_dim
    per_token = 24 * args.dim + 4 * kv + 8 * args.ffn_hidden_dim + 4 * args.n_heads + 8
    return float(s) * b * per_token / t

"""The building blocks the decoder families share, in plain PyTorch (no parallelism): grouped-query
attention, the SwiGLU feed-forward, the pre-norm residual block and the decoder shell. A family
supplies what differs (its attention, its RoPE table, its initialisation); the shell keeps the
layout every family follows:

- blocks in `layers`, a ModuleDict keyed by layer index, so a pipeline stage is the model with
  other layers deleted while checkpoint keys stay those of the whole model;
- `tok_embeddings`, `norm` and `output`, set to None on pipeline stages that lack them (the
  forward skips them: a stage takes and returns hidden states);
- a non-persistent RoPE table, filled by `init_buffers` after materialisation, and indexed by
  each token's position (a context-parallel rank holds other positions than 0..seq-1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import mtp
from models.attention import (
    AttentionBatch,
    AttentionCore,
    AttentionSpec,
    attention_batch,
    attention_specs,
)
from models.numerics import at_least_float32_dtype


class GroupedQueryAttention(nn.Module):
    """Grouped-query self-attention: q, k, v projections (n_kv_heads key/value heads, not
    repeated here), the family's RoPE convention `apply_rope(x [batch, seq, heads, head_dim],
    table)`, optionally an RMSNorm over each query and key head before RoPE (`qk_norm_eps`:
    Qwen3's QK-norm; None = none), the attention core computing the layer's `spec`
    (models/attention.py; context parallelism swaps it for its all-gathering version) and the
    output projection; `bias`: the four projections have biases (gpt-oss)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        apply_rope,
        qk_norm_eps: float | None = None,
        spec: AttentionSpec | None = None,
        bias: bool = False,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.apply_rope = apply_rope
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.core = AttentionCore(spec, n_heads)
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: AttentionBatch | None = None
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.apply_rope(q, rope), self.apply_rope(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Hugging Face: down(silu(gate x) * up x))."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PreNormBlock(nn.Module):
    """h = x + attention(attention_norm(x)); out = h + mlp(ffn_norm(h)), the MLP registered
    under `mlp_name` (a family's TP plan and checkpoint names use it: `feed_forward`, `moe`)."""

    mlp_name = "feed_forward"

    def __init__(self, attention: nn.Module, mlp: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.attention = attention
        setattr(self, self.mlp_name, mlp)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: AttentionBatch | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, batch)
        return h + getattr(self, self.mlp_name)(self.ffn_norm(h))


class Decoder(nn.Module):
    """Token embeddings -> blocks -> final RMSNorm -> output projection, with the RoPE table the
    blocks read. A family subclasses it with its `rope_table(args, device, dtype)` and
    `init_param`; its args give `dim`, `vocab_size`, `norm_eps`, `tie_embeddings`."""

    @staticmethod
    def rope_table(args, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError("a decoder family gives its RoPE table")

    def __init__(self, args, blocks: list[nn.Module]):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", self.rope_table(args), persistent=False)
        self.attention_specs = attention_specs(self)  # whose masks a forward builds
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_embeddings` the output projection is the token embedding matrix."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def tied_parameters(self) -> dict[str, str]:
        """Shared parameters as {the second use's name: the parameter's own name}: what a
        pipeline split that puts the two uses on two stages keeps as two equal copies."""
        return {"output.weight": "tok_embeddings.weight"} if self.args.tie_embeddings else {}

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        key_documents: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab] (a pipeline stage may take and
        return hidden states [batch, seq, dim] instead). `positions` [batch, seq]: each token's
        position in its sequence, for RoPE and masks (default 0..seq-1; a context-parallel rank
        holds other positions); `documents` [batch, seq]: each token's document index (document
        masking); `key_positions` and `key_documents`: those of the keys when they are not the
        queries (context parallelism's gathered keys). The block masks of the layers' attention
        specs are built here, once per micro-batch (models/attention.py). `mtp_labels`
        [batch, seq, depth + 1]: in training, the multi-token-prediction modules of a model
        that has them (models/mtp.py) add their losses to the backward of the logits."""
        mtp_on = self.training and mtp_labels is not None and bool(mtp.modules(self))
        if mtp_on:
            h, *embedded = mtp.embedded_inputs(self.tok_embeddings, tokens, mtp_labels)
        else:
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_rows(positions)
        batch = attention_batch(
            self.attention_specs, tokens.shape[0], tokens.shape[1], tokens.device,
            positions, documents, key_positions, key_documents,
        )  # fmt: skip
        for layer in self.layers.values():
            h = layer(h, rope, batch)
        h = self.norm(h) if self.norm is not None else h
        if mtp_on:
            return mtp.logits_with_losses(self, h, embedded, rope, batch, mtp_labels)
        return self.output(h) if self.output is not None else h

    def rope_rows(self, positions: torch.Tensor | None):
        """What the blocks get as `rope`: the table (positions 0, 1, ...) or each token's rows. A
        family with several tables (Gemma 3's local and global layers) returns them all."""
        return self.rope if positions is None else self.rope[positions]

    def init_buffers(self, device: torch.device | str) -> None:
        """Fills the non-persistent RoPE table (after `to_empty` from the meta device), in the
        dtype the model was built or cast in (at least float32)."""
        dtype = at_least_float32_dtype(self.rope.dtype)
        self.rope = self.rope_table(self.args, torch.device(device), dtype)

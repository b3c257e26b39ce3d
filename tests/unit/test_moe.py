"""The Qwen3-MoE layer on one process: routing, the grouped expert compute against the
per-expert loop, the load-balancing loss against transformers' and its global (layout-free)
split, the bias balancing, expert parallelism's row permutation, the config checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from job_config import ConfigError, parse_args
from models.moe import MoE, expert_swiglu, grouped_matmul
from models.moe_routing import after_optimizer_step, layer_stats, summarize
from models.qwen3_moe import flavors
from parallelisms.expert_parallel import _expert_major

ARGS = dataclasses.replace(flavors["debugmodel"], dim=32, moe_ffn_dim=16, moe_aux_loss_coeff=0.01)


def _moe(seed: int = 0, **changes) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dataclasses.replace(ARGS, **changes))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: softmax scores, top-k, renormalised weights, weighted experts."""
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = F.softmax(moe.router(x[t]).float(), dim=-1)
        top = torch.topk(scores + moe.expert_bias, moe.top_k).indices
        w = scores[top] / scores[top].sum()
        for weight, i in zip(w, top.tolist()):
            h = F.silu(x[t] @ e.w1[i].T) * (x[t] @ e.w3[i].T)
            out[t] += weight * (h @ e.w2[i].T)
    return out


def test_moe_forward_equals_routing_each_token_by_hand():
    moe = _moe().eval()
    x = torch.randn(2, 5, ARGS.dim)
    got = moe(x)
    want = _by_hand(moe, x.reshape(-1, ARGS.dim)).view_as(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _deepseek_pair(n_groups: int, topk_groups: int, top_k: int = 3):
    """Transformers' DeepSeek-V3 MoE layer (random weights and correction bias) and ours with
    its weights, in float32 (transformers' router computes in float32 whatever the model's
    dtype): 8 experts, `top_k` of them from the best `topk_groups` of `n_groups`
    groups, sigmoid scores, renormalised weights times 2.5, two shared experts."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8,
                              num_experts_per_tok=top_k, n_group=n_groups, topk_group=topk_groups,
                              n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(3)
    theirs = DeepseekV3MoE(config)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    theirs.gate.e_score_correction_bias.normal_(std=0.1)
    ours = MoE(dataclasses.replace(
        ARGS, dim=32, moe_ffn_dim=16, n_experts=8, top_k=top_k, moe_score_func="sigmoid",
        moe_n_groups=n_groups, moe_topk_groups=topk_groups, moe_route_scale=2.5,
        n_shared_experts=2, moe_grouped_mm=False,
    ))  # fmt: skip
    gate_up, f = theirs.experts.gate_up_proj.detach(), 16
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.w1.copy_(gate_up[:, :f])
        ours.experts.w3.copy_(gate_up[:, f:])
        ours.experts.w2.copy_(theirs.experts.down_proj)
        shared = theirs.shared_experts
        ours.shared_experts.w1.weight.copy_(shared.gate_proj.weight)
        ours.shared_experts.w3.weight.copy_(shared.up_proj.weight)
        ours.shared_experts.w2.weight.copy_(shared.down_proj.weight)
    return theirs, ours


@pytest.mark.parametrize("n_groups,topk_groups", [(4, 2), (1, 1)])
def test_deepseek_routing_and_shared_experts_equal_transformers(n_groups, topk_groups):
    """Sigmoid scores, group-limited choice over the biased scores, renormalised and scaled
    weights, shared experts: the layer's output and gradients equal transformers'
    `DeepseekV3MoE` (float32: the two differ in the order of float32 sums), and every token's
    experts lie in its best groups."""
    theirs, ours = _deepseek_pair(n_groups, topk_groups)
    x = torch.randn(2, 24, 32, requires_grad=True)
    want, got = theirs(x), ours.eval()(x)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    gx_theirs = torch.autograd.grad(want, (x, theirs.gate.weight), grad)
    gx_ours = torch.autograd.grad(got, (x, ours.router.weight), grad)
    for a, b in zip(gx_ours, gx_theirs):
        torch.testing.assert_close(a, b)
    _, _, chosen, weights = ours.route(x.detach().reshape(-1, 32))
    torch.testing.assert_close(weights.sum(-1), torch.full((48,), 2.5))
    groups = chosen // (8 // n_groups)
    assert all(len(set(row.tolist())) <= topk_groups for row in groups)


def test_sigmoid_balance_loss_reads_each_tokens_scores_as_a_distribution():
    """With sigmoid scores the logged balance loss is coeff x E x sum_i f_i P_i with P_i the
    mean of each token's scores divided by their sum (they do not add up to one)."""
    _, ours = _deepseek_pair(4, 2)
    ours.aux_coeff = 0.01
    x = torch.randn(40, 32)
    ours.train()(x)
    _, scores, chosen, _ = ours.route(x)
    f = torch.bincount(chosen.flatten(), minlength=8) / 40
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    want = 0.01 * 8 * (f * p).sum()
    torch.testing.assert_close(ours.aux_loss_sum, want.to(ours.aux_loss_sum.dtype))


def test_grouped_compute_equals_the_per_expert_loop_forward_and_backward():
    """`torch._grouped_mm`, the padded batched matmul (used where the device lacks it) and the
    loop agree, in values and gradients, with an expert that receives no rows."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(int(counts.sum()), 8, requires_grad=True)
    w = [torch.randn(4, 12, 8, requires_grad=True), torch.randn(4, 8, 12, requires_grad=True),
         torch.randn(4, 12, 8, requires_grad=True)]  # fmt: skip
    results = []
    for grouped in (True, False):
        y = expert_swiglu(x, counts, *w, grouped=grouped)
        grads = torch.autograd.grad(y.square().sum(), [x, *w])
        results.append((y, grads))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    assert torch.__dict__.get("_grouped_mm") is not None  # torch 2.13 CPU: the grouped path ran


def _padded(x, w, counts):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(x[start : start + n] @ w[e])
        start += n
    return torch.cat(out)


def test_padded_batched_matmul_path(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    counts = torch.tensor([2, 0, 3])
    x, w = torch.randn(5, 4), torch.randn(3, 4, 7)
    torch.testing.assert_close(grouped_matmul(x, w, counts), _padded(x, w, counts))


def test_load_balancing_loss_equals_transformers():
    """The logged load-balancing loss is Switch Transformer's, as transformers computes it for
    Qwen3-MoE (its `load_balancing_loss_func`) from the same router logits."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    moe = _moe().train()
    x = torch.randn(12, ARGS.dim)
    moe(x)
    want = load_balancing_loss_func((moe.router(x),), ARGS.n_experts, ARGS.top_k)
    torch.testing.assert_close(moe.aux_loss_sum, ARGS.moe_aux_loss_coeff * want.float())


def _aux_grad(moe: MoE, x: torch.Tensor, other=None) -> torch.Tensor:
    """The router gradient of the auxiliary loss alone on `x`; `other`: the statistics of the
    tokens another data-parallel rank holds (what `reduce_stats` adds under DP)."""
    moe.zero_grad()
    moe.reduce_stats = None if other is None else (lambda stats: stats + other)
    logits, scores, chosen, _ = moe.route(x)
    moe.aux_loss(logits, scores, moe.global_stats(chosen, scores)).backward()
    return moe.router.weight.grad.clone()


def test_aux_loss_split_over_ranks_sums_to_one_process():
    """Two data-parallel halves, each with the global statistics, give gradients that sum to
    one process's on the whole batch: the loss is global, not per rank."""
    moe = _moe(moe_z_loss_coeff=0.01).train()
    x = torch.randn(16, ARGS.dim)
    a, b = x[:8], x[8:]
    with torch.no_grad():
        stats = [moe.global_stats(*_chosen_scores(moe, h)) for h in (a, b)]
    whole = _aux_grad(moe, x)
    halves = _aux_grad(moe, a, stats[1]) + _aux_grad(moe, b, stats[0])
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-8)
    per_rank = _aux_grad(moe, a) + _aux_grad(moe, b)  # each half on its own statistics
    assert not torch.allclose(per_rank, whole, rtol=1e-3)


def _chosen_scores(moe, x):
    _, scores, chosen, _ = moe.route(x)
    return chosen, scores


def test_aux_loss_reaches_the_router_through_the_output():
    """`AuxLossGrad`: the block output carries the auxiliary loss's gradient, scaled by
    `loss_scale` exactly once (the gradient is linear in it), without changing the output."""
    moe = _moe(moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1).train()
    x = torch.randn(10, ARGS.dim)
    outs, grads = [], []
    for scale in (0.0, 1.0, 2.0):
        moe.zero_grad()
        moe.loss_scale = scale
        outs.append(moe(x))
        outs[-1].sum().backward()
        grads.append(moe.router.weight.grad.clone())
    torch.testing.assert_close(outs[0], outs[1])
    aux = grads[1] - grads[0]
    assert aux.abs().max() > 1e-2
    torch.testing.assert_close(grads[2] - grads[0], 2 * aux, rtol=1e-4, atol=1e-5)


def test_recomputed_forward_counts_tokens_once():
    """Activation checkpointing runs forward again in backward: the expert counts stay one
    forward's."""
    from torch.utils.checkpoint import checkpoint

    moe = _moe().train()
    x = torch.randn(6, ARGS.dim, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 6 * ARGS.top_k
    once = moe.aux_loss_sum.clone()
    moe.aux_loss_sum.zero_()
    moe(x)  # the same forward without recomputation: the same logged load-balancing loss
    torch.testing.assert_close(moe.aux_loss_sum, once)


def test_bias_moves_toward_balance_and_chooses_but_does_not_weigh():
    moe = _moe(moe_bias_update_rate=0.1).train()
    moe(torch.randn(20, ARGS.dim))
    counts = moe.tokens_per_expert.clone()
    after_optimizer_step([_Part(moe)])
    want = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(moe.expert_bias, want)
    assert moe.tokens_per_expert.sum() == 0  # the next step counts afresh
    # a large bias decides the choice; the weights are still the softmax scores renormalised
    moe.eval()
    moe.expert_bias.zero_()
    moe.expert_bias[[3, 5]] = 100.0
    x = torch.randn(4, ARGS.dim)
    _, scores, chosen, weights = moe.route(x)
    assert (chosen.sort(-1).values == torch.tensor([3, 5])).all()
    picked = scores.gather(-1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))


class _Part(torch.nn.Module):
    """A model part holding one MoE layer as block "0"."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"moe": moe})})


def test_router_stats_and_idle_expert_warning():
    moe = _moe().train()
    part = _Part(moe)
    for _ in range(3):
        moe.tokens_per_expert.copy_(torch.tensor([4.0, 0, 2, 2, 0, 0, 0, 0]))
        after_optimizer_step([part])
    stats = layer_stats([part])["0"]
    assert (stats["max_load"], stats["min_load"], stats["idle"]) == (4.0, 0.0, 3.0)
    record, warnings = summarize({"0": stats, "1": dict(stats, idle=0.0)}, idle_warn_steps=3)
    assert record["idle_steps"] == 3.0 and len(warnings) == 1 and "layer(s) 0 " in warnings[0]
    assert summarize({"0": stats}, idle_warn_steps=4)[1] == []


def test_expert_major_permutation():
    """Rows arrive per source rank, each source's rows grouped by local expert; the permutation
    groups them by expert, source rank next."""
    received = torch.tensor([[2, 1], [0, 3]])  # source 0 sends 2 rows for expert 0, 1 for 1
    rows = torch.tensor([0, 1, 2, 3, 4, 5])  # arrival: s0e0 s0e0 s0e1 s1e1 s1e1 s1e1
    assert rows[_expert_major(received)].tolist() == [0, 1, 2, 3, 4, 5]
    received = torch.tensor([[1, 1], [1, 1]])  # arrival: s0e0 s0e1 s1e0 s1e1
    assert _expert_major(received).tolist() == [0, 2, 1, 3]


MOE_CLI = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]


def _ep_cp(ep: int, cp: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(ep),
            "--parallelism.context_parallel_degree", str(cp)]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--parallelism.expert_parallel_degree", "2"], 2, "has no experts"),
        (["--moe.aux_loss_coeff", "0.1"], 1, "has no moe_aux_loss_coeff .*set by moe.aux_"),
        (["--moe.idle_warn_steps", "5"], 1, "moe.idle_warn_steps set but .* has no experts"),
        ([*MOE_CLI, "--parallelism.expert_parallel_degree", "3"], 6, "must divide the 8 experts"),
        ([*MOE_CLI, "--parallelism.expert_parallel_degree", "4"], 2, "must divide the data-"),
        (
            [*MOE_CLI, *_ep_cp(2, 4), "--training.seq_len", "32"],
            8,
            "EP degree must be a multiple of the CP degree",
        ),
        ([*MOE_CLI, *_ep_cp(4, 2), "--training.seq_len", "32"], 2, "must divide the data-"),
    ],
)
def test_bad_moe_configs_are_refused_before_any_process_group(argv, world, message):
    from training.preflight import check_config

    cfg = parse_args(["--training.device", "cpu", *argv])
    with pytest.raises((ConfigError, ValueError), match=message):
        check_config(cfg, world)


def test_ep_ranks_are_drawn_from_the_shard_and_cp_ranks():
    """EP 4 x CP 2 x TP 2 on 16 ranks (fake group, rank 0): the EP group is the innermost 4 of
    dp_shard x cp (both CP ranks of a sequence in it), the experts' FSDP ranks the rest, and
    every dense dimension the ranks it has without EP."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(
        world_size=16, dp_replicate=1, dp_shard=4, tp=2, pp=1, ep=4, cp=2
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        dims.build_mesh("cpu")
        ranks = {n: dims.dim(n).mesh.tolist() for n in ("ep", "dp_shard_mod_ep", "dp_shard",
                                                         "dp_shard_cp", "cp", "tp")}  # fmt: skip
    finally:
        dist.destroy_process_group()
    assert ranks == {
        "ep": [0, 2, 4, 6],  # (dp_shard_in_ep, cp) of the (dp_shard, cp, tp) = (4, 2, 2) ranks
        "dp_shard_mod_ep": [0, 8],
        "dp_shard": [0, 4, 8, 12],
        "dp_shard_cp": [0, 2, 4, 6, 8, 10, 12, 14],
        "cp": [0, 2],
        "tp": [0, 1],
    }

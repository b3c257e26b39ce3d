"""DeepSeek-V3's model (models/deepseek_v3/model.py) against Hugging Face's
`DeepseekV3ForCausalLM`, in this process: the logits equal transformers' (latent attention with
and without the query bottleneck, YaRN with DeepSeek's mscale, dense then MoE blocks with
group-limited sigmoid routing and shared experts), and each of those features moves them; the
conversion scripts round-trip a checkpoint both ways, names and config.json invert with their
refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_round_trip import round_trip

from models.deepseek_v3.hf import (
    args_from_hf_config,
    config_with_dtype,
    from_hf,
    from_hf_name,
    to_hf_name,
)
from models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args

transformers = pytest.importorskip("transformers")

# HF's float64 model rounds to float32 in its RMSNorm (`x.float()`), its RoPE table (float32
# angles) and its router (float32 logits), so ours in float64 differ from its logits by float32
# rounding. Measured (2026-12-07): at most 1.3e-6 (logits of magnitude up to 3.4); kept at 4x.
# Each feature left out moves them by more than 1e-2 (test_each_feature_moves_the_logits).
LOGITS_TOL = 5e-6
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=16)  # fmt: skip
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_config(**kw):
    # 3 layers: 1 dense, 2 MoE; 8 experts in 4 groups, 2 groups kept, 3 experts per token
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, max_position_embeddings=64,
        rope_parameters=YARN, attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**fields, **kw})


def _args(config) -> DeepSeekV3Args:
    c, rope = config, config.rope_parameters
    return DeepSeekV3Args(
        dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_attention_heads, head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
        vocab_size=c.vocab_size, max_seq_len=c.max_position_embeddings,
        q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, ffn_dim=c.intermediate_size,
        n_dense_layers=c.first_k_dense_replace, n_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok, moe_ffn_dim=c.moe_intermediate_size,
        n_shared_experts=c.n_shared_experts, moe_n_groups=c.n_group,
        moe_topk_groups=c.topk_group, moe_route_scale=c.routed_scaling_factor,
        rope_theta=rope["rope_theta"], rope_factor=rope["factor"],
        rope_old_context=rope["original_max_position_embeddings"],
        rope_beta_fast=rope["beta_fast"], rope_beta_slow=rope["beta_slow"],
        rope_mscale=rope["mscale"], rope_mscale_all_dim=rope["mscale_all_dim"],
        moe_grouped_mm=False,
    )  # fmt: skip


def _pair(**config):
    """A tiny random DeepseekV3ForCausalLM (float64, weights of std 0.5, norms 0.2 x (1 +- 0.2),
    a non-zero correction bias) and ours with its weights."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(_hf_config(**config)).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            norm = 0.2 * (1 + 0.2 * torch.randn_like(p))
            p.copy_(norm if "norm" in name else 0.5 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    args = _args(hf.config)
    ours = DeepSeekV3(args).double().eval()
    ours.init_buffers("cpu")
    # transformers' in-memory names (the experts fused) through the family's Hugging Face import
    ours.load_state_dict(from_hf(dict(hf.state_dict()), args))
    return hf, ours


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_logits_match_transformers(q_lora_rank):
    hf, ours = _pair(q_lora_rank=q_lora_rank)
    assert isinstance(ours.layers["0"].feed_forward, torch.nn.Module)
    assert ours.layers["1"].moe.shared_experts.w1.weight.shape == (32, 64)
    with torch.no_grad():
        got, want = ours(TOKENS), hf(TOKENS).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_TOL)


@pytest.mark.parametrize(
    "change",
    [dict(rope_mscale_all_dim=1.0), dict(moe_n_groups=1, moe_topk_groups=1),
     dict(moe_route_scale=1.0), dict(n_shared_experts=0), dict(rope_factor=1.0)],
    ids=lambda c: next(iter(c)),
)  # fmt: skip
def test_each_feature_moves_the_logits(change):
    """Without any one feature the logits move far beyond LOGITS_TOL: each is exercised."""
    _, ours = _pair()
    other = DeepSeekV3(dataclasses.replace(ours.args, **change)).double().eval()
    other.init_buffers("cpu")
    other.load_state_dict(ours.state_dict(), strict=False)  # less the shared experts, if gone
    with torch.no_grad():
        moved = (other(TOKENS) - ours(TOKENS)).abs().max().item()
    assert moved > 1e-2, (change, moved)


def test_the_published_flavor_has_the_published_parameter_count():
    """671B: transformers' DeepseekV3ForCausalLM of the published config holds 671,026,404,352
    parameters (multi-token prediction not included); ours, built on the meta device, too."""
    from models.deepseek_v3 import flavors

    with torch.device("meta"):
        model = DeepSeekV3(flavors["671B"])
    assert sum(p.numel() for p in model.parameters()) == 671_026_404_352


def test_converts_both_ways_by_its_family_adapter(tmp_path):
    """convert_from_hf picks DeepSeek-V3 by model_type (the per-expert files transformers
    writes), convert_to_hf by the family the checkpoint records; the weights come back bit for
    bit, the correction bias among them, and the re-exported model computes the same."""
    hf, _ = _pair()
    hf = hf.float()

    def load(folder):
        return transformers.DeepseekV3ForCausalLM.from_pretrained(
            folder, attn_implementation="eager", experts_implementation="eager"
        )

    spec, args, again = round_trip(hf, tmp_path, TOKENS, load)
    assert spec.name == "deepseek_v3"
    assert dataclasses.replace(args, moe_grouped_mm=False) == _args(hf.config)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(again.state_dict()[bias], hf.state_dict()[bias])
    assert hf.state_dict()[bias].abs().min() > 0


def test_names_and_config_round_trip():
    from models.deepseek_v3 import flavors

    args = flavors["debugmodel"]
    with torch.device("meta"):
        names = list(DeepSeekV3(args).state_dict())
    plain = [n for n in names if ".moe.experts." not in n]
    assert all(from_hf_name(to_hf_name(n, args), args) == n for n in plain)
    assert len({to_hf_name(n, args) for n in plain}) == len(plain)
    config = config_with_dtype(args, torch.bfloat16)
    again = transformers.DeepseekV3Config(**config)
    assert args_from_hf_config(again.to_dict()) == args
    # one query projection and plain RoPE (whose config states no old context)
    plain = dataclasses.replace(args, q_lora_rank=0, rope_factor=1.0, rope_old_context=4096)
    assert args_from_hf_config(config_with_dtype(plain, torch.float32)) == plain
    for bad, match in (
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ):
        with pytest.raises(ValueError, match=match):
            args_from_hf_config({**config, **bad})


def test_import_drops_the_prediction_layer_and_refuses_fp8():
    """The published checkpoint's layer past num_hidden_layers (multi-token prediction) is left
    out, as transformers does; FP8 weights with their block scales are refused with the fix."""
    hf, ours = _pair()
    sd = dict(hf.state_dict())
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(2, 2),
             "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(2, 2)}  # fmt: skip
    assert from_hf({**sd, **extra}, ours.args).keys() == ours.state_dict().keys()
    scale = {"model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="FineGrainedFP8Config"):
        from_hf({**sd, **scale}, ours.args)


def test_the_published_config_gives_the_published_flavor():
    """transformers' default DeepseekV3Config is the published 671B's: it reads as our 671B
    flavor but for what that config leaves out (YaRN: its default RoPE is unscaled; the
    context it states) and its one multi-token-prediction layer."""
    from models.deepseek_v3 import flavors

    got = args_from_hf_config(transformers.DeepseekV3Config().to_dict())
    want = dataclasses.replace(flavors["671B"], rope_factor=1.0, max_seq_len=4096, mtp_depth=1)
    assert got == want


# ------------------------------------------------------------------ multi-token prediction
def _with_prediction(hf, ours):
    """transformers' multi-token-prediction model on `hf` (one module, random weights as
    `_pair`'s) and ours with depth 1 holding the same weights, through the family's import
    of the published checkpoint's names (module 0 as layer n_layers)."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(1)
    ref = MtpModel(hf, 1).double().eval()
    with torch.no_grad():
        for name, p in ref.layers.named_parameters():
            norm = 0.2 * (1 + 0.2 * torch.randn_like(p))
            p.copy_(norm if "norm" in name else 0.5 * torch.randn_like(p))
    n = ours.args.n_layers
    published = {}
    for name, t in ref.layers.state_dict().items():  # "0.mtp_block.self_attn...", "0.enorm..."
        k, rest = name.split(".", 1)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        published[f"model.layers.{n + int(k)}.{rest}"] = t
    published["model.layers.3.embed_tokens.weight"] = hf.model.embed_tokens.weight  # dropped
    args = dataclasses.replace(ours.args, mtp_depth=1)
    with_mtp = DeepSeekV3(args).double().eval()
    with_mtp.init_buffers("cpu")
    with_mtp.load_state_dict(from_hf({**dict(hf.state_dict()), **published}, args))
    return ref, with_mtp


def _prediction_logits(model, tokens, next_tokens):
    """Our module 0's logits at every position, from the model's final normed hidden state."""
    hidden = {}
    handle = model.norm.register_forward_hook(lambda m, i, out: hidden.setdefault("h", out))
    main = model(tokens)
    handle.remove()
    out = model.mtp["0"](hidden["h"], model.tok_embeddings(next_tokens), model.rope, None)
    return main, model.output(out)


def test_prediction_module_matches_transformers():
    """Module 0 computes transformers' MtpModel (DeepSeek-V3's layer 61: both norms, the
    projection of [embedding, hidden], an MoE block, the final norm, the shared head) from the
    main model's last hidden state and the next tokens, to float32 rounding."""
    hf, ours = _pair()
    ref, ours = _with_prediction(hf, ours)
    tokens, next_tokens = TOKENS[:, :-1], TOKENS[:, 1:]
    with torch.no_grad():
        main, got = _prediction_logits(ours, tokens, next_tokens)
        last = hf.model(tokens).last_hidden_state
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        state = ref.forward_layer(0, last, positions, None, input_ids=next_tokens)
        want = ref._project_to_logits(state)
    torch.testing.assert_close(main, hf(tokens).logits, rtol=0, atol=LOGITS_TOL)
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_TOL)
    assert (got - main).abs().max() > 1e-2  # a prediction of its own


def test_prediction_losses_train_with_the_main_one():
    """In training, with the labels of later positions (`later_labels`), the main logits are
    unchanged (to float64 rounding); each module's loss is its logits' token-loss sum over the step's token count
    (what the trainer logs), and the gradients are those of main + weight x that loss."""
    from models import mtp
    from training.inputs import later_labels
    from training.loss import StepLoss, cross_entropy_sum

    hf, ours = _pair()
    _, ours = _with_prediction(hf, ours)
    ours.train()
    tokens, labels = TOKENS[:, :-1], TOKENS[:, 1:]
    step_loss = StepLoss(cross_entropy_sum)
    step_loss.per_rank_tokens = float(labels.numel())
    mtp.set_loss([ours], step_loss, 0.25)
    logits = ours(tokens, mtp_labels=later_labels(labels, 1))
    step_loss(logits, labels).backward()
    logged = mtp.take_logged_losses([ours])
    got = {n: p.grad.clone() for n, p in ours.named_parameters()}
    assert mtp.take_logged_losses([ours]) is None  # read once

    ours.zero_grad()
    main, predicted = _prediction_logits(ours, tokens, labels)  # eval path: no losses attached
    # (one output matmul over the main and predicted states sums in another order: 1e-15)
    torch.testing.assert_close(logits.detach(), main.detach(), rtol=0, atol=1e-12)
    targets = later_labels(labels, 1)[..., 1]
    assert (targets[:, -1] == -100).all() and torch.equal(targets[:, :-1], labels[:, 1:])
    loss = step_loss(predicted, targets)
    torch.testing.assert_close(logged, loss.detach(), rtol=1e-12, atol=0)
    (step_loss(main, labels) + 0.25 * loss).backward()
    assert got.keys() == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert got["mtp.0.eh_proj.weight"].abs().max() > 0


def test_prediction_layers_convert_both_ways():
    """Module k is layer n_layers + k in Hugging Face's names (as DeepSeek publishes it) and
    `num_nextn_predict_layers` in config.json; an import keeps only the depth asked for."""
    from models.deepseek_v3 import flavors

    args = dataclasses.replace(flavors["debugmodel"], mtp_depth=2)
    with torch.device("meta"):
        names = list(DeepSeekV3(args).state_dict())
    plain = [n for n in names if ".moe.experts." not in n]
    hf_names = {to_hf_name(n, args) for n in plain}
    assert all(from_hf_name(to_hf_name(n, args), args) == n for n in plain)
    assert len(hf_names) == len(plain)
    assert {"model.layers.4.enorm.weight", "model.layers.5.shared_head.norm.weight",
            "model.layers.5.self_attn.kv_b_proj.weight"} <= hf_names  # fmt: skip
    assert args_from_hf_config(config_with_dtype(args, torch.float32)) == args
    sd = {n: torch.zeros(1) for n in hf_names}
    one = dataclasses.replace(args, mtp_depth=1)
    assert not any(n.startswith("mtp.1.") for n in from_hf(sd, one))


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--model.mtp_depth", "1"], 1, "has no mtp_depth .*set by model.mtp_depth"),
        (["--model.mtp_loss_weight", "0.1"], 1, "has no mtp_loss_weight"),
        (["--model.name", "deepseek_v3", "--model.mtp_depth", "1",
          "--parallelism.pipeline_parallel_degree", "2"], 2,
         "model.mtp_depth = 1 with parallelism.pipeline_parallel_degree = 2"),
    ],
)  # fmt: skip
def test_prediction_options_are_refused_where_they_cannot_work(argv, world, message):
    """On a family without multi-token prediction (Llama 3) its options would be ignored, and
    a pipeline split cannot run it yet: both refused before any process group."""
    from job_config import ConfigError, parse_args
    from training.preflight import check_config

    cfg = parse_args(["--training.device", "cpu", *argv])
    with pytest.raises((ConfigError, ValueError), match=message):
        check_config(cfg, world)


def test_prediction_counts_its_parameters_and_the_heads_second_use():
    """The 671B with DeepSeek's one module: 11.6B more parameters (its MoE block, projection and
    norms; the embeddings and head are shared), and its FLOPs count the output head twice."""
    from models.deepseek_v3 import SPEC, flavors
    from training.preflight import param_counts

    with torch.device("meta"):
        plain = param_counts(SPEC, DeepSeekV3(flavors["671B"]))
        model = DeepSeekV3(dataclasses.replace(flavors["671B"], mtp_depth=1))
        counts = param_counts(SPEC, model)
    assert counts.total - plain.total == 11_610_067_968
    assert plain.head_reuse is None and counts.head_reuse == 7168 * 129280
    assert counts.flops_params == counts.active_non_embedding + 7168 * 129280

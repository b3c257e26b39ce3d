"""In the float64 mode (`training.mixed_precision_param = "float64"`: weights, compute,
gradient reductions and optimizer state in float64) every layout of every family trains like
one process to near machine precision: loss and gradient norm at every step and the final
weights within `parity.FP64` (1e-10 relative), and the layout built as asked.

Why a float64 family beside the float32 ones: float32 tolerances are measured noise, and some
architectures amplify that noise far more than Llama does, so a float32 difference cannot tell
a layout bug from noise in a new family. In float64 the noise is ~1e-13, so anything above
1e-10 is a bug. Mixture of experts: routing is discrete, and in float32 a near tie can send a
token to another expert in another layout; in float64 no tie flips, so the expert loads of
every step must agree exactly too (`assert_router_parity` at the same tolerance).

Validation rides along: every run evaluates 2 global batches of the held-out split at steps
4 and 8, and the validation losses must agree at the same tolerance, whatever the data
parallelism, accumulation or pipeline split of the global batch.

Cheap by design: the tiny shape of `tests/tiny_model.toml`, 8 steps, 2 ranks except one
4-rank composition per family that needs it (2 layers; 4 for the schedules that hold 2
stages per rank).
"""

from __future__ import annotations

import pytest
import torch
from parity import (
    CHECKPOINT_ARGS,
    FP64,
    Layout,
    assert_layout,
    assert_parity,
    assert_router_parity,
    assert_series,
    by_step,
    family_pool_runs,
    final_weights,
    moe_local_blocks,
    table,
)

STEPS = 8  # the checkpoint of the last step holds the final weights
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS,
          "--training.mixed_precision_param", "float64",
          "--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2"]  # fmt: skip
MOE = ("--model.name=qwen3_moe", "--optimizer.lr=1e-3")  # lr: see test_moe_parity.py
# PP splits a rank's batch into microbatches, each with its own load-balancing loss, so the
# PP run and its reference use the per-token z-loss and the bias balancing instead
Z_BIAS = ("--moe.aux_loss_coeff=0", "--moe.z_loss_coeff=0.001", "--moe.bias_update_rate=0.001")  # fmt: skip

# reference (one process): arguments
REFERENCES = {
    "llama": (),
    "qwen3": ("--model.name=qwen3",),  # tied embeddings, QK-norm
    "gemma2": ("--model.name=gemma2",),  # soft-caps, a 12-token window on layer 0
    "gemma2_doc": ("--model.name=gemma2", "--training.document_mask=true"),
    # a sliding-window and a global layer, two RoPE tables, (1 + w) norms, scaled embeddings
    "gemma3": ("--model.name=gemma3",),
    "moe": (*MOE, "--moe.aux_loss_coeff=0.01"),
    "moe_z_bias": (*MOE, *Z_BIAS),
    # 4 layers: the V and interleaved schedules hold 2 stages per rank
    "moe_z_bias_4_layers": (*MOE, *Z_BIAS, "--model.n_layers=4"),
    "qwen3_4_layers": ("--model.name=qwen3", "--model.n_layers=4"),
    # sinks, a 16-token window on layer 0, YaRN, biases, the clamped experts (PP: Z_BIAS)
    "gpt_oss": ("--model.name=gpt_oss", "--optimizer.lr=1e-3", *Z_BIAS),
    "gpt_oss_doc": (
        "--model.name=gpt_oss",
        "--optimizer.lr=1e-3",
        *Z_BIAS,
        "--training.document_mask=true",
    ),
    # latent attention (values of their own head size), a dense then an MoE block, sigmoid
    # group-limited routing with shared experts and the balancing bias
    "deepseek": ("--model.name=deepseek_v3", "--model.n_kv_heads=4", "--optimizer.lr=1e-3"),
    # and one multi-token-prediction module (an MoE block of its own, the shared head)
    "deepseek_mtp": (
        "--model.name=deepseek_v3",
        "--model.n_kv_heads=4",
        "--optimizer.lr=1e-3",
        "--model.mtp_depth=1",
    ),
}
LLAMA, QWEN3 = REFERENCES["llama"], REFERENCES["qwen3"]
GEMMA2, GEMMA3 = REFERENCES["gemma2"], REFERENCES["gemma3"]
MOE_AUX, MOE_Z_BIAS = REFERENCES["moe"], REFERENCES["moe_z_bias"]
GPT_OSS, GPT_OSS_DOC = REFERENCES["gpt_oss"], REFERENCES["gpt_oss_doc"]
ULYSSES = ("--parallelism.context_parallel_method=ulysses",)

# A layout of each reference's model and options; global batch 8 sequences everywhere
# fmt: off
LAYOUTS = table(
    Layout("llama_fsdp2", 2, (*LLAMA, "--training.local_batch_size=4"), "llama", FP64),
    Layout("llama_zero2_accum", 2, (*LLAMA, "--parallelism.zero_stage=2", "--training.local_batch_size=2", "--training.global_batch_size=8"), "llama", FP64),
    Layout("llama_tp2_fsdp2", 4, (*LLAMA, "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "llama", FP64),
    Layout("llama_pp2", 2, (*LLAMA, "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "llama", FP64),
    Layout("llama_cp2", 2, (*LLAMA, "--parallelism.context_parallel_degree=2"), "llama", FP64),
    Layout("qwen3_fsdp2", 2, (*QWEN3, "--training.local_batch_size=4"), "qwen3", FP64),
    # tied embeddings under ZeRO 0-2: one master for the two places that share it
    Layout("qwen3_ddp", 2, (*QWEN3, "--parallelism.zero_stage=0", "--training.local_batch_size=4"), "qwen3", FP64),
    Layout("qwen3_zero2_tp2", 4, (*QWEN3, "--parallelism.zero_stage=2", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "qwen3", FP64),
    Layout("qwen3_tp2", 2, (*QWEN3, "--parallelism.tensor_parallel_degree=2"), "qwen3", FP64),
    Layout("qwen3_cp2_compile", 2, (*QWEN3, "--parallelism.context_parallel_degree=2", "--compile.enable=true"), "qwen3", FP64),
    Layout("gemma2_tp2", 2, (*GEMMA2, "--parallelism.tensor_parallel_degree=2"), "gemma2", FP64),
    Layout("gemma2_cp2_doc", 2, (*GEMMA2, "--parallelism.context_parallel_degree=2", "--training.document_mask=true"), "gemma2_doc", FP64),
    Layout("gemma3_tp2", 2, (*GEMMA3, "--parallelism.tensor_parallel_degree=2"), "gemma3", FP64),
    Layout("gemma3_cp2", 2, (*GEMMA3, "--parallelism.context_parallel_degree=2"), "gemma3", FP64),
    Layout("moe_ep2", 2, (*MOE_AUX, "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=4"), "moe", FP64),
    Layout("moe_ep2_pp2", 4, (*MOE_Z_BIAS, "--parallelism.expert_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--training.local_batch_size=4"), "moe_z_bias", FP64),
    # DDP's experts average over fewer ranks than they divide by (EP ranks hold the sum over
    # the EP group's tokens): reduced once per step, after accumulation or the schedule
    Layout("moe_ep2_ddp_accum", 2, (*MOE_Z_BIAS, "--parallelism.expert_parallel_degree=2", "--parallelism.zero_stage=0", "--training.local_batch_size=2", "--training.global_batch_size=8"), "moe_z_bias", FP64),
    # Every feature of the #23 silent case at once: Qwen3-MoE, PP 2 x CP 2, compiled attention
    # (the K/V gather in a compiled region inside an eager per-op checkpoint), per-op AC. With
    # K and V gathered by two same-shaped collectives, this row's gradients were wrong from
    # step 1 (loss 1.66e-3 off by step 4; exact without compile or without per-op AC): K/V
    # are now gathered in one collective.
    Layout("moe_cp2_pp2_compile_ac_op", 4, (*MOE_Z_BIAS, "--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--compile.enable=true", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"), "moe_z_bias", FP64),
    # The zero-bubble schedules assign the weight gradients themselves (split backward): the
    # experts' (used as w.mT) came transposed, and the fused AdamW kernel read them in the
    # parameter's order (loss 1.1e-4 off from step 2; 1F1B and float32 noise hid it):
    # training/optimizer.py:contiguous_grads
    Layout("moe_tp2_pp2_zero_bubble", 4, (*MOE_Z_BIAS, "--model.n_layers=4", "--parallelism.tensor_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=2"), "moe_z_bias_4_layers", FP64),
    # gpt-oss: the sinks and q/k/v biases split with the heads, the o bias replicated
    Layout("gpt_oss_fsdp2_tp2", 4, (*GPT_OSS, "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "gpt_oss", FP64),
    # the sinks over the gathered keys, documents crossing the ranks' chunks, experts over EP
    Layout("gpt_oss_ep2_cp2_doc", 2, (*GPT_OSS_DOC, "--parallelism.context_parallel_degree=2", "--parallelism.expert_parallel_degree=2"), "gpt_oss_doc", FP64),
    Layout("gpt_oss_cp2_pp2", 4, (*GPT_OSS, "--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "gpt_oss", FP64),
    # Ulysses CP (all-to-all from sequence to head shards) for every family: CP 4, TP x CP
    # compiled, soft-caps + windows + documents, two RoPE tables, experts over EP x PP, sinks x TP
    # (Llama's 2 KV heads at CP 4, and its 1 KV head per TP rank at CP 2: copied to each group)
    Layout("llama_cp4_ulysses", 4, (*LLAMA, *ULYSSES, "--parallelism.context_parallel_degree=4"), "llama", FP64),
    Layout("llama_tp2_cp2_ulysses", 4, (*LLAMA, *ULYSSES, "--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"), "llama", FP64),
    Layout("qwen3_cp2_ulysses_compile_ac_op", 2, (*QWEN3, *ULYSSES, "--parallelism.context_parallel_degree=2", "--compile.enable=true", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"), "qwen3", FP64),
    Layout("gemma2_cp2_ulysses_doc", 2, (*REFERENCES["gemma2_doc"], *ULYSSES, "--parallelism.context_parallel_degree=2"), "gemma2_doc", FP64),
    Layout("gemma3_cp2_ulysses", 2, (*GEMMA3, *ULYSSES, "--parallelism.context_parallel_degree=2"), "gemma3", FP64),
    Layout("moe_cp2_ulysses_ep2_pp2", 4, (*MOE_Z_BIAS, *ULYSSES, "--parallelism.context_parallel_degree=2", "--parallelism.expert_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "moe_z_bias", FP64),
    # the sinks sliced twice: by TP (the rank's heads) and by Ulysses (its head group), with
    # gpt-oss's 2 KV heads at 1 per TP rank copied to both CP head groups
    Layout("gpt_oss_tp2_cp2_ulysses", 4, (*GPT_OSS, *ULYSSES, "--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"), "gpt_oss", FP64),
    # tied embeddings split by PP: the output's copy on the last stage starts as the
    # embedding, the two gradients are summed (the P2P exchange between the end ranks; in
    # place on one rank under a V schedule; TP's replicated embedding gradient re-sharded
    # first) and counted once in the norm, the copy decays as the embedding (not at all)
    Layout("qwen3_pp2", 2, (*QWEN3, "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "qwen3", FP64),
    Layout("qwen3_pp2_zbv", 2, (*REFERENCES["qwen3_4_layers"], "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=2"), "qwen3_4_layers", FP64),
    Layout("gemma2_pp2_fsdp2", 4, (*GEMMA2, "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--training.local_batch_size=4"), "gemma2", FP64),
    Layout("gemma3_pp2_tp2", 4, (*GEMMA3, "--parallelism.tensor_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "gemma3", FP64),
    # DeepSeek-V3: experts over EP drawn from FSDP; K and V (of two head sizes) gathered in
    # one collective under CP, the dense and MoE blocks on two PP stages; latent attention split
    # by heads under TP (the shared rotated key's gradient summed over the TP ranks), with EP;
    # multi-token prediction (its module an FSDP unit, its block checkpointed under full AC,
    # its experts over EP, its norms and
    # projection on sequence shards under TP, and under CP the label past each chunk)
    Layout("deepseek_mtp_fsdp2_ep2_ac_full", 2, (*REFERENCES["deepseek_mtp"], "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=4", "--activation_checkpoint.mode=full"), "deepseek_mtp", FP64),
    Layout("deepseek_mtp_tp2_fsdp2_ep2", 4, (*REFERENCES["deepseek_mtp"], "--parallelism.tensor_parallel_degree=2", "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=4"), "deepseek_mtp", FP64),
    Layout("deepseek_mtp_cp2", 2, (*REFERENCES["deepseek_mtp"], "--parallelism.context_parallel_degree=2"), "deepseek_mtp", FP64),
    Layout("deepseek_mtp_ulysses_cp2_ep2", 2, (*REFERENCES["deepseek_mtp"], *ULYSSES, "--parallelism.context_parallel_degree=2", "--parallelism.expert_parallel_degree=2"), "deepseek_mtp", FP64),
    Layout("deepseek_cp2_pp2", 4, (*REFERENCES["deepseek"], "--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "deepseek", FP64),
    Layout("moe_ep2_pp2_ddp", 4, (*MOE_Z_BIAS, "--parallelism.expert_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--parallelism.zero_stage=0", "--training.local_batch_size=4"), "moe_z_bias", FP64),
)
# fmt: on


def pool_runs(selected):
    return family_pool_runs(selected, COMMON, REFERENCES, LAYOUTS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp64_layout_matches_one_process(runs, name):
    row = LAYOUTS[name]
    ranks, run, ref = row.nproc, runs[name].check(), runs[row.reference].check()
    layers = 4 if "--model.n_layers=4" in run.args else 2
    assert_layout(run.folder, ranks, run.args, layers, moe_local_blocks(ranks, run.args, layers))
    weights = final_weights(run.folder, STEPS)
    assert {w.dtype for w in weights.values()} == {torch.float64}, "not float64 weights"
    worst = assert_parity(ref.folder, run.folder, row.tol, step=STEPS)
    val_ref = by_step(ref.folder, "loss", "validation")
    val = by_step(run.folder, "loss", "validation")
    assert sorted(val_ref) == [4, STEPS], f"validation at steps {sorted(val_ref)}"
    worst["validation"] = assert_series(val_ref, val, "validation loss", row.tol.loss)
    if "--model.mtp_depth=1" in run.args:  # logged apart from the loss
        mtp_ref, mtp = by_step(ref.folder, "mtp_loss"), by_step(run.folder, "mtp_loss")
        assert sorted(mtp_ref) == list(range(1, STEPS + 1)), f"mtp_loss at {sorted(mtp_ref)}"
        worst["mtp"] = assert_series(mtp_ref, mtp, "mtp loss", row.tol.loss)
    if name.startswith(
        ("moe", "gpt_oss", "deepseek")
    ):  # no tie flips: the same tokens per expert at every step
        assert_router_parity(ref.folder, run.folder, tol=FP64.loss)
    print(
        f"\n{name}: loss {worst['loss']:.1e} validation {worst['validation']:.1e} grad norm "
        f"{worst['grad_norm']:.1e} weights {worst['max_rel']:.1e} ({worst['worst']}) "
        f"norm-wise {worst['max_rel_norm']:.1e}"
    )

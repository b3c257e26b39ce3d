"""The mutation check's catalogue (`tests/mutation/run.py` runs it): each planted bug is
one exact text replacement in one product file, with the tests that must catch it. A new
feature adds its planted bug here."""

from __future__ import annotations

from dataclasses import dataclass

PARITY = "tests/integration/test_parallel_parity.py::test_layout_matches_one_process"
PP_PARITY = "tests/integration/test_pipeline_parity.py::test_pipeline_matches_one_process"
QWEN3_PARITY = "tests/integration/test_qwen3_parity.py::test_qwen3_layout_matches_one_process"
CONTRACT = "tests/unit/test_model_contract.py"
MOE_PARITY = "tests/integration/test_moe_parity.py::test_moe_layout_matches_one_process"
MOE_UNIT = "tests/unit/test_moe.py"
CP_PARITY = "tests/integration/test_cp_parity.py::test_cp_layout_matches_one_process"
CP_UNIT = "tests/unit/test_context_parallel.py"
OPTION = "tests/unit/test_option_effects.py::test_option_takes_effect"
FP64_PARITY = "tests/integration/test_fp64_parity.py::test_fp64_layout_matches_one_process"
MUON_PARITY = "tests/integration/test_muon_parity.py::test_muon_layout_matches_one_process"
RESUME = "tests/unit/test_resume_counters.py::test_resume_restores_every_counter"
ATTN = "tests/unit/test_attention.py"
GEMMA2_LOGITS = "tests/unit/test_gemma2.py::test_logits_match_transformers"
GEMMA3_LOGITS = "tests/unit/test_gemma3.py::test_gemma3_logits_match_transformers"
HF_STREAM = "tests/unit/test_hf_stream.py"
DIST_UNITS = "tests/integration/test_distributed_units.py"
HF_LOAD = (
    "tests/integration/test_checkpoint_train.py::test_hf_folder_loads_directly_into_a_sharded_run"
)
HF_EXPORT = (
    "tests/integration/test_checkpoint_train.py::"
    "test_hf_export_loads_in_transformers_with_the_trained_logits"
)


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what is planted, in words
    path: str  # product file, relative to the repository root
    old: str  # exact text; must occur once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must catch it


MUTANTS = [
    Mutant(
        "zero1_1d_grads_not_averaged",
        "ZeRO-1/DDP: 1-D (norm) gradients are not all-reduced across data-parallel ranks",
        "parallelisms/zero.py",
        "work = dist.all_reduce(local, group=self.group, async_op=True)",
        "work = dist.all_reduce(\n"
        "            local if local.ndim > 1 else local.new_zeros(()), group=self.group,"
        " async_op=True\n        )",
        (f"{PARITY}[zero1_2_ac_op]",),
    ),
    Mutant(
        "weight_decay_on_norms_and_embeddings",
        "weight decay applied to norms and embeddings (no no-decay group)",
        "training/optimizer.py",
        "    keep = [p for n, p in named if any(s in n for s in no_decay)]\n",
        "    decay, keep = [p for n, p in named], []\n",
        ("tests/unit/test_training_units.py::test_no_weight_decay_on_norms_and_embeddings",),
    ),
    Mutant(
        "tp_not_applied",
        "tensor parallelism silently not applied (TP mesh built, plan skipped)",
        "parallelisms/decoder.py",
        "    if parallel_dims.tp_enabled:\n",
        "    if False:\n",
        (f"{PARITY}[tp2]",),
    ),
    Mutant(
        "ac_not_applied",
        "activation checkpointing silently not applied",
        "parallelisms/decoder.py",
        '    if ac.mode != "none":\n',
        "    if False:\n",
        (f"{PARITY}[ddp4_ac_full]",),
    ),
    Mutant(
        "compile_not_applied",
        "torch.compile silently not applied to the blocks",
        "parallelisms/decoder.py",
        '    if comp.enable and "model" in comp.components:\n',
        "    if False:\n",
        (f"{PARITY}[tp2_compile_ac_op]",),
    ),
    Mutant(
        "pp_stage_left_out_of_clip",
        "gradient clipping: one pipeline stage's gradients left out of the global norm",
        "training/step.py",
        "dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)",
        "dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)",
        (f"{PP_PARITY}[pp2_1f1b]",),
    ),
    Mutant(
        "loss_over_local_tokens_under_accumulation",
        "loss divided by the last micro-batch's tokens instead of the optimizer step's",
        "training/step.py",
        "sum(labelled_tokens(labels) for _, labels, _ in microbatches)",
        "labelled_tokens(microbatches[-1][1])",
        (f"{PARITY}[zero2_2_accum_ac_sel2]", DIST_UNITS),
    ),
    Mutant(
        "dp_offset_off_by_one",
        "data-parallel slice offset off by one (ranks 0 and 1 read the same sequences)",
        "data/dataloader.py",
        "range(start + self.dp_rank, start + size, self.dp_degree), start + size",
        "range(start + max(self.dp_rank - 1, 0), start + size, self.dp_degree), start + size",
        ("tests/unit/test_data_loader.py::test_rank_slices_partition_global_batch",),
    ),
    Mutant(
        "sharded_stream_not_caught_up",
        "sharded stream: a kept row is read from its shard without first skipping the shard's"
        " rows that other ranks kept (the shard's sequence numbering slips)",
        "data/dataset.py",
        "            while reader.position < index:",
        "            while False:",
        (
            "tests/unit/test_data_loader.py::"
            "test_sharded_stream_with_a_degree_not_dividing_the_shards_is_still_exact",
        ),
    ),
    Mutant(
        "sharded_stream_cursors_not_joined",
        "sharded stream: loading per-rank states keeps the first rank's shard cursors only (the"
        " other shards restart from their first document)",
        "data/dataloader.py",
        'merged = merge_cursors([s["cursor"] for s in per_rank])',
        'merged = per_rank[0]["cursor"]',
        ("tests/unit/test_data_loader.py::test_sharded_stream_resumes_exactly_at_another_dp",),
    ),
    Mutant(
        "pretokenize_lost_shard_skipped",
        "pre-tokenisation: a task marked done whose shard is missing is skipped on a rerun (the"
        " corpus silently lacks it)",
        "data/pretokenize.py",
        'if mark.is_file() and not (Path(output) / f"{task:05d}.meta.json").is_file():',
        "if False:",
        (
            "tests/integration/test_pretokenize.py::"
            "test_user_jsonl_folder_on_two_workers_resumes_and_trains",
        ),
    ),
    Mutant(
        "streamed_dp_offset_off_by_one",
        "streamed source: walking the stream keeps the row before each of this rank's rows"
        " (ranks read their neighbours' sequences)",
        "data/readers.py",
        "window = self.advance(keep=self.position in rows)",
        "window = self.advance(keep=self.position + 1 in rows)",
        ("tests/unit/test_data_loader.py::test_huggingface_stream_matches_packed_files",),
    ),
    Mutant(
        "hsdp_replicas_not_averaged",
        "HSDP: gradients not averaged across the replicate groups (FSDP over dp_shard only)",
        "parallelisms/fsdp.py",
        "    if parallel_dims.dp_replicate > 1:\n        return parallel_dims.mesh[",
        "    if False:\n        return parallel_dims.mesh[",
        (f"{PARITY}[hsdp_2x2]",),
    ),
    Mutant(
        "lr_scheduler_not_restored",
        "resume: the LR scheduler's state is not restored",
        "checkpoint/state.py",
        '        load_schedule(lr_scheduler, optimizer, sd["lr_scheduler"])\n',
        "        pass\n",
        ("tests/integration/test_checkpoint.py::test_resume_continues_bit_identically",),
    ),
    Mutant(
        "loader_position_not_restored",
        "resume: the data loader's position is not restored",
        "data/dataloader.py",
        '        """Continue from a saved global position (saved at any dp degree)."""\n',
        '        """Continue from a saved global position (saved at any dp degree)."""\n'
        "        return\n",
        ("tests/unit/test_data_loader.py::test_exact_resume_in_fresh_loader",),
    ),
    Mutant(
        "rope_scaling_ignored_for_8b",
        "Llama 3.1 8B built without its RoPE frequency scaling",
        "models/llama3/__init__.py",
        "        multiple_of=1024,\n        rope_theta=500000,\n        use_scaled_rope=True,\n",
        "        multiple_of=1024,\n        rope_theta=500000,\n        use_scaled_rope=False,\n",
        ("tests/unit/test_model.py", "tests/unit/test_config.py"),
    ),
    Mutant(
        "async_copy_not_awaited_before_step",
        "async checkpoint: the optimizer steps before the save's copy of the weights is done",
        "checkpoint/manager.py",
        "register_step_pre_hook(\n            lambda *_: self.maybe_wait_for_staging()\n",
        "register_step_pre_hook(\n            lambda *_: None\n",
        ("tests/integration/test_checkpoint.py::test_optimizer_step_waits_for_the_async_copy",),
    ),
    Mutant(
        "init_seed_depends_on_rank",
        "initial weights drawn from a seed that depends on the rank",
        "models/init_weights.py",
        "gen = torch.Generator(device=where).manual_seed(param_seed(seed, name))",
        "gen = torch.Generator(device=where).manual_seed(\n"
        "            param_seed(seed + torch.distributed.get_rank(), name)\n        )",
        (f"{PARITY}[zero3_4]",),
    ),
    Mutant(
        "loss_replicas_ignore_pipeline",
        "logged loss averaged over every rank although only last-stage ranks hold one",
        "training/trainer.py",
        "loss_replicas=parallel_dims.world_size // parallel_dims.pp,",
        "loss_replicas=parallel_dims.world_size,",
        (f"{PP_PARITY}[pp2_1f1b]",),
    ),
    Mutant(
        "clip_norm_of_one_group",
        "global gradient norm taken from one group of gradients (e.g. the TP-sharded ones)",
        "training/step.py",
        "    elif len(norms) == 1:\n",
        "    elif True:\n",
        (f"{PARITY}[tp2]",),
    ),
    Mutant(
        "tied_weights_not_retied",
        "shared (tied) parameters not tied again after materialisation (to_empty unties them)",
        "models/init_weights.py",
        '    if hasattr(model, "tie_weights"):\n        model.tie_weights()\n',
        "",
        (f"{CONTRACT}::test_tied_weights_survive_materialisation",),
    ),
    Mutant(
        "tp_plan_gap_silent",
        "a parameter no TP plan entry covers is left replicated without a word",
        "parallelisms/tensor_parallel.py",
        "    if missed:\n",
        "    if False:\n",
        (
            "tests/integration/test_model_contract_runs.py::test_tp_plan_gaps_are_named_at_parallelize_time",
        ),
    ),
    Mutant(
        "tied_embeddings_in_their_own_fsdp_unit",
        "tied embeddings get their own FSDP unit, apart from the output sharing them",
        "parallelisms/fsdp.py",
        "    if tied:\n",
        "    if False:\n",
        (f"{QWEN3_PARITY}[tied_fsdp2]",),
    ),
    Mutant(
        "mla_scale_without_mscale",
        "DeepSeek-V3: the softmax scale of latent attention leaves out YaRN's mscale",
        "models/deepseek_v3/model.py",
        "return args.head_dim**-0.5 * _mscale(args.rope_factor, args.rope_mscale_all_dim) ** 2",
        "return args.head_dim**-0.5",
        ("tests/unit/test_deepseek_v3.py::test_logits_match_transformers",),
    ),
    Mutant(
        "mla_tp_shared_key_grad_not_summed",
        "DeepSeek-V3 under TP: the gradient of the rotated key every head shares is left as "
        "each rank's own heads' part, not summed over the TP ranks",
        "models/deepseek_v3/plan.py",
        "key.to_local(grad_placements=[Partial()])",
        "key.to_local()",
        (f"{FP64_PARITY}[deepseek_mtp_tp2_fsdp2_ep2]",),
    ),
    Mutant(
        "mtp_later_labels_cut_per_cp_chunk",
        "Multi-token prediction under CP: the later labels are cut from the rank's chunks, not "
        "from the whole sequence, so the label past each chunk is lost",
        "training/inputs.py",
        '        kwargs["mtp_labels"] = mtp[:, mine]\n',
        '        kwargs["mtp_labels"] = later_labels(labels[:, mine], split.mtp_depth)\n',
        (f"{FP64_PARITY}[deepseek_mtp_cp2]",),
    ),
    Mutant(
        "mtp_projects_hidden_before_embedding",
        "Multi-token prediction: the projection reads [hidden, embedding] instead of DeepSeek's "
        "[embedding, hidden]",
        "models/mtp.py",
        "torch.cat([self.enorm(embedded), self.hnorm(hidden)], -1)",
        "torch.cat([self.hnorm(hidden), self.enorm(embedded)], -1)",
        ("tests/unit/test_deepseek_v3.py::test_prediction_module_matches_transformers",),
    ),
    Mutant(
        "moe_sigmoid_balance_unnormalised",
        "DeepSeek routing: the balance loss reads the sigmoid scores as if they summed to one",
        "models/moe.py",
        "            scores = scores / scores.sum(dim=-1, keepdim=True)\n",
        "            pass\n",
        (f"{MOE_UNIT}::test_sigmoid_balance_loss_reads_each_tokens_scores_as_a_distribution",),
    ),
    Mutant(
        "moe_groups_not_limited",
        "DeepSeek routing: the choice is not limited to each token's best expert groups",
        "models/moe.py",
        "        if self.n_groups == 1:\n            return biased\n",
        "        if True:\n            return biased\n",
        (f"{MOE_UNIT}::test_deepseek_routing_and_shared_experts_equal_transformers",),
    ),
    Mutant(
        "moe_route_scale_dropped",
        "DeepSeek routing: the routed experts' weights are not multiplied by the route scale",
        "models/moe.py",
        "return logits, scores, chosen, weights * self.route_scale",
        "return logits, scores, chosen, weights",
        (f"{MOE_UNIT}::test_deepseek_routing_and_shared_experts_equal_transformers",),
    ),
    Mutant(
        "moe_topk_not_renormalised",
        "MoE: the top-k router weights are not renormalised to sum to one",
        "models/moe.py",
        "            weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        "            weights = weights\n",
        (f"{MOE_UNIT}::test_moe_forward_equals_routing_each_token_by_hand",),
    ),
    Mutant(
        "moe_aux_loss_per_rank",
        "MoE: the load-balancing statistics are this rank's, not the global micro-batch's",
        "parallelisms/decoder.py",
        'routing.set_stats_reduce([model], _sum_over(parallel_dims.dim("dp_cp").get_group()))',
        "routing.set_stats_reduce([model], None)",
        (f"{MOE_PARITY}[ep2]",),
    ),
    Mutant(
        "ep_dispatch_split_off_by_one",
        "EP: the local expert splits are off by one (a row of the last expert goes to the first)",
        "parallelisms/expert_parallel.py",
        "    return arrived[perm], received.sum(0), weights\n",
        "    local = received.sum(0)\n    local[0] += 1\n    local[-1] -= 1\n"
        "    return arrived[perm], local, weights\n",
        (f"{MOE_PARITY}[ep2]",),
    ),
    Mutant(
        "ep_expert_grads_not_divided_by_dp",
        "EP: the experts' gradients are averaged over the FSDP ranks outside EP only (their sum "
        "over the EP group's tokens is not divided by the whole DP degree)",
        "parallelisms/decoder.py",
        "gradient_divide_factor=divide)",
        "gradient_divide_factor=None)",
        (f"{MOE_PARITY}[ep2_fsdp2_bias]",),
    ),
    Mutant(
        "ep_expert_grads_divided_twice",
        "EP: on one shard rank FSDP2 divides the experts' gradients by the DP degree and the "
        "hook divides them again",
        "parallelisms/fsdp.py",
        "    module.set_gradient_divide_factor(1.0)\n",
        "    module.set_gradient_divide_factor(factor)\n",
        (f"{MOE_PARITY}[ep2]",),
    ),
    Mutant(
        "moe_recompute_counted_twice",
        "MoE: activation checkpointing's recomputed forward counts the routing statistics again",
        "models/moe.py",
        "            if self.counting and not _in_backward():\n                self.tokens",
        "            if self.counting:\n                self.tokens",
        (f"{MOE_UNIT}::test_recomputed_forward_counts_tokens_once", f"{MOE_PARITY}[ep4_ac]"),
    ),
    Mutant(
        "cp_local_rope_positions",
        "CP: RoPE uses each rank's local positions 0..seq/cp-1 instead of its tokens' global ones",
        "training/inputs.py",
        'kwargs = {"positions": mine.expand(batch, -1), ',
        'kwargs = {"positions": torch.arange(len(mine), device=inputs.device).expand(batch, -1), ',
        (
            f"{CP_UNIT}::test_cp_shard_gives_its_queries_and_the_gathered_keys_positions_and_documents",
            f"{FP64_PARITY}[llama_cp2]",
        ),
    ),
    Mutant(
        "cp_mask_off_by_one_chunk",
        "CP: causal attention lets each chunk see the next chunk too (its mask one chunk late)",
        "parallelisms/context_parallel.py",
        "end = (index + 1) * chunk",
        "end = min(index + 2, 2 * cp) * chunk",
        (f"{FP64_PARITY}[llama_cp2]",),
    ),
    Mutant(
        "cp_document_mask_keys_shifted",
        "CP with document masking: the mask takes the gathered keys' positions shifted by one "
        "chunk",
        "parallelisms/context_parallel.py",
        "return torch.cat([local_positions(seq_len, r, cp, device) for r in range(cp)])",
        "return torch.cat([local_positions(seq_len, r, cp, device) for r in range(cp)]).roll(\n"
        "        seq_len // (2 * cp)\n    )",
        (f"{CP_PARITY}[llama_cp2_doc]",),
    ),
    Mutant(
        "cp_grads_averaged_per_cp_rank",
        "CP: FSDP shards and averages over the data-parallel ranks only (dp_shard, not "
        "dp_shard_cp), so each CP rank's weights learn from its own chunks' loss",
        "parallelisms/fsdp.py",
        'def fsdp_mesh(parallel_dims: ParallelDims, shard_dim: str = "dp_shard_cp")',
        'def fsdp_mesh(parallel_dims: ParallelDims, shard_dim: str = "dp_shard")',
        (f"{CP_PARITY}[llama_cp2_fsdp2_ac]",),
    ),
    Mutant(
        "cp_aux_loss_over_whole_sequences",
        "CP: each rank scales its MoE layers' auxiliary losses (token sums) by the whole "
        "sequences' token count, not its own (the balancing loss comes out cp times too small)",
        "training/trainer.py",
        "tokens = t.local_batch_size * (t.seq_len // cp) * accum_steps",
        "tokens = t.local_batch_size * t.seq_len * accum_steps",
        (f"{CP_PARITY}[moe_cp2_doc]",),
    ),
    Mutant(
        "fp64_loss_in_float32",
        "float64 mode: the loss rounds the logits to float32 (~1e-7 noise back in every layout)",
        "training/loss.py",
        "    logits = at_least_float32(logits.flatten(0, 1))\n",
        "    logits = logits.flatten(0, 1).float()\n",
        ("tests/unit/test_float64.py::test_float64_model_computes_in_float64_only",),
    ),
    Mutant(
        "betas_beta1_twice",
        "AdamW built with betas = (beta1, beta1): optimizer.beta2 never reaches the optimizer "
        "(one process and every layout share the bug, so parity cannot see it)",
        "training/optimizer.py",
        '"betas": (cfg.beta1, cfg.beta2),',
        '"betas": (cfg.beta1, cfg.beta1),',
        (f"{OPTION}[optimizer.beta2]",),
    ),
    Mutant(
        "eps_dropped",
        "optimizer.eps not passed to AdamW (torch's default 1e-8 used whatever is configured)",
        "training/optimizer.py",
        '        "eps": cfg.eps,\n',
        "",
        (f"{OPTION}[optimizer.eps]",),
    ),
    Mutant(
        "warmup_ignored",
        "the LR schedule ignores lr_scheduler.warmup_steps (no warmup)",
        "training/optimizer.py",
        "s + 1, total_steps, cfg.warmup_steps, cfg.decay_ratio,",
        "s + 1, total_steps, 0, cfg.decay_ratio,",
        (f"{OPTION}[lr_scheduler.warmup_steps]",),
    ),
    Mutant(
        "fsdp_reduce_dtype_ignored",
        "FSDP reduces gradients in the compute dtype, not training.mixed_precision_reduce "
        "(invisible to fp32 parity runs, where both are float32)",
        "parallelisms/fsdp.py",
        "MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)",
        "MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)",
        (f"{OPTION}[training.mixed_precision_reduce]",),
    ),
    Mutant(
        "tokens_seen_not_restored",
        "resume: the tokens-seen counter is not restored (restarts from 0)",
        "training/loop.py",
        'self.tokens_seen = int(state["tokens_seen"])',
        "self.tokens_seen = self.tokens_seen",
        (RESUME,),
    ),
    Mutant(
        "rng_not_restored",
        "resume: the RNG streams are not restored (the run's own seeding continues)",
        "checkpoint/state.py",
        '        set_rng_state(sd["rng"][f"rank{rank}"])\n',
        "        pass\n",
        (RESUME,),
    ),
    Mutant(
        "ddp_bf16_tp_grad_placement_kept",
        "DDP with bf16 compute under TP: a gradient in another placement than its weight's "
        "(the embedding's) is wrapped in the weight's placement without redistribution",
        "parallelisms/zero.py",
        "            if grad.placements != want:\n",
        "            if grad.placements != want and self.stage > 0:\n",
        (f"{PARITY}[tp2_ddp2_bf16]",),
    ),
    Mutant(
        "split_backward_grads_not_reduced",
        "ZeRO 0-2 under a split-backward pipeline schedule: the weight pass's gradients (which "
        "fire no hook) are never reduced over the data-parallel ranks",
        "training/step.py",
        "                _reduce_local_gradients(setup.model_parts)\n",
        "",
        (f"{PP_PARITY}[pp2_zero1_interleaved_zb_accum]",),
    ),
    Mutant(
        "expert_grad_sync_not_turned_off",
        "ZeRO 0-2: turning gradient sync off (accumulation micro-steps, a pipeline schedule) "
        "does not reach the experts' own ZeRO state, which then reduce every micro-step",
        "parallelisms/zero.py",
        "        for module in self.modules():\n            if isinstance(module, ZeroModule):\n"
        "                module._zero.sync = requires_gradient_sync\n",
        "        self._zero.sync = requires_gradient_sync\n",
        (f"{FP64_PARITY}[moe_ep2_ddp_accum]",),
    ),
    Mutant(
        "zero_reduces_every_pipeline_microbatch",
        "ZeRO 0-2 under pipeline parallelism reduce in every microbatch's backward: a stage-0 "
        "gradient already averaged is averaged again with the next microbatch's added",
        "training/step.py",
        "                _set_grad_sync(setup.model_parts, False)\n",
        "",
        (f"{FP64_PARITY}[moe_ep2_pp2_ddp]",),
    ),
    Mutant(
        "cp_swaps_subclassed_cores",
        "CP swaps a subclass of the shared attention core (a family's own attention math) for "
        "the plain CP core: the run trains another model",
        "parallelisms/context_parallel.py",
        "            if type(child) is AttentionCore:",
        "            if isinstance(child, AttentionCore):",
        (f"{CP_UNIT}::test_cp_refuses_attention_it_cannot_honour_naming_the_module",),
    ),
    Mutant(
        "cp_own_attention_not_checked",
        "attention computed outside the shared core (it sees only the rank's tokens under CP) "
        "is not looked for",
        "parallelisms/context_parallel.py",
        '    problems += [f"{name} {what}" for name, what in _own_attention(model, seq_len).items()]',
        "",
        (
            f"{CP_UNIT}::test_cp_refuses_attention_it_cannot_honour_naming_the_module",
            f"{CP_UNIT}::test_the_config_check_refuses_cp_for_a_family_with_its_own_attention",
        ),
    ),
    Mutant(
        "ac_dropout_rng_not_replayed",
        "activation checkpointing recomputes a block with dropout without replaying its RNG "
        "state (other masks in the recomputation)",
        "parallelisms/activation_checkpoint.py",
        '"preserve_rng_state": _draws_random_numbers(block)',
        '"preserve_rng_state": False',
        ("tests/unit/test_parallel_units.py::test_ac_replays_dropout_masks_in_recomputation",),
    ),
    Mutant(
        "block_mask_full_blocks_too_wide",
        "block masks: a key block counts as fully visible when its first key (not its last) "
        "precedes the query block, so queries see later keys of it unmasked",
        "models/block_attention.py",
        "some, every = some & (kmin <= qmax), every & (kmax <= qmin)",
        "some, every = some & (kmin <= qmax), every & (kmin <= qmin)",
        (f"{ATTN}::test_every_spec_equals_the_dense_definition_with_its_gradients",),
    ),
    Mutant(
        "sliding_window_one_too_wide",
        "sliding window: a query sees window + 1 positions",
        "models/block_attention.py",
        "ok = ok & (q_pos - k_pos < window)",
        "ok = ok & (q_pos - k_pos <= window)",
        (f"{ATTN}::test_every_spec_equals_the_dense_definition_with_its_gradients",),
    ),
    Mutant(
        "softcap_backward_ignores_tanh",
        "soft-capping: the backward treats the cap as the identity (no tanh derivative)",
        "models/block_attention.py",
        "            ds = ds * (1 - t * t)\n",
        "            ds = ds\n",
        (f"{ATTN}::test_every_spec_equals_the_dense_definition_with_its_gradients",),
    ),
    Mutant(
        "cp_masks_use_query_positions_for_keys",
        "CP with a block mask: the keys' positions are taken to be the queries' (the rank's "
        "own), not the gathered keys'",
        "models/attention.py",
        "        positions if key_positions is None else key_positions,\n",
        "        positions,\n",
        (
            f"{ATTN}::test_keys_in_context_parallel_order_give_each_ranks_rows",
            f"{CP_PARITY}[llama_cp2_doc]",
        ),
    ),
    Mutant(
        "document_mask_ignores_the_spec",
        "document masking applies to a layer whose spec turns it off",
        "models/attention.py",
        "return self.documents is not None and spec.document_mask",
        "return self.documents is not None",
        (f"{ATTN}::test_every_spec_equals_the_dense_definition_with_its_gradients",),
    ),
    Mutant(
        "gemma2_odd_layers_slide",
        "Gemma 2: the sliding window on the odd layers instead of the even ones",
        "models/gemma2/model.py",
        "return self.sliding_window is not None and layer % 2 == 0",
        "return self.sliding_window is not None and layer % 2 == 1",
        (GEMMA2_LOGITS,),
    ),
    Mutant(
        "gemma_norm_without_one",
        "Gemma 2 and 3: the zero-centred RMSNorms scale by weight, not by 1 + weight",
        "models/gemma_blocks.py",
        "(h * (1.0 + self.weight.to(h.dtype))).type_as(x)",
        "(h * self.weight.to(h.dtype)).type_as(x)",
        (GEMMA2_LOGITS, GEMMA3_LOGITS),
    ),
    Mutant(
        "gemma_embeddings_unscaled",
        "Gemma 2 and 3: the token embeddings not multiplied by sqrt(dim)",
        "models/gemma_blocks.py",
        "return h * rounded_sqrt(self.embedding_dim, h.dtype, self.via_float32)",
        "return h",
        (GEMMA2_LOGITS, GEMMA3_LOGITS),
    ),
    Mutant(
        "gemma2_post_norm_not_in_tp_plan",
        "Gemma 2 (and 3): the post-MLP norm left out of the shared decoder's tensor-parallel plan",
        "models/tp_plan.py",
        'block |= {"post_attention_norm": post_norm, "post_ffn_norm": post_norm}',
        'block |= {"post_attention_norm": post_norm}',
        (f"{FP64_PARITY}[gemma2_tp2]",),
    ),
    Mutant(
        "hf_llama_qk_rows_unpermuted",
        "Llama's per-tensor HF description maps our Q/K rows to the same HF rows (no RoPE "
        "permutation), so slice reads and streaming conversion disagree with the whole-dict one",
        "models/llama3/hf.py",
        "return head * head_dim + (within % 2) * (head_dim // 2) + within // 2",
        "return head * head_dim + within",
        (f"{HF_STREAM}::test_the_description_agrees_with_the_whole_dict_conversion[llama3]",),
    ),
    Mutant(
        "matrix_thinning_loses_pairs",
        "the combination matrix's thinning moves a pair into another row without checking that "
        "the row keeps the pairs only it held (a redrawn design then misses pairs)",
        "tests/matrix.py",
        "if not (needed - lost) - _covered(trial) and not refusal(moved):",
        "if not refusal(moved):",
        (
            "tests/unit/test_matrix_design.py::test_thinning_keeps_every_pair_and_drops_what_others_hold",
        ),
    ),
    Mutant(
        "hf_fused_experts_gate_up_swapped",
        "transformers' fused gate_up_proj of the experts is cut with the up rows taken for the "
        "gate's (a model converted from transformers' in-memory state)",
        "models/moe_hf.py",
        "gate, up = t.split(hidden, dim=1)",
        "up, gate = t.split(hidden, dim=1)",
        ("tests/unit/test_deepseek_v3.py::test_logits_match_transformers",),
    ),
    Mutant(
        "hf_expert_slice_from_expert_zero",
        "a slice of stacked experts is read from expert 0 on, whatever its offset (an EP rank "
        "or a shard of experts gets another rank's experts)",
        "checkpoint/hf.py",
        "for j in range(offsets[0], offsets[0] + shape[0])\n",
        "for j in range(shape[0])\n",
        (f"{HF_STREAM}::test_any_slice_reads_as_the_same_slice_of_the_whole_import[qwen3_moe]",),
    ),
    Mutant(
        "hf_load_ignores_shard_offsets",
        "a run starting from an HF folder fills every shard from the tensor's start (the local "
        "shard's global offsets ignored)",
        "checkpoint/hf.py",
        "local.copy_(read_slice(files, sources[n], tuple(offset), tuple(shape)))",
        "local.copy_(read_slice(files, sources[n], (0,) * len(shape), tuple(shape)))",
        (f"{HF_LOAD}[llama3-tp2_fsdp2-extra0]",),
    ),
    Mutant(
        "hf_export_writes_local_shards",
        "the HF export writes each rank's local shard instead of the gathered parameter",
        "checkpoint/hf_write.py",
        "full = t.full_tensor() if isinstance(t, DTensor) else t",
        "full = t.to_local() if isinstance(t, DTensor) else t",
        (f"{HF_EXPORT}[llama3-tp2_fsdp2-extra0]",),
    ),
    Mutant(
        "hf_safetensors_writer_offsets_from_zero",
        "the streaming safetensors writer gives every tensor the byte range of the first",
        "checkpoint/hf_write.py",
        '                            "data_offsets": [start, end]}  # fmt: skip\n            start = end\n',
        '                            "data_offsets": [start, end]}  # fmt: skip\n            start = 0\n',
        (f"{HF_STREAM}::test_streamed_round_trip_is_exact[llama3]",),
    ),
    Mutant(
        "validation_reads_one_micro_batch_a_step",
        "validation: a validation step reads local_batch_size x DP sequences (one micro-batch), "
        "not a global batch, so the validation set changes with the accumulation",
        "training/loop.py",
        "micro_batches=run.accum_steps,",
        "micro_batches=1,",
        (f"{FP64_PARITY}[llama_zero2_accum]",),
    ),
    Mutant(
        "zero_tied_weight_in_one_place",
        "ZeRO 0-2 swap a tied weight's compute and master parameters in its first module only "
        "(the output projection keeps the other)",
        "parallelisms/zero.py",
        "seen[id(param)].places.append((module, name))",
        "pass",
        (f"{FP64_PARITY}[qwen3_zero2_tp2]",),
    ),
    Mutant(
        "fused_step_on_transposed_grads",
        "the fused AdamW steps on gradients with other strides than their parameters (the "
        "zero-bubble schedules' weight gradients), which its kernel reads in the wrong order",
        "training/optimizer.py",
        "        optimizer.register_step_pre_hook(contiguous_grads)\n",
        "        pass\n",
        (
            "tests/unit/test_training_units.py::"
            "test_a_transposed_gradient_steps_like_a_contiguous_one",
            f"{FP64_PARITY}[moe_tp2_pp2_zero_bubble]",
        ),
    ),
    Mutant(
        "step_tokens_of_this_rank",
        "the loss divided by this rank's labelled tokens, not the mean over the ranks of the "
        "step's global count (ranks with more ignored labels weigh their tokens more)",
        "training/step.py",
        "        dist.all_reduce(count, op=dist.ReduceOp.SUM)\n        return count / dist.get_world_size()",
        "        return count",
        (DIST_UNITS,),
    ),
    Mutant(
        "ignored_labels_counted",
        "the step's token count includes labels the loss ignores (IGNORE_INDEX)",
        "training/loss.py",
        "return (labels != IGNORE_INDEX).sum()",
        "return labels.new_tensor(labels.numel())",
        (DIST_UNITS,),
    ),
    Mutant(
        "cp_check_stops_at_routing",
        "the CP attention check stops where MoE routing leaves the meta device (layer 0's "
        "experts): later layers that compute attention themselves are never seen",
        "parallelisms/context_parallel.py",
        "in _later_siblings(model, list(stack), inputs):",
        "in []:",
        (f"{CP_UNIT}::test_the_check_reaches_the_layers_after_a_routing_layer",),
    ),
    Mutant(
        "cp_sequence_mixing_unchecked",
        "the CP check takes no notice of positions mixed outside the attention cores (the "
        "sink walk-around: a log-sum-exp over the layer's own q and k, which under CP sees "
        "only the rank's keys)",
        "parallelisms/context_parallel.py",
        "return bool(seen[0].grad[0, others].ne(0).any())",
        "return False",
        (
            f"{CP_UNIT}::test_mixing_positions_outside_the_core_is_found_on_a_real_instance",
            f"{CP_UNIT}::test_the_config_check_refuses_cp_for_a_family_with_its_own_attention",
        ),
    ),
    Mutant(
        "flops_skip_layers_without_a_core",
        "FLOPs per token count no attention in layers that compute it outside a shared core "
        "(a family with its own attention reports 6N)",
        "metrics/flops.py",
        "uncovered = max(n_layers - len(specs), 0)",
        "uncovered = 0 if attention is not None else n_layers",
        ("tests/unit/test_metrics.py::test_flops_per_token_counts_each_layer_at_its_span",),
    ),
    Mutant(
        "sink_lse_gradient_dropped",
        "the block kernel's backward ignores the log-sum-exp's gradient (sinks then train "
        "with the wrong q and k gradients)",
        "models/block_attention.py",
        "        if grad_lse is not None:\n",
        "        if False:\n",
        (f"{ATTN}::test_sinks_and_the_log_sum_exp_equal_the_definition_with_their_gradients",),
    ),
    Mutant(
        "sink_sign_flipped",
        "the sink's share computed as sigmoid(sink - lse): a query keeps what it should give "
        "to the sink",
        "models/attention.py",
        "kept = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])",
        "kept = torch.sigmoid(sinks.to(lse.dtype)[None, :, None] - lse)",
        (f"{ATTN}::test_sinks_and_the_log_sum_exp_equal_the_definition_with_their_gradients",),
    ),
    Mutant(
        "tp_sinks_replicated",
        "TP keeps every head's sink logit on every rank (the rank's heads then read the "
        "logits of all heads)",
        "models/tp_plan.py",
        "sharded = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)",
        "sharded = distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)",
        (DIST_UNITS,),
    ),
    Mutant(
        "cp_core_drops_the_sinks",
        "the CP core does not take over the replaced core's sink logits",
        "parallelisms/context_parallel.py",
        'sinks = getattr(child, "sinks", None)',
        "sinks = None",
        (DIST_UNITS,),
    ),
    Mutant(
        "gpt_oss_gate_up_halves",
        "gpt-oss experts read gate and up as the two halves of the fused projection (the "
        "published layout interleaves them)",
        "models/gpt_oss/model.py",
        "gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)",
        "gate, up = (t.clamp(-limit, limit) for t in h.chunk(2, -1))\n    gate = gate.clamp(max=limit)",
        ("tests/unit/test_gpt_oss.py::test_logits_match_transformers",),
    ),
    Mutant(
        "gpt_oss_up_clamped_above_only",
        "gpt-oss experts clamp up from above only (the reference clamps it to +-limit)",
        "models/gpt_oss/model.py",
        "h[..., 1::2].clamp(-limit, limit)",
        "h[..., 1::2].clamp(max=limit)",
        ("tests/unit/test_gpt_oss.py::test_logits_match_transformers",),
    ),
    Mutant(
        "ulysses_sinks_of_the_first_heads",
        "Ulysses: every rank applies the sink logits of head group 0 to its own heads",
        "parallelisms/context_parallel.py",
        "sinks = sinks[self.cp_rank * heads : (self.cp_rank + 1) * heads]",
        "sinks = sinks[:heads]",
        (DIST_UNITS,),
    ),
    Mutant(
        "ulysses_mask_without_documents",
        "Ulysses: the whole sequence's mask is built without the documents (packed documents "
        "see each other)",
        "parallelisms/context_parallel.py",
        "whole = AttentionBatch(batch.key_positions, batch.key_positions, docs, docs, True)",
        "whole = AttentionBatch(batch.key_positions, batch.key_positions, None, None, True)",
        (DIST_UNITS, f"{FP64_PARITY}[gemma2_cp2_ulysses_doc]"),
    ),
    Mutant(
        "ulysses_kv_copies_tiled",
        "Ulysses: with fewer KV heads than CP ranks the copies are tiled (h0 h1 h0 h1), so a "
        "head group reads another group's KV head",
        "parallelisms/context_parallel.py",
        "t.repeat_interleave(self.cp // k.shape[1], dim=1)",
        "t.repeat(1, self.cp // k.shape[1], 1, 1)",
        (f"{FP64_PARITY}[llama_cp4_ulysses]",),
    ),
    Mutant(
        "tied_gradients_not_summed",
        "Tied embeddings split by PP: the embedding and the output's copy each step on their "
        "own gradient, never summed",
        "training/step.py",
        "                    setup.tied.sum_gradients()",
        "                    pass",
        (f"{FP64_PARITY}[qwen3_pp2]",),
    ),
    Mutant(
        "tied_copy_counted_in_grad_norm",
        "Tied embeddings split by PP: the output's copy is counted in the gradient norm beside "
        "the embedding",
        "training/loop.py",
        "self.tied_copies = self.setup.tied.copies if self.setup.tied is not None else []",
        "self.tied_copies = []",
        (f"{FP64_PARITY}[qwen3_pp2_zbv]",),
    ),
    Mutant(
        "tied_copy_initialised_as_the_output",
        "Tied embeddings split by PP: the last stage initialises its copy by the output "
        "projection's rule, not as the embedding",
        "models/init_weights.py",
        "name = tied.get(name, name)",
        "name = name",
        (f"{FP64_PARITY}[qwen3_pp2]",),
    ),
    Mutant(
        "tied_copy_decays",
        "Tied embeddings split by PP: the output's copy is weight-decayed while the embedding "
        "is not",
        "training/optimizer.py",
        "yield tied.get(canonical_name(raw), raw), p",
        "yield raw, p",
        (f"{FP64_PARITY}[gemma2_pp2_fsdp2]",),
    ),
    Mutant(
        "tied_tp_gradient_exchanged_as_it_comes",
        "Tied embeddings split by PP under TP: the embedding's replicated gradient is "
        "exchanged with the copy's sharded one without re-sharding it",
        "parallelisms/tied_weights.py",
        "    if tuple(g.placements) != tuple(p.placements):",
        "    if False:",
        (f"{FP64_PARITY}[gemma3_pp2_tp2]",),
    ),
    Mutant(
        "tied_copy_state_not_read_from_the_parameter",
        "Tied embeddings resharded into PP: the output's copy does not read the optimizer state "
        "that a one-parameter layout saved under the embedding's name",
        "checkpoint/state.py",
        "                        out.append((section, key, alias))",
        "                        pass",
        ("tests/integration/test_checkpoint_train.py::test_reshard[tied_tp2_fsdp2-tied_pp2]",),
    ),
    Mutant(
        "compile_turn_not_taken",
        "Ranks compiling the same graph do not take turns: each compiles it at the same time",
        "parallelisms/compile.py",
        '    with FileLock(os.path.join(folder, f"{key}.lock")):',
        "    with contextlib.nullcontext():",
        (f"{DIST_UNITS}::test_ranks_compiling_one_graph_take_turns",),
    ),
    Mutant(
        "compile_turn_leaves_the_backward_lazy",
        "The backward graph is compiled at its first call, outside the rank's compile turn",
        "parallelisms/compile.py",
        'eager_backward["force_non_lazy_backward_lowering"] = True',
        'eager_backward["force_non_lazy_backward_lowering"] = False',
        (f"{DIST_UNITS}::test_ranks_compiling_one_graph_take_turns",),
    ),
    Mutant(
        "muon_shard_orthogonalised_alone",
        "Muon: each rank orthogonalises its own shard of a sharded matrix (no owner exchange)",
        "training/muon_exchange.py",
        "    return isinstance(p, DTensor) and bool(_sharded_dims(p))\n",
        "    return False\n",
        (f"{MUON_PARITY}[muon_fsdp2]",),
    ),
    Mutant(
        "muon_experts_stacked_into_one_matrix",
        "Muon: a stack of experts [E, a, b] orthogonalised as one [E a, b] matrix",
        "training/muon.py",
        "        out = newton_schulz(u, coefficients, steps, dtype)\n",
        "        out = newton_schulz(u.flatten(0, -2), coefficients, steps, dtype).view(u.shape)\n",
        ("tests/unit/test_muon.py::test_each_expert_and_interleaved_matrix_alone",),
    ),
    Mutant(
        "muon_scale_from_local_shard",
        "Muon: the update scale read from the rank's shard's shape, not the matrix's",
        "training/muon.py",
        "            scale = update_scale(p.shape, ",
        "            scale = update_scale(local(p).shape, ",
        (f"{MUON_PARITY}[muon_fsdp2]",),
    ),
    Mutant(
        "planner_counts_adamw_for_muon",
        "the memory planner counts AdamW's two states for Muon's matrices (one momentum buffer)",
        "planning/simulate.py",
        "        muon = lambda name, p: is_muon_matrix(spec, name, p.ndim)  # noqa: E731\n",
        "        muon = None\n",
        ("tests/unit/test_estimate.py::test_simulated_states_equal_real_tensors_after_a_step",),
    ),
]

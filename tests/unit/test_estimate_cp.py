"""Context parallelism in the planner: activations per rank, block masks, the K/V gather's and
Ulysses' volumes and memory, the advice, against hand counts and what autograd saves."""

import contextlib
import dataclasses
import io
import re

import pytest
import torch
from dist_utils import fake_world
from planning_probes import estimate_script, saved_bytes, tiny_args, tiny_cfg

from job_config import parse_args
from models import build_model_args, get_model_spec
from parallelisms.parallel_dims import ParallelDims
from planning.advise import Workload, advise, analytic_activations, analytic_memory, fits
from planning.communication import (
    Cluster,
    Layout,
    comm_per_step,
    kv_all_gather_bytes,
    ulysses_all_to_all_bytes,
)
from planning.memory import (
    attention_bytes,
    block_mask_bytes,
    rank_activations,
)
from planning.simulate import simulate

QWEN3_MOE = "--model.name qwen3_moe --model.flavor debugmodel"


# ------------------------------------------------------------------------ context parallelism
LLAMA3_8B_128K = build_model_args("llama3", "8B", 131072)


def _cp_activations(cp: int, ac: str = "none", extra: str = ""):
    """Llama 3 8B's activation estimate per rank at 128K tokens on CP `cp` (one rank, TP 1)."""
    cfg = parse_args(
        f"--config llama3_8b --training.seq_len 131072 --activation_checkpoint.mode {ac} {extra}".split()
    )
    dims = ParallelDims.from_config(world_size=cp, dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=cp)
    spec = get_model_spec("llama3")
    return rank_activations(cfg, LLAMA3_8B_128K, dims, 0, 32, True, spec.block_activation_bytes)


def test_cp_terms_by_hand_for_llama3_8b_at_128k():
    """Per layer a CP 2 rank adds the gathered K and V at the 8 K/V heads beyond its own half
    (2 x 65,536 x 1024 x 2 B); once per micro-batch the block mask over its 65,536 queries and
    the 131,072 keys (512 x 1024 blocks of 128: 8 int32 tensors, both orientations), built
    under CP with or without document masking; one layer's K/V gradients at 128K tokens."""
    plain = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 2)
    mask = 4 * (2 * (512 + 1024) + 4 * 512 * 1024)  # 8.0 MiB
    assert block_mask_bytes(65536, 131072, 1) == mask
    assert (plain.kv, plain.masks) == (256 << 20, mask)
    c = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 2, document_mask=True)
    assert (c.kv, c.masks) == (256 << 20, mask)
    assert c.transient == plain.transient == 2 * 131072 * 1024 * 2  # 512 MiB
    alone = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 1)
    assert (alone.per_layer, alone.masks, alone.transient) == (0, 0, 0)
    at_tp2 = attention_bytes(LLAMA3_8B_128K, 131072, 1, 2, 4, document_mask=True)
    assert (at_tp2.kv, at_tp2.masks) == (2 * 98304 * 512 * 2, block_mask_bytes(32768, 131072, 1))


def test_block_masks_one_per_distinct_spec_that_needs_one():
    """The masks counted are those `attention_batch` builds: none for plain causal layers
    alone, one per distinct mask key otherwise (window and global layers with document
    masking: two; the same spec on every layer: one; the plain causal layers of a model with windows none without
    document masking), of the bytes of the real BlockMask's tensors."""
    from models.attention import AttentionSpec, attention_batch

    args, s, b = LLAMA3_8B_128K, 1024, 2
    local, window = AttentionSpec(window=256), AttentionSpec()
    cases = [((window,), False, 0), ((window,), True, 1), ((local, window), False, 1)]
    cases += [((local, window, local), True, 2), ((AttentionSpec(document_mask=False),), True, 0)]
    for specs, docs, n in cases:
        documents = (torch.arange(s) // 300).expand(b, -1) if docs else None
        batch = attention_batch(list(specs), b, s, torch.device("cpu"), documents=documents)
        masks = [] if batch is None else list(batch.masks.values())
        real = sum(t.nbytes for m in masks for t in m.as_tuple() if isinstance(t, torch.Tensor))
        estimated = attention_bytes(args, s, b, 1, 1, document_mask=docs, specs=specs).masks
        assert (len(masks), estimated) == (n, real) == (n, n * block_mask_bytes(s, s, b))


def test_selective_op_ac_counts_the_family_block():
    """Op-level selective AC keeps the family's count per layer (its upper bound: the
    backends keep no scores to drop), not Korthikanti's GPT count."""
    op = "--activation_checkpoint.selective_ac_option op"
    sel, none = _cp_activations(1, "selective", op), _cp_activations(1)
    assert sel.kept == 32 and sel.per_layer == sel.block == none.per_layer
    assert sel.total == none.total


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_cp_divides_the_per_rank_activations_by_its_degree(cp, ac):
    """What scales with the rank's tokens (the block count, full AC's kept inputs, the logits)
    falls exactly by the CP degree; the gathered K/V, the block mask and the transient come on
    top."""
    one, split = _cp_activations(1, ac), _cp_activations(cp, ac)
    c = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, cp)
    assert split.block * cp == one.block and split.logits * cp == one.logits
    assert split.per_checkpointed * cp == one.per_checkpointed
    if ac == "none":
        assert (one.kept, split.kept) == (32, 32)
        assert split.per_layer == one.per_layer / cp + c.kv
        extra = 32 * c.kv
    else:
        assert (one.checkpointed, split.checkpointed) == (32, 32)
        assert split.recompute == one.recompute / cp + c.kv
        extra = c.kv
        assert split.total < one.total  # only the recomputed layer keeps CP's full-length terms
    assert split.total == int(one.total / cp + extra + c.masks + c.transient)
    assert f"s=131072/cp {cp} = {131072 // cp}" in split.describe()


def test_cp_kv_all_gather_volume_by_hand():
    """Llama 3 8B at 128K on CP 2: per layer K and V of 131,072 x 1024 bf16 (256 MiB each)
    gathered, half of it from the other rank, and their gradients reduce-scattered back:
    2 passes x 32 layers x 512 MiB x 1/2 = 16 GiB per micro-step; full AC gathers again."""
    assert kv_all_gather_bytes(131072, 1, 1024, 2, 32, 2, recompute=False) == 16 << 30
    assert kv_all_gather_bytes(131072, 1, 1024, 2, 32, 2, recompute=True) == 24 << 30
    assert kv_all_gather_bytes(131072, 1, 1024, 1, 32, 2, recompute=False) == 0
    n = 8_030_261_248
    for tp, cp, link in ((1, 8, "NVLink"), (2, 4, "NVLink"), (4, 4, "network")):
        layout = Layout(tp=tp, pp=1, dp=16 // (tp * cp), cp=cp)
        comms = comm_per_step(
            LLAMA3_8B_128K, n, layout, Cluster(nodes=2), seq_len=131072, local_batch=1, accum=2
        )
        by = {c.dim: c for c in comms}
        kv_dim = 1024 // tp  # TP splits the kv heads
        expected = 2 * kv_all_gather_bytes(131072, 1, kv_dim, cp, 32, 2, recompute=False)
        assert (by["cp"].bytes, by["cp"].link, by["cp"].exposed) == (expected, link, True)
        # FSDP spans dp x cp: the weights are gathered over all of them
        assert by["dp_shard_cp"].size == layout.dp * cp == 16 // tp


def test_ulysses_volume_and_memory_by_hand():
    """Llama 3 8B at 128K, Ulysses: per layer each rank's q and output (65,536 x 4096 bf16 at
    CP 2) and k and v (x 1024) go to head shards and back, half of each leaving the rank, and
    their gradients in backward: 2 x 32 x 65,536 x 10,240 x 2 B / 2 = 40 GiB per micro-step at
    CP 2, falling as 1/cp, where the K/V all-gather grows toward the whole sequence's K/V. In
    memory no gathered K/V; each layer keeps the whole sequence's block mask, and one layer's
    backward the all-to-all buffers; the CP comm line of a Ulysses layout counts it."""
    by_cp = {cp: ulysses_all_to_all_bytes(131072, 1, 4096, 1024, cp, 32, 2, recompute=False)
             for cp in (2, 4, 8)}  # fmt: skip
    assert by_cp[2] == 40 << 30 and by_cp[4] == by_cp[2] * 3 / 4 and by_cp[8] == by_cp[2] * 7 / 16
    gathers = [kv_all_gather_bytes(131072, 1, 1024, cp, 32, 2, False) for cp in (2, 4, 8)]
    assert gathers == sorted(gathers) and gathers[0] < gathers[-1]
    c = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 2, method="ulysses")
    mask = block_mask_bytes(65536, 131072, 1)
    assert (c.kv, c.masks) == (block_mask_bytes(131072, 131072, 1), mask)
    assert c.transient == 2 * 65536 * (4096 + 1024) * 2
    layout = Layout(tp=1, pp=1, dp=4, cp=2, cp_method="ulysses")
    n = 8_030_261_248
    comms = comm_per_step(
        LLAMA3_8B_128K, n, layout, Cluster(nodes=1), seq_len=131072, local_batch=1, accum=1
    )
    cp = next(c for c in comms if c.dim == "cp")
    assert cp.bytes == by_cp[2] and "Ulysses" in cp.what


def test_advise_search_with_cp_keeps_the_world_and_the_chunks():
    """Every layout tried multiplies to the world size with its CP degree, uses CP degrees that
    are powers of two splitting the sequence into 2 x cp chunks, and the FSDP states of a CP
    layout are those of FSDP over dp x cp ranks."""
    spec = get_model_spec("llama3")
    work = Workload(LLAMA3_8B_128K, 8_030_261_248, 2.5e11, 131072, 32, spec.block_activation_bytes)
    cluster = Cluster(nodes=1, memory_gib=141)
    advice = advise(work, cluster)
    assert all(c.layout.tp * c.layout.pp * c.layout.dp * c.layout.cp == 8 for c in advice.tried)
    assert {c.layout.cp for c in advice.tried} == {1, 2, 4, 8}
    assert all(c.layout.cp * c.layout.tp <= 8 for c in advice.tried)
    odd = dataclasses.replace(work, seq_len=131072 + 8)  # 2 x 8 chunks do not divide it
    assert {c.layout.cp for c in advise(odd, cluster).tried} == {1, 2, 4}
    best = advice.best
    assert best is not None and best.layout.cp > 1 and fits(best, cluster)
    assert not any(fits(c, cluster) for c in advice.tried if c.layout.cp == 1 and c.layout.tp == 1)
    # the search's states are FSDP's over dp x cp: CP 4 x FSDP 2 differs from FSDP 8 alone by
    # the activations only
    block, n = spec.block_activation_bytes, 8_030_261_248
    split, alone = Layout(1, 1, 2, ac="full", cp=4), Layout(1, 1, 8, ac="full")
    mem = [analytic_memory(LLAMA3_8B_128K, n, x, 131072, 1, 128256, block) for x in (split, alone)]
    act = [
        analytic_activations(LLAMA3_8B_128K, x, 131072, 1, 128256, block) for x in (split, alone)
    ]
    assert mem[0] - mem[1] == pytest.approx(act[0] - act[1], abs=2)
    # both CP methods are tried where each TP x CP rank gets whole heads (8 KV heads: copies
    # up to CP 8 at TP 1), the all-gather alone without CP or where the heads do not split
    methods = {(c.layout.tp, c.layout.cp, c.layout.cp_method) for c in advice.tried}
    assert {(1, 8, "ulysses"), (2, 4, "ulysses"), (1, 2, "allgather")} <= methods
    assert all(m == "allgather" for t, cp, m in methods if cp == 1)
    kv6 = dataclasses.replace(
        LLAMA3_8B_128K, dim=4080, n_heads=24, n_kv_heads=6
    )  # 6 KV heads: split by CP 2, neither split by nor dividing CP 4 or 8
    tried = {(c.layout.tp, c.layout.cp, c.layout.cp_method)
             for c in advise(dataclasses.replace(work, model_args=kv6), cluster).tried}  # fmt: skip
    assert (1, 2, "ulysses") in tried and (1, 2, "allgather") in tried
    assert not any(m == "ulysses" for t, cp, m in tried if cp in (4, 8) and t == 1)


def test_advise_proposes_cp_for_llama3_8b_at_128k_on_8_gpus():
    """Llama 3 8B at 128K on one node of 8 GPUs of 141 GB (131 GiB): CP > 1, and why: CP 1 does
    not fit, CP's K/V traffic against TP's at the same degree, the other CP degrees."""
    cli = estimate_script()
    out = io.StringIO()
    args = ["--advise", "--config", "llama3_8b", "--training.seq_len", "131072"]
    with contextlib.redirect_stdout(out):
        assert cli.main([*args, "--nodes", "1", "--device-memory-gib", "131"]) == 0
    text = out.getvalue()
    found = re.search(r"Proposed: TP (\d+) x PP (\d+) x CP (\d+) x FSDP (\d+)", text)
    assert found, text
    tp, pp, cp, dp = map(int, found.groups())
    assert cp > 1 and tp * pp * cp * dp == 8
    assert f"- CP {cp}: each rank holds {131072 // cp:,} of every sequence's 131,072" in text
    assert f"- CP 1 at TP {tp} x PP {pp}: does not fit" in text
    assert f"- CP {cp} instead of TP {tp * cp}: CP sends" in text
    assert f"cp ({cp} ranks over NVLink)" in text
    checked = text.split("Checked with the real parallelize functions")[1]
    assert f"tp={tp} ep=1 cp={cp}" in checked and " fits" in checked
    assert f"s=131072/cp {cp} = {131072 // cp}" in checked


@pytest.mark.parametrize("world,tp,cp", [(4, 1, 2), (4, 1, 4), (8, 2, 2)])
def test_cp_states_are_sharded_over_dp_shard_x_cp(world, tp, cp):
    """The real parallelize functions (FSDP over "dp_shard_cp"): a CP layout holds the same
    parameter, gradient and AdamW bytes as FSDP alone over its dp_shard x cp ranks, and the
    world is pp x dp_replicate x dp_shard x cp x tp."""
    spec = get_model_spec("llama3")
    cfg = tiny_cfg(f"--parallelism.tensor_parallel_degree {tp}")
    base = simulate(spec, tiny_args(cfg), cfg, world, device_type="cpu", ranks=[0]).ranks[0]
    cfg = tiny_cfg(
        f"--parallelism.tensor_parallel_degree {tp} --parallelism.context_parallel_degree {cp}"
    )
    plan = simulate(spec, tiny_args(cfg), cfg, world, device_type="cpu", ranks=[0])
    assert plan.dims.dp_shard * plan.dims.cp * plan.dims.tp == world
    assert plan.dims.dp_shard == world // (tp * cp)
    rank = plan.ranks[0]
    assert (rank.params, rank.grads, rank.optimizer) == (base.params, base.grads, base.optimizer)
    n = 647_488  # the tiny model's parameters
    if tp == 1:  # fp32 on CPU, 1/world of every parameter
        assert rank.params == 4 * n // world


def test_document_mask_adds_its_block_mask_without_cp():
    """Document masking at CP 1 adds one block mask per micro-batch (int32 block indices over
    1024 x 1024 blocks of 128 tokens, 16 MiB at 128K), nothing per layer: the block-sparse
    kernels keep what SDPA keeps."""
    plain, masked = _cp_activations(1), _cp_activations(1, extra="--training.document_mask")
    a = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 1, document_mask=True)
    assert (a.kv, a.masks, a.transient) == (0, 4 * (2 * 2048 + 4 * 1024 * 1024), 0)
    assert masked.total == plain.total + a.masks


def test_cp_attention_terms_equal_what_autograd_saves_on_cpu():
    """One bf16 grouped-query Llama block (8 heads, 2 K/V heads) on CP rank 0 of 4, 256 of 1024
    tokens, through the real CP attention (`apply_context_parallel`: K/V all-gathered over a
    fake 4-rank group, which gives the gathered sizes) with the rank's positions and documents
    from `sequence_inputs` and the model's block masks (`attention_batch`). What autograd saves
    beyond the same block on 256 tokens alone (same document-masked backend) is exactly
    `attention_bytes`' per-layer term, the full-length K and V at the K/V heads' size instead
    of the local ones; the block mask's tensors are its `masks` term."""
    from torch.distributed.device_mesh import init_device_mesh

    from models.attention import attention_batch
    from parallelisms.context_parallel import apply_context_parallel
    from training.inputs import SequenceSplit, sequence_inputs

    s, cp, b = 1024, 4, 1
    local = s // cp
    shape = {"dim": 256, "n_heads": 8, "n_kv_heads": 2}
    args = build_model_args("llama3", "debugmodel", s, None, shape)
    model = get_model_spec("llama3").model_cls(args).to(torch.bfloat16)
    model.init_buffers("cpu")
    specs = model.attention_specs
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.rope.untyped_storage().data_ptr())
    x = torch.randn(b, local, args.dim, dtype=torch.bfloat16, requires_grad=True)

    def coordinates(batch):
        tensors = [batch.positions, batch.key_positions, batch.documents, batch.key_documents]
        tensors += [t for m in batch.masks.values() for t in m.as_tuple()]
        return [t for t in tensors if isinstance(t, torch.Tensor)]

    # document masking over one document (no end token): causal, through the block mask
    docs = torch.zeros(b, local, dtype=torch.int32)
    own = attention_batch(specs, b, local, torch.device("cpu"), documents=docs)
    skip |= {t.untyped_storage().data_ptr() for t in coordinates(own)}
    alone = saved_bytes(model.layers["0"], x, skip, model.rope, own)
    tokens = torch.zeros(b, s, dtype=torch.long)
    one = torch.zeros(b, s, dtype=torch.int32)
    _, _, inputs = sequence_inputs(SequenceSplit(0, cp, document_mask=True), tokens, tokens, one)
    batch = attention_batch(specs, b, local, torch.device("cpu"), **inputs)
    rope = model.rope[inputs["positions"]]
    skip |= {t.untyped_storage().data_ptr() for t in [rope, *coordinates(batch)]}
    with fake_world(cp):
        assert apply_context_parallel(model, init_device_mesh("cpu", (cp,))) == args.n_layers
        with_cp = saved_bytes(model.layers["0"], x, skip, rope, batch)
    c = attention_bytes(args, s, b, 1, cp, document_mask=True, specs=specs)
    assert c.kv == 2 * (s - local) * 64 * 2
    assert with_cp - alone == c.kv
    (mask,) = batch.masks.values()
    assert c.masks == sum(t.nbytes for t in mask.as_tuple() if isinstance(t, torch.Tensor))

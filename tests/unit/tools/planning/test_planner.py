"""The planner's arithmetic by hand, its refusals through the trainer's validation, and the CLI.

Exactness against megatron's real allocations and gloo's real traffic is checked in
tests/distributed/test_planner_matches_megatron.py; activation memory in tools/bench_plan_memory.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gspo_megatron.policy.models.config import MoEModelConfig, preset
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.testing.model_fixtures import tiny_test_config
from planning.hardware import gpu_spec
from planning.parameters import ParamSpec, StateWidths, buffer_layout, owned_elements, state_bytes
from planning.planner import PlanError, PlanOptions, plan_layout, rank_layouts
from planning.rl_step_memory import EmbeddedEngineShape


def test_buffer_padding_replays_megatron_by_hand():
    # Parameters go in reverse order: b (30) at [0, 30); a starts at the next multiple of 64: [64, 164);
    # the bucket ends at the next multiple of lcm(dp=2, 128) = 128: 256 elements.
    params = [ParamSpec("a", 100, False), ParamSpec("b", 30, False)]
    plain = buffer_layout(params, dp=2, distributed_optimizer=False)
    assert plain.numel == 130 and plain.buckets == ((0, 130),)
    sharded = buffer_layout(params, dp=2, distributed_optimizer=True)
    assert sharded.numel == 256
    assert sharded.param_ranges == ((0, 30, 0), (64, 164, 0))
    # rank 0 owns [0, 128): all of b and 64 of a; rank 1 owns [128, 256): the last 36 of a.
    assert owned_elements(sharded, 0) == 94 and owned_elements(sharded, 1) == 36


def test_state_bytes_by_hand_for_the_tiny_pp_stage():
    cfg = tiny_test_config()  # h 32, V 32, 2 layers, 4 heads / 2 kv of 8, 4 experts of 16
    layout = ParallelLayout(pp=2, world_size=2).validate(cfg)
    layer = 32 + 32 + 32 * 32 + (4 + 4) * 8 * 32 + 8 + 8 + 4 * 32 + 4 * (2 * 16 * 32 + 32 * 16)
    first = 32 * 32 + layer  # embedding + layer 0
    got = state_bytes(cfg, layout, 0, dtype="float32", distributed_optimizer=False)
    assert got.parameters == got.gradients == first * 4
    assert got.optimizer == 2 * first * 4  # Adam moments, no master copy for fp32
    bf16 = state_bytes(cfg, layout, 0, dtype="bfloat16", distributed_optimizer=False)
    # every weight in bf16 (the RMSNorm weights too); each gets an fp32 master copy beside Adam's moments
    assert bf16.parameters == first * 2
    assert bf16.optimizer == 2 * first * 4 + first * 4
    # the precision-aware optimizer's state dtypes: bf16 moments (2 + 2 bytes), an fp16 master (2)
    reduced = state_bytes(
        cfg,
        layout,
        0,
        dtype="bfloat16",
        distributed_optimizer=False,
        widths=StateWidths(master=2, exp_avg=2, exp_avg_sq=2),
    )
    assert reduced.optimizer == first * (2 + 2 + 2) and reduced.parameters == bf16.parameters


def test_the_planner_reads_the_state_dtypes_from_the_config():
    from planning.job import compose_job, plan_job

    base = ["model.dtype=bfloat16", "optimizer.distributed=true", "optimizer.precision_aware=true"]
    fp32 = compose_job(base, gpus=2, prompt_tokens=8)
    bf16 = compose_job(
        base + ["optimizer.exp_avg_dtype=bfloat16", "optimizer.exp_avg_sq_dtype=bfloat16"], gpus=2, prompt_tokens=8
    )
    assert fp32.options.state_widths == StateWidths() and bf16.options.state_widths == StateWidths(4, 2, 2)
    plans = [plan_job(job, gpu_spec("h100")) for job in (fp32, bf16)]
    # Adam's moments are 8 of the 12 bytes per owned element: bf16 halves them
    assert plans[1].memory.state.optimizer * 12 == plans[0].memory.state.optimizer * 8


def test_trainer_validation_refuses_the_layout():
    model = preset("qwen3_30b_a3b")
    with pytest.raises(ValueError, match="etp\\*ep\\*pp = 4\\*8\\*1 = 32 does not divide the world size 8"):
        plan_layout(model, ParallelLayout(tp=4, ep=8, world_size=8), PlanOptions(), gpu_spec("h100"))


def test_trainer_batch_rules_refuse_a_batch_the_layout_cannot_split():
    model = preset("qwen3_30b_a3b")
    options = PlanOptions(seq_len=8192, micro_batch_tokens=8192, global_batch_tokens=8 * 8192, group_size=8)
    with pytest.raises(PlanError, match="not divisible by the data-parallel size 16"):
        plan_layout(model, ParallelLayout(tp=1, ep=16, world_size=16), options, gpu_spec("h100"))


def test_ranking_ties_layouts_within_the_time_band_and_prefers_headroom():
    model = MoEModelConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=256,
    )
    options = PlanOptions(seq_len=1024, micro_batch_tokens=2048, global_batch_tokens=16 * 1024, group_size=4)
    fitting, too_big = rank_layouts(model, 4, options, gpu_spec("h100"))
    assert fitting and not too_big
    fastest = min(plan.time.total_s for plan in fitting)
    tied = [plan for plan in fitting if plan.tied]
    assert tied == fitting[: len(tied)] and tied  # the fastest is tied with itself
    # tied: the band reaches the fastest layout's upper end; most headroom (least memory) first
    assert all(plan.time.lower_s <= fastest for plan in tied)
    assert all(plan.time.lower_s > fastest for plan in fitting[len(tied) :])
    assert [p.peak_bytes for p in tied] == sorted(p.peak_bytes for p in tied)  # the whole RL step's peak
    rest = [plan.time.total_s for plan in fitting[len(tied) :]]
    assert rest == sorted(rest)
    tiny_gpu = gpu_spec("h100", memory_bytes=1e6)  # nothing fits in 1 MB
    fitting, too_big = rank_layouts(model, 4, options, tiny_gpu)
    assert not fitting and too_big


def test_plan_cli_prints_a_layout_and_refuses_a_bad_one(capsys):
    tool = Path(__file__).resolve().parents[4] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    main = plan_tool.main

    assert main(["qwen3_235b_a22b", "tp4_ep16_etp1", "--gpus", "64", "--recompute"]) == 0
    out = capsys.readouterr().out
    assert "235.09B parameters, 22.19B active" in out and "update phase total" in out and "RL step peak by phase" in out
    assert main(["qwen3_30b_a3b", "tp4_ep8_etp4", "--gpus", "8"]) == 2
    assert "refused: etp*ep*pp" in capsys.readouterr().out


@pytest.mark.parametrize("replay", ["none", "old_policy", "rollout"])
def test_every_routing_replay_mode_plans_and_replay_buffers_cost_memory(replay):
    """The planner takes the trainer's own mode names (tools/plan.py once offered "old", which the
    trainer's validation refused for every layout: the plan came out empty, silently)."""
    model = tiny_test_config(num_layers=4)
    layout = ParallelLayout(ep=2, world_size=2)
    options = PlanOptions(seq_len=32, micro_batch_tokens=64, global_batch_tokens=256, group_size=4)
    plan = plan_layout(model, layout, PlanOptions(**{**options.__dict__, "routing_replay": replay}), gpu_spec("h100"))
    assert (plan.memory.routing_replay > 0) == (replay != "none")
    tool = Path(__file__).resolve().parents[4] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    assert plan_tool.main(["qwen3_30b_a3b", "tp4_ep8_etp1", "--gpus", "8", "--routing-replay", replay]) == 0


def test_weight_sync_plan_packs_the_export_greedily_and_bounds_the_driver_by_hand():
    from gspo_megatron.testing.model_fixtures import tiny_test_config
    from planning.comm import weight_sync_plan

    cfg = tiny_test_config()  # vocab 32, hidden 32, 2 layers, q 4 x 8, kv 2 x 8, 4 experts of 16
    # bf16 bytes: embedding 2048; per layer: norms 64 + 64, q 2048, k 1024, v 1024, o 2048, q/k norms
    # 16 + 16, router 256, experts 4 x (1024 + 1024 + 1024) = 18848; final norm 64; head 2048
    plan = weight_sync_plan(cfg, bucket_bytes=4096, link_bytes_per_s=1000.0)
    assert plan.bytes == 2048 + 2 * 18848 + 64 + 2048 == cfg.parameter_count()["total"] * 2
    # walking the names: [embed, ln] | [q] ... a bucket closes when the next tensor would overflow 4096
    assert plan.buckets == 12
    assert plan.driver_extra_bytes == 4096 + 2048  # a bucket being filled + the largest tensor
    assert plan.seconds == pytest.approx(41856 / 1000.0)
    whole = weight_sync_plan(cfg, bucket_bytes=10**9, link_bytes_per_s=1000.0)
    assert whole.buckets == 1 and whole.driver_extra_bytes == 10**9 + 2048
    tiny = weight_sync_plan(cfg, bucket_bytes=1, link_bytes_per_s=1000.0)  # every tensor alone
    assert tiny.buckets == 3 + 2 * (9 + 4 * 3)  # embedding, norm, head; per layer 9 + 3 per expert


def load_plan_tool():
    tool = Path(__file__).resolve().parents[4] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", tool)
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    return plan_tool


def test_capacity_is_what_torch_allocates_in_gib():
    h100 = gpu_spec("h100")
    assert h100.memory_bytes == 79.19 * 2**30  # torch's total_memory on an H100 80GB, not 80e9 bytes
    assert h100.usable_memory_bytes == (79.19 - 4) * 2**30  # less the stated 4 GiB reserve
    assert gpu_spec("h100", reserve_bytes=0).usable_memory_bytes == h100.memory_bytes


def test_a_shipped_layout_name_means_what_parallel_name_means():
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config

    plan_tool = load_plan_tool()
    for name in ("tp4_ep8", "tp2_ep2", "cp2"):
        shipped = to_train_config(compose([f"parallel={name}"])).parallel.layout(8)
        assert plan_tool.parse_layout(name, 8) == shipped, name
    assert plan_tool.parse_layout("tp4_ep8", 8).expert_tp == 1  # conf/parallel/tp4_ep8.yaml: etp 1
    assert plan_tool.parse_layout("tp2_ep8", 8).expert_tp == 2  # an unshipped name: etp = tp (etp=null)


def test_the_235b_model_config_is_the_shipped_shape():
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config

    model = to_train_config(compose(["model=qwen3_235b_a22b"])).model
    shipped = MoEModelConfig.from_hf_config_file(
        Path(__file__).resolve().parents[4] / "tools" / "planning" / "hf_configs" / "qwen3_235b_a22b.json"
    )
    assert {key: getattr(model, key) for key in shipped.to_dict()} == shipped.to_dict()
    assert model.parameter_count() == shipped.parameter_count()


def test_job_options_come_from_the_composed_config_by_hand():
    from planning.job import compose_job

    job = compose_job(
        ["parallel=tp2", "algorithm.kl.coef=0.1", "trainer.updates_per_rollout=4", "model.dtype=bfloat16"],
        gpus=4,
        prompt_tokens=8,
    )
    o = job.options
    # conf/config.yaml: 16 prompts x 16 responses, max_new_tokens 3, micro_batch_size 128
    assert o.seq_len == 8 + 3 - 1  # the fed tokens[:, :-1], a multiple of tp 2 (sequence parallelism)
    assert o.global_batch_tokens == 16 * 16 // 4 * 10  # 64 rows per optimizer step
    assert o.micro_batch_tokens == 32 * 10  # min(128, 64 rows / dp 2) rows per micro-batch
    assert o.distributed_optimizer  # optimizer.distributed=auto and dp = 4 / tp 2 = 2 > 1
    assert o.reference_model and o.old_log_prob_pass and o.updates_per_rollout == 4
    assert o.dtype == "bfloat16" and o.dispatcher == "alltoall" and not o.recompute
    assert o.rollout is not None and o.rollout.colocated and o.rollout.sequences == 256  # embedded engine
    # rollout.embedded.dtype, max_batch_size, and the lean forward (the default, serving the Qwen3-MoE family)
    assert o.embedded_engine == EmbeddedEngineShape("float32", 256, lean=True)
    padded = compose_job(["parallel=tp2"], gpus=2, prompt_tokens=8 + 1).options
    assert padded.seq_len == 12  # 9 + 3 - 1 fed tokens, padded to the multiple of tp 2
    off = compose_job(["optimizer.distributed=false", "trainer.old_log_probs=rollout"], gpus=2, prompt_tokens=8)
    assert not off.options.distributed_optimizer and not off.options.old_log_prob_pass
    assert not off.options.reference_model  # kl_coef 0: no reference model
    single = compose_job([], gpus=1, prompt_tokens=8)
    assert not single.options.distributed_optimizer  # auto with dp 1


def test_job_refuses_what_the_trainer_refuses_with_its_message(capsys):
    from planning.job import compose_job

    with pytest.raises(ValueError, match="etp\\*ep\\*pp = 1\\*8\\*1 = 8 does not divide the world size 4"):
        compose_job(["model=qwen3_30b_a3b", "parallel=tp4_ep8"], gpus=4, prompt_tokens=8)
    plan_tool = load_plan_tool()
    assert plan_tool.main(["model=qwen3_30b_a3b", "parallel=tp4_ep8", "--gpus", "4"]) == 2
    assert "refused by the trainer's validation: etp*ep*pp" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="trainer.recompute_activations=true"):
        plan_tool.main(["model=qwen3_30b_a3b", "--recompute"])  # config mode: the config decides


def test_reference_model_costs_its_weights_in_the_model_dtype_by_hand():
    from planning.planner import memory_of_stage

    cfg = tiny_test_config()
    layout = ParallelLayout(pp=2, world_size=2).validate(cfg)
    layer = 32 + 32 + 32 * 32 + (4 + 4) * 8 * 32 + 8 + 8 + 4 * 32 + 4 * (2 * 16 * 32 + 32 * 16)
    options = PlanOptions(seq_len=8, micro_batch_tokens=16, global_batch_tokens=64, group_size=4)
    without = memory_of_stage(cfg, layout, options, 0, micro_batches=4)
    ref = PlanOptions(**{**options.__dict__, "reference_model": True})
    with_ref = memory_of_stage(cfg, layout, ref, 0, micro_batches=4)
    assert with_ref.reference_weights == (32 * 32 + layer) * 2  # embedding + layer 0, bf16
    assert with_ref.total - without.total == with_ref.reference_weights


def test_an_offloaded_reference_is_on_the_device_only_in_its_pass_by_hand():
    """trainer.reference_offload: the weights leave the resident bytes and the update's peak; the reference
    pass holds them beside its forward-only activations; a node's host memory holds them, once per rank."""
    from planning.planner import memory_of_stage

    cfg = tiny_test_config()
    layout = ParallelLayout(pp=2, world_size=2).validate(cfg)
    base = dict(seq_len=8, micro_batch_tokens=16, global_batch_tokens=64, group_size=4, reference_model=True)
    on_device = memory_of_stage(cfg, layout, PlanOptions(**base), 0, micro_batches=4)
    offloaded = memory_of_stage(cfg, layout, PlanOptions(**base, reference_offload=True), 0, micro_batches=4)
    weights = on_device.reference_weights
    assert offloaded.reference_weights == weights > 0
    assert on_device.resident - offloaded.resident == weights
    assert offloaded.reference_pass == offloaded.old_log_prob_pass + weights
    assert on_device.reference_pass == on_device.old_log_prob_pass
    assert (on_device.host, offloaded.host) == (0, weights)
    options = PlanOptions(**base, reference_offload=True)
    plan = plan_layout(cfg, layout, options, gpu_spec("h100"))
    last = memory_of_stage(cfg, layout, options, 1, micro_batches=4)
    assert plan.host_per_node == 2 * max(offloaded.host, last.host)  # the node's 2 ranks at the worst one's
    phases = plan.rl_memory[0].phases
    assert phases["ref_logp"] - phases["old_logp"] == weights  # the weights come in for the reference pass only
    # ... over the host link: the worst stage's reference bytes at PCIe x link efficiency
    gpu = gpu_spec("h100")
    on_device_plan = plan_layout(cfg, layout, PlanOptions(**base), gpu)
    link = gpu.pcie_bandwidth * gpu.link_efficiency
    in_s = plan.rl.reference_s - on_device_plan.rl.reference_s
    assert in_s == pytest.approx(max(offloaded.reference_weights, last.reference_weights) / link)


def test_rl_step_adds_its_phases_in_the_trainers_order_by_hand():
    from planning.step_time import StepTime, rl_step_time

    update = StepTime(8.0, {}, 0.0, total_s=10.0, tokens_per_s_per_gpu=0.0, lower_s=8.0, forward_s=3.0)
    kwargs = dict(updates_per_rollout=2, old_log_prob_pass=True, reference_model=True)
    rl = rl_step_time(update, rollout_s=20.0, sync_s=1.0, overlapped=False, **kwargs)
    # rollout 20 + old log-probs 2 x 3 + reference 2 x 3 + 2 updates x 10 + sync 1
    assert (rl.old_log_prob_s, rl.reference_s, rl.updates_s) == (6.0, 6.0, 20.0)
    assert rl.total_s == 53.0
    # async rollout on GPUs of its own: generation beside the 32 s of training, then the sync
    assert rl_step_time(update, rollout_s=20.0, sync_s=1.0, overlapped=True, **kwargs).total_s == 33.0


@pytest.mark.parametrize("recompute", [False, True])
def test_forward_pass_is_a_third_of_an_update_without_communication(recompute):
    """One rank: no traffic, no bubble; backward = 2 forwards (+1 with full recompute)."""
    from planning.activations import MicroBatchShape
    from planning.comm import Traffic
    from planning.step_time import step_time

    cfg = tiny_test_config()
    layout = ParallelLayout().validate(cfg)
    update = step_time(cfg, layout, MicroBatchShape(2, 8), 3, [Traffic()], gpu_spec("h100"), recompute)
    assert update.forward_s == pytest.approx(update.total_s / (4 if recompute else 3))
    assert update.lower_s == update.total_s  # nothing to overlap


def test_rollout_roofline_by_hand():
    from planning.step_time import RolloutShape, rollout_seconds

    cfg = tiny_test_config()  # 20928 parameters, 14784 active; 2 layers of 4 experts (3 x 32 x 16 each), top-2
    gpu = gpu_spec("h100", bf16_tflops=1e-6, mfu=1.0, hbm_bandwidth=1e6)  # 1e6 FLOP/s, 1e6 B/s
    shape = RolloutShape(sequences=4, prompt_tokens=10, response_tokens=6, servers=2, engine_tp=1, colocated=False)
    # 2 sequences per server; prefill 2 x 14784 x 2 x 10 FLOPs
    prefill = 2 * 14784 * 2 * 10 / 1e6
    # decode: every expert is touched with probability 1 - (1 - 2/4)^2 = 0.75; expert weights 2 x 4 x 1536
    weights = (20928 - 12288 + 0.75 * 12288) * 2
    kv = 2 * (10 + 3) * (2 * 2 * 2 * 8 * 2)  # 2 sequences x mean context x K and V of 2 layers, bf16
    per_token = max((weights + kv) / 1e6, 2 * 14784 * 2 / 1e6)
    assert rollout_seconds(cfg, shape, gpu) == pytest.approx(prefill + 6 * per_token)


def test_uneven_and_virtual_pipeline_stages_by_hand():
    from planning.parameters import stage_layers
    from planning.pipeline import bubble_slots, in_flight_factor

    shape = tiny_test_config(num_layers=10)
    slime_like = ParallelLayout(pp=4, last_stage_layers=1, world_size=4).validate(shape)  # 10 = 3 + 3 + 3 + 1
    assert [len(stage_layers(shape, slime_like, r)) for r in range(4)] == [3, 3, 3, 1]
    assert stage_layers(shape, slime_like, 3) == [9]
    # pp 2 x vpp 2: rank 0 holds 2 layers (1 per chunk), rank 1 the other 8 (4 per chunk); virtual
    # stages in model order are 1 | 4 | 1 | 4 layers (chunk c of rank r is virtual stage 2c + r)
    interleaved = ParallelLayout(pp=2, vpp=2, first_stage_layers=2, world_size=2).validate(shape)
    assert stage_layers(shape, interleaved, 0) == [0, 5]
    assert stage_layers(shape, interleaved, 1) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert in_flight_factor(interleaved) == 1 + 1 / 4 and bubble_slots(interleaved) == 0.5
    with pytest.raises(ValueError, match="cannot share the remaining 9 layers evenly"):
        ParallelLayout(pp=3, last_stage_layers=1, world_size=3).validate(shape)  # 9 over the other 2 stages
    with pytest.raises(ValueError, match="not a multiple of vpp = 2"):
        ParallelLayout(pp=2, vpp=2, first_stage_layers=3, world_size=2).validate(shape)
    # the plan: both are the trainer's, checked by its own validation
    options = PlanOptions(seq_len=8, micro_batch_tokens=16, global_batch_tokens=64, group_size=4)
    for layout in (slime_like, interleaved):
        assert plan_layout(shape, layout, options, gpu_spec("h100")).fits


def test_the_published_235b_layouts_are_plannable():
    plan_tool = load_plan_tool()
    for layout, gpus in (("tp4_pp4_cp2_ep16_etp1_last22", 64), ("tp1_pp8_ep32_etp1_vp2_last10", 256)):
        args = ["qwen3_235b_a22b", layout, "--gpus", str(gpus), "--recompute", "--global-batch-tokens", "2097152"]
        # interleaved 1F1B wants >= pp micro-batches per rank: 8 sequences per rank, one per micro-batch
        assert plan_tool.main(args + ["--micro-batch-tokens", "8192"]) == 0, layout


def test_portable_context_parallel_attention_counts_the_gathered_keys_and_values_by_hand():
    """Portable CP attention all-gathers K/V before SDPA (``policy/parallel/context_parallel.py``): SDPA keeps
    cp*T repeated keys and values, and each layer keeps its bool causal mask [S/cp, S]."""
    from planning.activations import MicroBatchShape, activation_bytes, attention_elements

    model = MoEModelConfig(
        num_layers=1, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2, vocab_size=16,
        num_experts=2, top_k=1, moe_intermediate_size=4, max_position_embeddings=64,
    )  # fmt: skip
    cp2, one = ParallelLayout(world_size=2, cp=2), ParallelLayout(world_size=1)
    t = 6.0  # tokens on the rank after the CP split; Q = 4*2 = 8, K = 2*2 = 4 per token
    # norm 3*6*8=144, qkv 6*16=96, q/k norms 2*6*12=144, rope'd q 48, SDPA output and copy 2*6*8=96, lse 24
    shared = 144 + 96 + 144 + 48 + 96 + 24
    assert attention_elements(model, one, t) == shared + 2 * 6 * 8  # GQA: K and V repeated to Q heads
    assert attention_elements(model, cp2, t) == shared + 2 * (2 * 6) * 8  # ... of the gathered 12 tokens
    assert attention_elements(model, cp2, t, spec="te") == attention_elements(model, one, t, spec="te")
    micro = MicroBatchShape(sequences=3, seq_len=4)  # 12 tokens, 6 per CP rank
    portable = activation_bytes(model, cp2, micro, pp_rank=0)
    te = activation_bytes(model, cp2, micro, pp_rank=0, spec="te")
    mask = 4 // 2 * 4  # [S/cp, S] bools
    assert (
        portable.per_layer[0] - te.per_layer[0]
        == 4 * (attention_elements(model, cp2, t) - attention_elements(model, cp2, t, spec="te")) + mask
    )


def test_optimizer_offload_moves_the_adam_moments_off_the_device_by_hand():
    """optimizer.cpu_offload keeps the distributed optimizer's fp32 main shards on the device (megatron's
    host optimizer steps host copies of them): with bf16 weights 8 of the 12 optimizer bytes per owned
    parameter leave it, scaled by the offload fraction."""
    shape = tiny_test_config(num_layers=2)
    layout = ParallelLayout(world_size=2).validate(shape)
    base = dict(seq_len=8, micro_batch_tokens=16, global_batch_tokens=64, group_size=4, dtype="bfloat16")
    device = plan_layout(shape, layout, PlanOptions(**base), gpu_spec("h100")).memory
    for fraction in (1.0, 0.5):
        options = PlanOptions(**base, optimizer_offload=fraction)
        offloaded = plan_layout(shape, layout, options, gpu_spec("h100")).memory
        assert offloaded.state == device.state
        assert device.resident - offloaded.resident == round(device.state.optimizer * 2 / 3 * fraction) > 0
        # on the host: an fp32 copy, its fp32 gradient and two fp32 moments per parameter stepped there
        owned = device.state.optimizer / 12  # fp32 master + two moments per owned parameter (bf16 weights)
        assert offloaded.host == round(owned * 16 * fraction)
        # the precision-aware optimizer: no fp32 main shards on the device, the master is the host copy
        aware = plan_layout(
            shape, layout, PlanOptions(**base, optimizer_offload=fraction, precision_aware=True), gpu_spec("h100")
        ).memory
        assert device.resident - aware.resident == round(device.state.optimizer * fraction)
        assert aware.host == offloaded.host


def test_a_colocated_engine_holds_its_share_while_resumed_by_hand():
    """rollout.placement=colocated with SGLang: in the rollout and the weight sync each GPU holds the
    engine's --mem-fraction-static share and not the trainer's gradient buffers; elsewhere the reverse."""
    from planning.job import static_memory_fraction
    from planning.rl_step_memory import rl_step_memory

    cfg = tiny_test_config()
    layout = ParallelLayout(world_size=2).validate(cfg)
    base = PlanOptions(seq_len=8, micro_batch_tokens=16, global_batch_tokens=64, group_size=4)
    row = plan_layout(cfg, layout, base, gpu_spec("h100")).memory
    separate = rl_step_memory(cfg, layout, base, row, driver=False)
    colocated = rl_step_memory(cfg, layout, base, row, driver=False, colocated_engine=10**9)
    for phase in ("rollout", "weight_sync"):
        assert colocated.phases[phase] - separate.phases[phase] == 10**9 - row.state.gradients
    for phase in ("old_logp", "ref_logp", "update"):
        assert colocated.phases[phase] == separate.phases[phase]
    options = PlanOptions(**{**base.__dict__, "colocated_engine_fraction": 0.5})
    plan = plan_layout(cfg, layout, options, gpu_spec("h100"))
    engine = int(0.5 * gpu_spec("h100").memory_bytes)
    assert plan.rl_memory[0].phases["rollout"] == separate.phases["rollout"] + engine - row.state.gradients
    assert static_memory_fraction(["--enable-memory-saver", "--mem-fraction-static", "0.7"]) == 0.7
    assert static_memory_fraction(["--mem-fraction-static=0.6"]) == 0.6
    with pytest.raises(ValueError, match="add --mem-fraction-static to rollout.sglang.extra_args"):
        static_memory_fraction(["--enable-memory-saver"])
    with pytest.raises(ValueError, match=r"--mem-fraction-static 1.5 must be in \(0, 1\)"):
        static_memory_fraction(["--mem-fraction-static", "1.5"])


def test_a_hub_id_in_the_cache_is_planned_with_its_checkpoints_shape(tmp_path, monkeypatch):
    """As the trainer: the cached snapshot's config.json decides the shape; the planner never downloads."""
    from gspo_megatron.policy.models.hf_checkpoint import write_hf_checkpoint
    from gspo_megatron.testing.hub_cache import cache_as_the_hub_does, use_offline_hub_cache
    from gspo_megatron.testing.model_fixtures import random_hf_state
    from planning.job import compose_job

    use_offline_hub_cache(monkeypatch, tmp_path / "hub")
    cfg = tiny_test_config(num_experts=8)
    folder = write_hf_checkpoint([list(random_hf_state(cfg).items())], cfg, tmp_path / "folder")
    cache_as_the_hub_does(folder, tmp_path / "hub", "tiny-org/tiny-moe")
    job = compose_job(["model.hf_checkpoint=tiny-org/tiny-moe"], gpus=1, prompt_tokens=8)
    assert job.config.model.num_experts == 8 and job.notes == ()
    missing = compose_job(["model.hf_checkpoint=tiny-org/not-cached"], gpus=1, prompt_tokens=8)
    assert "model.hf_checkpoint=tiny-org/not-cached is not on this machine" in missing.notes[0]

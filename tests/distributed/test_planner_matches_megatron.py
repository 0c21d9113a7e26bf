"""The planner's per-rank model-state bytes equal what megatron-core allocates, on every layout of the
equivalence suite (``testing/model_fixtures.py:EQUIVALENCE_LAYOUTS``), with and without the
distributed optimizer.

Counted on each rank from real tensors: the parameters of the built model, the DDP buffers
(``grad_data`` always, ``param_data`` with the distributed optimizer), fp32 and bf16 weights, and
the Adam state torch allocates after one optimizer step (fp32, no distributed optimizer). With the
distributed optimizer the owned shard is counted with megatron's own shard map
(``DistributedOptimizer._build_gbuf_range_map``, the function its constructor allocates from);
the allocated state itself is measured in ``tests/distributed/test_distributed_optimizer.py``.
One gloo launch per world size runs every layout.
"""

from __future__ import annotations

import re

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import EQUIVALENCE_LAYOUTS, fixed_batch, tiny_test_config
from gspo_megatron.testing.train_runs import TINY_JOB
from planning.activations import MicroBatchShape
from planning.comm import step_traffic
from planning.parameters import state_bytes

pytestmark = pytest.mark.distributed

FP32 = 4
SEQ_LEN = 12
MICRO_BATCHES = 2
# The planner models TE's ring context-parallel attention; the CPU runs use the portable one, which
# all-gathers K/V (policy/parallel/context_parallel.py) -- different traffic -- so CP layouts are left out here.
LAYOUTS = {name: kwargs for name, kwargs in EQUIVALENCE_LAYOUTS.items() if kwargs.get("cp", 1) == 1}


def _measure_state(mesh_layout, cfg, dtype: torch.dtype, distributed_optimizer: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from gspo_megatron.policy.models.builder import build_model

    model = build_model(cfg, mesh_layout, params_dtype=dtype, layer_spec="portable")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
        ),
        module=model,
    )
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    param_buffers = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers if b.param_data is not None)
    if distributed_optimizer:
        optimizer = 0
        for b in buffers:
            master = FP32 if b.param_dtype != torch.float32 else 0
            for bucket_map in DistributedOptimizer._build_gbuf_range_map(b)[(b.param_dtype, b.grad_dtype)]:
                owned = sum(r["param"].size for r in bucket_map["param_map"].values())
                optimizer += owned * (2 * FP32 + master)
        weights = param_buffers  # parameters are views into the param buffer now
    elif dtype == torch.float32:
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
        opt.step()  # torch's Adam allocates its moments on the first step
        optimizer = sum(
            t.numel() * t.element_size()
            for inner in opt.chained_optimizers
            for state in inner.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
    else:
        optimizer = None  # the bf16 optimizer without sharding: not measured here
    return {"parameters": weights, "gradients": grads, "param_buffers": param_buffers, "optimizer": optimizer}


def _measure_traffic(layout, cfg, mesh) -> dict:
    """Payload bytes per (group, collective) of one forward-backward step (2 micro-batches) and the
    gradient reduction, counted through gloo."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.algorithms.logprobs import vocab_parallel_log_probs
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.testing.collectives import count_collectives

    # the planner's traffic is exact for the allgather dispatcher; alltoall's is an estimate
    model = build_model(cfg, layout, layer_spec="portable", token_dispatcher="allgather")
    ddp = wrap_for_training(model, model.config)
    ddp.zero_grad_buffer()
    inputs, targets, _ = fixed_batch(cfg, batch=4, seq=SEQ_LEN)
    rows = inputs.shape[0] // layout.dp
    per_micro = rows // MICRO_BATCHES
    start = mesh.dp_rank * rows
    micro_batches = [
        MicroBatch(tokens=inputs[start + i : start + i + per_micro], targets=targets[start + i : start + i + per_micro])
        for i in range(0, rows, per_micro)
    ]

    def loss(logits, batch):
        logp, _ = vocab_parallel_log_probs(logits, batch.targets, tp_group=mesh.tp_group)
        return -logp.sum() / inputs.numel(), {}

    groups = {  # the groups megatron's DDP reduces over are the "partial" (intra-instance) ones
        "tp": mesh.tp_group,
        "pp": mesh.pp_group,
        "dp": ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group(),
        "dp_expert": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
    }
    with count_collectives(groups) as counter:
        run_schedule([ddp], micro_batches, loss, forward_only=False)
    return {"payload": counter.payload, "per_micro": per_micro}


def state_worker(ctx, cfg, layouts: dict) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    out = {}
    for name, kwargs in layouts.items():
        layout = ParallelLayout(**kwargs).validate(cfg)
        apply_cpu_bridges()
        mesh = initialize_parallel(layout, seed=5)
        ranks = {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "edp": ps.get_expert_data_parallel_rank()}
        for dtype in (torch.float32, torch.bfloat16):
            for dist_opt in (False, True):
                state = _measure_state(layout, cfg, dtype, dist_opt)
                out[(name, str(dtype), dist_opt)] = dict(state, **ranks)
        out[(name, "traffic")] = dict(_measure_traffic(layout, cfg, mesh), **ranks)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def measured():
    cfg = tiny_test_config()
    by_world: dict[int, dict] = {}
    for name, kwargs in LAYOUTS.items():
        by_world.setdefault(kwargs["world_size"], {})[name] = kwargs
    results = {}
    for world, layouts in by_world.items():
        results[world] = run_distributed(state_worker, world, cfg, layouts, timeout=600)
    return cfg, results


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_state_bytes_equal_megatron(measured, name, dtype, distributed_optimizer):
    cfg, results = measured
    kwargs = LAYOUTS[name]
    layout = ParallelLayout(**kwargs).validate(cfg)
    for rank, per_rank in enumerate(results[kwargs["world_size"]]):
        got = per_rank[(name, f"torch.{dtype}", distributed_optimizer)]
        predicted = state_bytes(
            cfg,
            layout,
            got["pp"],
            dtype=dtype,
            distributed_optimizer=distributed_optimizer,
            dp_rank=got["dp"],
            expert_dp_rank=got["edp"],
        )
        where = f"{name} rank {rank} {dtype} distributed_optimizer={distributed_optimizer}"
        assert predicted.parameters == got["parameters"], where
        assert predicted.gradients == got["gradients"], where
        assert predicted.param_buffers == got["param_buffers"], where
        if got["optimizer"] is not None:
            assert predicted.optimizer == got["optimizer"], where


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_communication_equals_gloo_payloads(measured, name):
    """Every byte handed to a collective in one training step (forward, backward, gradient
    reduction) is predicted, per group and collective, on every rank."""
    cfg, results = measured
    kwargs = LAYOUTS[name]
    layout = ParallelLayout(**kwargs).validate(cfg)
    for rank, per_rank in enumerate(results[kwargs["world_size"]]):
        got = per_rank[(name, "traffic")]
        predicted = step_traffic(
            cfg,
            layout,
            MicroBatchShape(got["per_micro"], SEQ_LEN),
            MICRO_BATCHES,
            pp_rank=got["pp"],
            width=FP32,
            dispatcher="allgather",
            distributed_optimizer=False,
            dtype="float32",
        )
        measured_payload = {key: float(value) for key, value in got["payload"].items()}
        assert measured_payload == predicted.payload, f"{name} rank {rank}"


# --- the planner plans the trainer's own job ---------------------------------------------------
# Hydra overrides of conf/ and the world size; each case is built by loop/build.py:build_trainer (the
# trainer's DDP wrapper, optimizer and reference model), then planned by tools/planning/job.py.
JOBS = {
    "dp2 auto -> distributed optimizer": (2, [*TINY_JOB, "model.layer_spec=portable"]),
    "tp2 bf16 kl reference": (
        2,
        [*TINY_JOB, "parallel=tp2", "model.dtype=bfloat16", "algorithm.kl.coef=0.01", "model.layer_spec=portable"],
    ),
    "ep2 distributed=false recompute": (
        2,
        [
            *TINY_JOB,
            "parallel=ep2",
            "optimizer.distributed=false",
            "trainer.recompute_activations=true",
            "model.layer_spec=portable",
        ],
    ),
    "tp2 qwen2_moe (q/k/v biases, shared expert)": (2, [*TINY_JOB, "model=qwen2_moe_tiny", "parallel=tp2"]),
    "ep2 glm4_moe (dense first layer, un-gated shared expert)": (2, [*TINY_JOB, "model=glm4_moe_tiny", "parallel=ep2"]),
    "tp2 deepseek_v3 (multi-latent attention)": (2, [*TINY_JOB, "model=deepseek_v3_tiny", "parallel=tp2"]),
    "tp2 olmoe (q/k norms over all heads, split with them)": (2, [*TINY_JOB, "model=olmoe_tiny", "parallel=tp2"]),
    "pp2 bf16 distributed=true allgather": (
        2,
        [
            *TINY_JOB,
            "parallel=pp2",
            "model.dtype=bfloat16",
            "optimizer.distributed=true",
            "model.token_dispatcher=allgather",
        ],
    ),
    "dp2 bf16 optimizer offload": (
        2,
        [*TINY_JOB, "model.dtype=bfloat16", "optimizer.cpu_offload=true", "optimizer.distributed=true"],
    ),
    "dp2 bf16 optimizer offload half, precision-aware": (
        2,
        [
            *TINY_JOB,
            "model.dtype=bfloat16",
            "optimizer.cpu_offload=true",
            "optimizer.offload_fraction=0.5",
            "optimizer.precision_aware=true",
            "optimizer.distributed=true",
        ],
    ),
    "tp2 bf16 kl reference offloaded": (
        2,
        [*TINY_JOB, "parallel=tp2", "model.dtype=bfloat16", "algorithm.kl.coef=0.01", "trainer.reference_offload=true"],
    ),
    "pp2 uneven 2+1 kl reference": (
        2,
        [*TINY_JOB, "model.num_layers=3", "parallel=pp2", "parallel.last_stage_layers=1", "algorithm.kl.coef=0.01"],
    ),
    # two chunks a rank (layers 0, 2 | 1, 3): each chunk its own DDP buffers, the optimizer over both
    "pp2 vpp2 bf16 distributed, kl reference": (
        2,
        [
            *TINY_JOB,
            "model.num_layers=4",
            "parallel=pp2",
            "parallel.vpp=2",
            "trainer.micro_batch_size=64",  # interleaved 1F1B: >= pp micro-batches
            "model.dtype=bfloat16",
            "optimizer.distributed=true",
            "algorithm.kl.coef=0.01",
        ],
    ),
    "pp2 vpp2 fp32": (
        2,
        [*TINY_JOB, "model.num_layers=4", "parallel=pp2", "parallel.vpp=2", "trainer.micro_batch_size=64"],
    ),
}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def built_job_worker(ctx, overrides: list[str], run_dir: str) -> dict:
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.loop.build import build_trainer
    from gspo_megatron.policy.optimizer import allocate_optimizer_state

    composed = compose(overrides)
    cfg = to_train_config(composed)
    trainer = build_trainer(cfg, Path(run_dir), OmegaConf.to_yaml(composed), world_size=ctx.world_size)
    policy = trainer.policy
    try:  # one build per launch (the fixture): ranks are spawned for each job
        chunks = policy.model  # every chunk's DDP (one without virtual pipeline stages)
        distributed = chunks.ddp_config.use_distributed_optimizer
        buffers = [b for ddp in chunks for b in ddp.buffers + ddp.expert_parallel_buffers]
        param_buffers = _tensor_bytes(b.param_data for b in buffers if b.param_data is not None)
        allocate_optimizer_state(policy.optimizer)  # what the first step() allocates
        moments = master = 0
        bf16 = next(chunks.parameters()).dtype == torch.bfloat16
        for part in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
            # the fp32 master of a bf16 weight: the distributed optimizer's main shard (the optimizer's
            # parameter), or with the precision-aware optimizer the host optimizer's fp32 copy of its bf16 shard
            fp32_copies = getattr(part.optimizer, "param_to_fp32_param", {})
            for group in part.optimizer.param_groups:
                for param in group["params"]:
                    state = part.optimizer.state[param]
                    moments += _tensor_bytes([state["exp_avg"], state["exp_avg_sq"]])
                    master += _tensor_bytes([fp32_copies.get(param, param)]) if bf16 else 0
        reference = policy.reference
        host = reference.host_weights.nbytes if reference is not None and reference.host_weights is not None else 0
        granule = 0  # the host bytes of the largest parameter megatron offloads
        for part in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
            hybrid = part.optimizer
            for sub in getattr(hybrid, "cpu_optimizers", []):  # megatron's HybridDeviceOptimizer: its host side
                for group in sub.param_groups:
                    for param in group["params"]:  # the fp32 host copy; its gradient copy is allocated alike
                        # at the first step (hybrid_optimizer.py:_set_sub_optimizer_grads)
                        state = sub.state[param]
                        host += 2 * _tensor_bytes([param]) + _tensor_bytes([state["exp_avg"], state["exp_avg_sq"]])
                        granule = max(granule, 4 * _tensor_bytes([param]))
        return {
            "distributed_optimizer": distributed,
            "dtype": str(next(chunks.parameters()).dtype).removeprefix("torch."),
            "recompute": chunks.config.recompute_granularity == "full",
            "dispatcher": chunks.config.moe_token_dispatcher_type,
            "parameters": param_buffers if distributed else _tensor_bytes(chunks.parameters()),
            "gradients": _tensor_bytes(b.grad_data for b in buffers),
            "param_buffers": param_buffers,
            "optimizer": moments + master,
            "reference": _tensor_bytes(reference.parameters()) if reference else 0,
            "host": host,
            "host_granule": granule,
            "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(with_context_parallel=True),
            "edp": ps.get_expert_data_parallel_rank(),
        }
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def built_jobs(tmp_path_factory):
    return {
        name: run_distributed(built_job_worker, world, overrides, str(tmp_path_factory.mktemp("job")), timeout=600)
        for name, (world, overrides) in JOBS.items()
    }


@pytest.mark.parametrize("name", list(JOBS))
def test_planner_plans_the_job_the_trainer_builds(built_jobs, name):
    """``tools/plan.py <overrides>`` and ``python -m gspo_megatron.train <overrides>`` see one job: every
    option the plan derives equals what the trainer's build made of the same config, and the planned
    state, reference-model and host bytes equal the allocated ones on every rank."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from planning.job import job_from_config
    from planning.planner import memory_of_stage, micro_batches_per_rank

    world, overrides = JOBS[name]
    job = job_from_config(to_train_config(compose(overrides)), world, prompt_tokens=8)
    model, layout, options = job.config.model, job.layout, job.options
    micro_batches = micro_batches_per_rank(layout, options)
    for rank, got in enumerate(built_jobs[name]):
        where = f"{name} rank {rank}"
        assert options.distributed_optimizer == got["distributed_optimizer"], where
        assert options.dtype == got["dtype"], where
        assert options.recompute == got["recompute"], where
        if model.is_moe and (layout.tp > 1 or layout.ep > 1):  # megatron records the dispatcher it uses
            assert options.dispatcher == got["dispatcher"], where
        row = memory_of_stage(
            model, layout, options, got["pp"], micro_batches, dp_rank=got["dp"], expert_dp_rank=got["edp"]
        )
        predicted = state_bytes(
            model,
            layout,
            got["pp"],
            dtype=options.dtype,
            distributed_optimizer=options.distributed_optimizer,
            dp_rank=got["dp"],
            expert_dp_rank=got["edp"],
        )
        for field in ("parameters", "gradients", "param_buffers", "optimizer"):
            assert getattr(predicted, field) == got[field], f"{where}: {field}"
        assert row.reference_weights == got["reference"], where
        # Adam's host side and the offloaded reference; megatron offloads whole parameters until their
        # count reaches the fraction, so a fraction below 1 may take up to one parameter more than planned
        assert 0 <= got["host"] - row.host <= (got["host_granule"] if options.optimizer_offload < 1 else 0), where


# --- the hybrids (issue 62): gated DeltaNet layers beside gated full attention -------------------------------------

# world 2; pp2: a gated DeltaNet layer on the first stage, the other and the full attention on the second
HYBRID_LAYOUTS = {
    "tp2": dict(tp=2, world_size=2),
    "ep2": dict(ep=2, world_size=2),
    "pp2": dict(pp=2, first_stage_layers=1, world_size=2),
}


def hybrid_state_worker(ctx, cfg, layouts: dict) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    out = {}
    for name, kwargs in layouts.items():
        layout = ParallelLayout(**kwargs).validate(cfg)
        apply_cpu_bridges()
        mesh = initialize_parallel(layout, seed=5)
        ranks = {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "edp": ps.get_expert_data_parallel_rank()}
        model = build_model(cfg, layout, params_dtype=torch.float32, layer_spec="portable")
        out[(name, "named")] = [(n, p.numel()) for n, p in model.named_parameters()]
        out[(name, "state")] = dict(_measure_state(layout, cfg, torch.bfloat16, True), **ranks)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def hybrid_measured():
    from gspo_megatron.testing.model_fixtures import tiny_family_config

    cfg = tiny_family_config("qwen3_5_moe_text")
    return cfg, run_distributed(hybrid_state_worker, 2, cfg, HYBRID_LAYOUTS, timeout=600)


def _local_layer(param_name: str, first: int) -> str:
    """A parameter's name as megatron numbers a stage's layers (from 0); the planner numbers them globally."""
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) - first}.", param_name)


@pytest.mark.parametrize("name", list(HYBRID_LAYOUTS))
def test_hybrid_parameters_and_state_bytes_equal_megatron(hybrid_measured, name):
    """The planner's parameter list of a Qwen3.5-MoE stack is megatron's ``named_parameters()`` (names, order and
    sizes; megatron numbers a stage's layers from 0) and its bf16 distributed-optimizer state bytes are exact."""
    from planning.parameters import stage_parameters

    cfg, results = hybrid_measured
    layout = ParallelLayout(**HYBRID_LAYOUTS[name]).validate(cfg)
    for rank, per_rank in enumerate(results):
        got = per_rank[(name, "state")]
        first = layout.stage_layers(cfg.num_layers, got["pp"])[0]
        planned = [(_local_layer(p.name, first), p.numel) for p in stage_parameters(cfg, layout, got["pp"])]
        assert planned == per_rank[(name, "named")], f"{name} rank {rank}"
        predicted = state_bytes(
            cfg,
            layout,
            got["pp"],
            dtype="bfloat16",
            distributed_optimizer=True,
            dp_rank=got["dp"],
            expert_dp_rank=got["edp"],
        )
        for field in ("parameters", "gradients", "param_buffers", "optimizer"):
            assert getattr(predicted, field) == got[field], f"{name} rank {rank}: {field}"

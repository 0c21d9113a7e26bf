"""Plan a layout: per-rank memory, per-step traffic and step time; enumerate and rank layouts.

Design decisions:
- A layout is refused by the trainer's own checks: ``config/validate.py:validate_config`` on a
  ``TrainConfig`` carrying the model, the parallel section and a batch of the planned size (which
  runs ``ParallelLayout.validate`` and the batch-divisibility rules), so the planner can never
  recommend what the trainer would reject.
- Memory of a rank = weights + grad buffers + optimizer state (``parameters.py``, exact for
  megatron-core 0.16) + the frozen reference model's weights when ``algorithm.kl.coef > 0`` (the
  stage's parameters in the model dtype, no buffers: ``policy/reference.py``) + the larger of
  the training activations and a forward-only pass (old log-probs, reference log-probs: one layer's
  activations and the logits at a time). 1F1B keeps up to ``pp - stage`` micro-batches in flight on
  a stage, so stage 0 usually peaks. R3's replayed experts are int64 [T_sp, k] per MoE layer and
  micro-batch, held for the whole step.
- Off the device (host memory, counted per node: ``Plan.host_per_node`` against ``GPUSpec.usable_host_bytes``):
  Adam's offloaded part (``optimizer.cpu_offload``: megatron's HybridDeviceOptimizer keeps, per
  parameter it steps on the host, an fp32 copy, its fp32 gradient copy and the two moments, 16 bytes,
  ``optimizer/cpu_offloading/hybrid_optimizer.py``) and the reference's weights with
  ``trainer.reference_offload`` (which come to the device only for the reference pass:
  ``policy/host_weights.py``). A node holds ``gpus_per_node`` ranks, each counted at the worst rank's bytes.
- The driver (global rank 0, stage 0) also holds the weight sync's bucket and the tensor being
  gathered after the update (``comm.py``): checked against the same capacity.
- The worst stage's numbers are reported (ranks of one stage are alike up to the expert-dp shard).
- The whole RL step per rank -- rollout (the embedded engine on the driver), old and reference
  log-probs, update, weight sync, and what lives across them -- is ``rl_step_memory.py``
  (``Plan.rl_memory`` per stage, ``Plan.driver_memory``); ``MemoryRow`` stays the training ranks' view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.policy.routing.replay_strategy import needs_engine_routing, replays
from planning.activations import FP32, MicroBatchShape, activation_bytes
from planning.comm import Traffic, WeightSyncPlan, step_traffic, weight_sync_plan
from planning.hardware import GPUSpec
from planning.parameters import (
    DTYPE_BYTES,
    StateBytes,
    StateWidths,
    stage_layers,
    stage_parameters,
    state_bytes,
)
from planning.pipeline import in_flight_factor
from planning.rl_step_memory import EmbeddedEngineShape, RLStepMemory, rl_step_memory
from planning.step_time import (
    RLStepTime,
    RolloutShape,
    StepTime,
    rl_step_time,
    rollout_seconds,
    step_time,
)

GiB = 2**30


@dataclass(frozen=True)
class PlanOptions:
    seq_len: int = 8192  # padded tokens per sequence (prompt + response)
    micro_batch_tokens: int = 8192  # tokens per micro-batch per data-parallel rank
    global_batch_tokens: int = 2**20  # tokens per optimizer step (one mini-batch)
    group_size: int = 8  # responses per prompt (the trainer's batch rules use it)
    dtype: str = "bfloat16"
    distributed_optimizer: bool = True
    optimizer_offload: float = 0.0  # fraction of the Adam state stepped in host memory (optimizer.cpu_offload)
    precision_aware: bool = False  # optimizer.precision_aware: the optimizer holds the fp32 master weights
    state_widths: StateWidths = StateWidths()  # optimizer.main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype
    recompute: bool = False
    routing_replay: str = "none"  # none | old_policy | rollout (R3 keeps the engine's experts)
    dispatcher: str = "alltoall"  # model.token_dispatcher (the trainer's default: alltoall)
    layer_spec: str = "te"  # te on GPU; portable is what the CPU build uses (and what is measured)
    sync_bucket_bytes: int = 512 * 2**20  # rollout.sglang.weight_bucket_bytes
    sync_senders: str = "per_stage"  # rollout.sglang.weight_senders
    reference_model: bool = False  # algorithm.kl.coef > 0: a frozen copy of the policy's weights
    reference_offload: bool = False  # trainer.reference_offload: its weights on the device only for its pass
    old_log_prob_pass: bool = True  # trainer.old_log_probs=trainer: a forward pass before the updates
    updates_per_rollout: int = 1  # trainer.updates_per_rollout: optimizer steps per RL step
    rollout: RolloutShape | None = None  # the generation phase; None: not planned (0 s)
    async_rollout: bool = False  # rollout.async_rollout: generation beside training (separate GPUs only)
    expert_imbalance: float = 1.0  # busiest EP rank's expert rows / the balanced share (calibrate.py)
    embedded_engine: EmbeddedEngineShape | None = None  # rollout.engine=embedded: in the driver's process
    # rollout.placement=colocated with SGLang: the share of each GPU the engine holds while it is resumed
    colocated_engine_fraction: float | None = None

    @property
    def micro(self) -> MicroBatchShape:
        return MicroBatchShape(self.micro_batch_tokens // self.seq_len, self.seq_len)


@dataclass
class MemoryRow:
    state: StateBytes
    activations: int
    loss_head: int
    old_log_prob_pass: int
    routing_replay: int
    optimizer_offloaded: float = 0.0  # the fraction of Adam stepped in host memory (optimizer.cpu_offload)
    precision_aware: bool = False  # optimizer.precision_aware: no fp32 main shards in the distributed optimizer
    reference_weights: int = 0  # the frozen KL reference's weights (algorithm.kl.coef > 0)
    reference_offloaded: bool = False  # trainer.reference_offload: on the device only during its pass

    @property
    def resident(self) -> int:
        """Bytes held for the whole run: model state (less what of the optimizer is in host memory) + the
        reference (unless it lives in host memory between its passes)."""
        reference = 0 if self.reference_offloaded else self.reference_weights
        return self.state.total - self.optimizer_off_device + reference

    @property
    def reference_pass(self) -> int:
        """The reference pass's bytes on top of the resident ones: its forward-only activations, and its
        weights when they come in from host memory for it."""
        return self.old_log_prob_pass + (self.reference_weights if self.reference_offloaded else 0)

    @property
    def host(self) -> int:
        """Host bytes of this rank (module docstring): 16 per parameter Adam steps on the host (the
        optimizer's 12 per owned parameter, scaled; with or without the precision-aware optimizer, whose
        host copies are made in fp32 from its bf16 shards) + the offloaded reference's weights."""
        adam = round(self.state.optimizer * 16 / 12 * self.optimizer_offloaded)
        return adam + (self.reference_weights if self.reference_offloaded else 0)

    @property
    def optimizer_off_device(self) -> int:
        """Optimizer bytes that leave the device (of the 12 per owned parameter: fp32 master + two moments;
        offload needs bf16 weights, config/validate.py). megatron's host optimizer steps host copies of
        what the distributed optimizer hands it: its fp32 main shards, which stay on the device too (8 of
        the 12 bytes leave), or with the precision-aware optimizer the bf16 shards themselves, so that
        the fp32 master exists only in host memory (all 12 leave); either scaled by the offload fraction."""
        share = 1.0 if self.precision_aware else 2 / 3
        return round(self.state.optimizer * share * self.optimizer_offloaded)

    @property
    def total(self) -> int:
        """GPU bytes at the step's peak."""
        train = self.activations + self.loss_head
        return self.resident + max(train, self.old_log_prob_pass, self.reference_pass) + self.routing_replay


@dataclass
class Plan:
    layout: ParallelLayout
    micro_batches: int
    memory: MemoryRow  # the worst stage
    worst_stage: int
    traffic: Traffic
    time: StepTime
    sync: WeightSyncPlan
    fits: bool
    problems: list[str] = field(default_factory=list)
    rl: RLStepTime | None = None
    rollout_gpus: int = 0  # separate engine GPUs (0: colocated with the trainer, or not planned)
    capacity: float = 0.0  # bytes the counted tensors may use on one GPU
    tied: bool = False  # within the time band of the fastest fitting layout (rank_layouts)
    rollout_planned: bool = False
    rl_memory: list[RLStepMemory] = field(default_factory=list)  # the whole RL step: each stage's ranks
    driver_memory: RLStepMemory | None = None  # ... and the driver (global rank 0, stage 0)
    host_per_node: int = 0  # host bytes the trainer puts in one node's memory (module docstring)
    host_capacity: float = 0.0  # host bytes per node the counted tensors may use

    @property
    def rl_peak(self) -> RLStepMemory | None:
        """The rank whose whole RL step peaks highest (``rl_step_memory.py``)."""
        ranks = self.rl_memory + ([self.driver_memory] if self.driver_memory is not None else [])
        return max(ranks, key=lambda m: m.peak) if ranks else None

    @property
    def peak_bytes(self) -> int:
        """The whole RL step's peak on its highest rank (what ``fits`` compares with the capacity)."""
        peak = self.rl_peak
        return peak.peak if peak is not None else self.memory.total

    @property
    def headroom(self) -> float:
        return self.capacity - self.peak_bytes

    @property
    def total_gpus(self) -> int:
        return self.layout.world_size + self.rollout_gpus


class PlanError(ValueError):
    """A layout the trainer would refuse, or a batch that does not split over it."""


def check_with_trainer_rules(model: MoEModelConfig, layout: ParallelLayout, options: PlanOptions) -> None:
    """Run the trainer's validation on a config of this model, layout and batch size."""
    from gspo_megatron.config.schema import TrainConfig
    from gspo_megatron.config.validate import validate_config
    from gspo_megatron.policy.config import ModelSection, ParallelSection, TrainerDtype
    from gspo_megatron.policy.routing.replay import ReplayMode
    from gspo_megatron.rollout.config import RolloutEngineName

    sequences = options.global_batch_tokens // options.seq_len
    if sequences % options.group_size:
        raise PlanError(f"{sequences} sequences per step do not form groups of {options.group_size}")
    cfg = TrainConfig()
    cfg.model = ModelSection(**model.to_dict(), dtype=TrainerDtype(options.dtype))
    cfg.parallel = ParallelSection.from_layout(layout)
    cfg.rollout.group_size = options.group_size
    cfg.trainer.prompts_per_step = sequences // options.group_size
    cfg.trainer.updates_per_rollout = 1
    cfg.trainer.micro_batch_size = max(1, options.micro_batch_tokens // options.seq_len)
    cfg.trainer.recompute_activations = options.recompute
    cfg.routing.replay = ReplayMode(options.routing_replay)
    if needs_engine_routing(options.routing_replay):
        cfg.rollout.engine = RolloutEngineName.sglang
        cfg.rollout.sglang.model_path = "<the checkpoint>"  # not read by the plan; the trainer needs one
        cfg.rollout.sglang.enable_return_routed_experts = True
    try:
        validate_config(cfg, layout.world_size)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc


def micro_batches_per_rank(layout: ParallelLayout, options: PlanOptions) -> int:
    """ceil(rows per rank / rows per micro-batch): the trainer's last micro-batch may be smaller."""
    if options.micro_batch_tokens % options.seq_len:
        raise PlanError(
            f"micro_batch_tokens={options.micro_batch_tokens} is not a multiple of seq_len={options.seq_len}"
        )
    per_rank = options.global_batch_tokens // layout.dp
    if per_rank == 0 or options.global_batch_tokens % layout.dp:
        raise PlanError(f"{options.global_batch_tokens} tokens per step do not split over dp={layout.dp}")
    return -(-per_rank // options.micro_batch_tokens)


def memory_of_stage(
    model: MoEModelConfig,
    layout: ParallelLayout,
    options: PlanOptions,
    pp_rank: int,
    micro_batches: int,
    *,
    dp_rank: int = 0,
    expert_dp_rank: int = 0,
) -> MemoryRow:
    """``dp_rank``/``expert_dp_rank``: whose shard of the distributed optimizer (ranks differ by its padding)."""
    width = DTYPE_BYTES[options.dtype]
    state = state_bytes(
        model,
        layout,
        pp_rank,
        dtype=options.dtype,
        distributed_optimizer=options.distributed_optimizer,
        dp_rank=dp_rank,
        expert_dp_rank=expert_dp_rank,
        widths=options.state_widths,
    )
    act = activation_bytes(
        model,
        layout,
        options.micro,
        pp_rank,
        width=width,
        spec=options.layer_spec,
        imbalance=options.expert_imbalance,
    )
    in_flight = min(layout.pp - pp_rank, micro_batches) * in_flight_factor(layout)
    layers = act.total(options.recompute) - act.loss_head
    tokens = options.micro.tokens / layout.cp
    sp_tokens = tokens / layout.tp if layout.use_sequence_parallel else tokens
    logits = int(tokens * model.vocab_size / layout.tp * FP32)
    forward_only = options.old_log_prob_pass or options.reference_model
    old_pass = logits + (max(act.per_layer) if act.per_layer else 0) if forward_only else 0
    params = stage_parameters(model, layout, pp_rank)
    reference = sum(p.numel for p in params) * width if options.reference_model else 0
    replay = 0
    if replays(options.routing_replay) and model.is_moe:
        moe = [i for i in stage_layers(model, layout, pp_rank) if i not in set(model.dense_layers)]
        replay = int(micro_batches * len(moe) * sp_tokens * model.top_k * 8)
    return MemoryRow(
        state,
        int(layers * in_flight),
        act.loss_head,
        old_pass,
        replay,
        optimizer_offloaded=options.optimizer_offload,
        precision_aware=options.precision_aware,
        reference_weights=reference,
        reference_offloaded=options.reference_offload and options.reference_model,
    )


def plan_layout(
    model: MoEModelConfig, layout: ParallelLayout, options: PlanOptions, gpu: GPUSpec, *, validated: bool = False
) -> Plan:
    """Everything the planner predicts for one layout; raises PlanError if the trainer would refuse it.
    ``validated``: the options come from a config the trainer's validation already accepted (``job.py``)."""
    if not validated:
        check_with_trainer_rules(model, layout, options)
    micro_batches = micro_batches_per_rank(layout, options)
    rows = [memory_of_stage(model, layout, options, r, micro_batches) for r in range(layout.pp)]
    worst = max(range(layout.pp), key=lambda r: rows[r].total)
    width = DTYPE_BYTES[options.dtype]
    traffic = [
        step_traffic(
            model,
            layout,
            options.micro,
            micro_batches,
            pp_rank=r,
            width=width,
            dispatcher=options.dispatcher,
            distributed_optimizer=options.distributed_optimizer,
            dtype=options.dtype,
        )
        for r in range(layout.pp)
    ]
    time = step_time(
        model, layout, options.micro, micro_batches, traffic, gpu, options.recompute, options.expert_imbalance
    )
    link = gpu.ib_bandwidth * gpu.link_efficiency
    sync = weight_sync_plan(model, options.sync_bucket_bytes, link, width, layout, options.sync_senders)
    engine = int((options.colocated_engine_fraction or 0.0) * gpu.memory_bytes)  # a colocated SGLang's share
    rl_memory = [
        rl_step_memory(
            model, layout, options, row, driver=False, pp_rank=r, micro_batches=micro_batches, colocated_engine=engine
        )
        for r, row in enumerate(rows)
    ]
    driver_memory = rl_step_memory(
        model, layout, options, rows[0], driver=True, micro_batches=micro_batches, colocated_engine=engine
    )
    # fits: the whole RL step's peak on its highest rank (the driver's weight-sync bucket included), and
    # the host memory of a node
    highest = max([*rl_memory, driver_memory], key=lambda m: m.peak)
    host_per_node = max(row.host for row in rows) * min(gpu.gpus_per_node, layout.world_size)
    problems = []
    if highest.peak > gpu.usable_memory_bytes:
        problems.append(
            f"needs {highest.peak / GiB:.1f} GiB at its {highest.peak_phase} phase "
            f"> {gpu.usable_memory_bytes / GiB:.1f} GiB"
            + ("; lower the sync bucket" if highest.peak_phase == "weight_sync" else "")
        )
    if host_per_node > gpu.usable_host_bytes:
        problems.append(
            f"needs {host_per_node / GiB:.0f} GiB of host memory per node > {gpu.usable_host_bytes / GiB:.0f} GiB "
            "(optimizer.offload_fraction, trainer.reference_offload)"
        )
    fits = not problems
    offloaded_reference = [row.reference_weights for row in rows if row.reference_offloaded]
    rollout = options.rollout
    rollout_s = rollout_seconds(model, rollout, gpu, width=2) if rollout else 0.0
    separate = rollout is not None and not rollout.colocated
    rl = rl_step_time(
        time,
        rollout_s,
        sync.seconds,
        updates_per_rollout=options.updates_per_rollout,
        old_log_prob_pass=options.old_log_prob_pass,
        reference_model=options.reference_model,
        overlapped=separate and options.async_rollout,
        reference_in_s=max(offloaded_reference, default=0) / (gpu.pcie_bandwidth * gpu.link_efficiency),
    )
    return Plan(
        layout,
        micro_batches,
        rows[worst],
        worst,
        traffic[worst],
        time,
        sync,
        fits,
        problems,
        rl=rl,
        rollout_gpus=rollout.servers * rollout.engine_tp if rollout is not None and separate else 0,
        capacity=gpu.usable_memory_bytes,
        rollout_planned=rollout is not None,
        rl_memory=rl_memory,
        driver_memory=driver_memory,
        host_per_node=host_per_node,
        host_capacity=gpu.usable_host_bytes,
    )


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def candidate_layouts(model: MoEModelConfig, gpus: int, gpu: GPUSpec, max_cp: int = 2) -> list[ParallelLayout]:
    """Every (tp <= node, pp, ep, etp <= node, cp <= max_cp) layout of ``gpus`` ranks that
    ``ParallelLayout.validate`` accepts for this model. etp != tp only with ep > 1: megatron-core puts
    expert parameters in their own (expert-data-parallel) buffer only under expert parallelism, so
    with ep = 1 an expert sharded differently from the dense layers would have its gradients reduced
    over the dense data-parallel group; not verified on CPU, so not proposed. A pp that does not divide
    the layers is proposed with slime's split (``_pipeline_split``)."""
    out = []
    for tp in _divisors(gpus, gpu.gpus_per_node):
        for cp in _divisors(gpus // tp, max_cp):
            for pp in _divisors(gpus // (tp * cp)):
                experts = model.num_experts if model.is_moe else 1
                for ep in _divisors(experts):
                    for etp in _divisors(gpus, gpu.gpus_per_node):
                        if ep == 1 and etp != tp:  # see the docstring
                            continue
                        layout = ParallelLayout(
                            tp=tp,
                            pp=pp,
                            ep=ep,
                            etp=None if etp == tp else etp,
                            cp=cp,
                            world_size=gpus,
                            last_stage_layers=_pipeline_split(model.num_layers, pp),
                        )
                        try:
                            out.append(layout.validate(model))
                        except ValueError:
                            continue
    return out


def _pipeline_split(num_layers: int, pp: int) -> int | None:
    """The last stage's layers when ``pp`` does not divide ``num_layers``: every other stage takes
    ceil(layers / pp) and the last the rest (slime's Qwen3-235B: 94 layers on pp 4 = 24 + 24 + 24 + 22);
    None for an even split, or when the rest would be empty."""
    if num_layers % pp == 0:
        return None
    rest = num_layers - (pp - 1) * -(-num_layers // pp)
    return rest if rest > 0 else None


def rank_layouts(
    model: MoEModelConfig, gpus: int, options: PlanOptions, gpu: GPUSpec, max_cp: int = 2
) -> tuple[list[Plan], list[Plan]]:
    """Plans of every layout the trainer accepts, ordered by ``order_plans``."""
    plans = []
    for layout in candidate_layouts(model, gpus, gpu, max_cp):
        try:
            plans.append(plan_layout(model, layout, options, gpu))
        except PlanError:
            continue
    return order_plans(plans)


def order_plans(plans: list[Plan]) -> tuple[list[Plan], list[Plan]]:
    """Those that fit, then those that do not (smallest first).

    Fitting plans whose time band (``StepTime.lower_s`` .. ``total_s``) reaches the fastest one's
    upper end are tied with it (marked ``tied``) and come first, most headroom first; the rest
    follow fastest first. Layouts whose step times differ by 1-2% are not told apart by a model
    whose known error is larger."""
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.time.total_s)
    too_big = sorted((p for p in plans if not p.fits), key=lambda p: p.peak_bytes)
    if fitting:
        best = fitting[0].time.total_s
        for plan in fitting:
            plan.tied = plan.time.lower_s <= best
        fitting.sort(key=lambda p: (not p.tied, -p.headroom if p.tied else p.time.total_s))
    return fitting, too_big


def layout_name(layout: ParallelLayout) -> str:
    parts = [f"tp{layout.tp}"]
    if layout.pp > 1:
        parts.append(f"pp{layout.pp}")
    if layout.cp > 1:
        parts.append(f"cp{layout.cp}")
    parts.append(f"ep{layout.ep}")
    if layout.etp is not None and layout.etp != layout.tp:
        parts.append(f"etp{layout.etp}")
    parts.append(f"dp{layout.dp}")
    if layout.vpp > 1:
        parts.append(f"vp{layout.vpp}")
    if layout.first_stage_layers is not None:
        parts.append(f"first{layout.first_stage_layers}")
    if layout.last_stage_layers is not None:
        parts.append(f"last{layout.last_stage_layers}")
    return "_".join(parts)

"""megatron-core's optimizer and LR/weight-decay scheduler, built from the optimizer section.

Design decisions:
- ``optimizer.distributed`` (auto | true | false) is resolved once, by ``config/schema.py:use_distributed_optimizer``,
  and handed to the DDP wrapper (``policy/models/schedule.py:wrap_for_training``); the optimizer reads the
  choice back from that wrapper's ``ddp_config``, so the two can never disagree (megatron's
  distributed optimizer needs the DDP's parameter buffer; with a plain DDP it fails at the first step).
- Same defaults on CPU and GPU: the distributed optimizer runs on CPU/gloo through the bridge in
  ``policy/cpu_bridges.py`` (megatron's CUDA type checks), bf16 (megatron's mixed-precision
  optimizer: fp32 main weights and grads) likewise.
- Gradient clipping is megatron's, by global norm over all model-parallel ranks.
- On resume the config decides the hyperparameters and the checkpoint only the position: megatron's
  scheduler would take lr, min_lr, warmup, decay steps and style from the checkpoint, and the
  optimizer's param groups (max_lr, min_lr, betas, eps) come back from it too, so a change the resume
  check allowed (``checkpoint.resume_allow_changes``) was silently ignored. The scheduler is built with
  ``override_opt_param_scheduler`` (the config's schedule at the checkpoint's step count; a longer
  ``trainer.steps`` stretches the decay over the new total) and the param groups' hyperparameters are
  re-applied from the config after the optimizer state is loaded (``keep_configured_hyperparameters``).
  Unchanged configs load to exactly the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from gspo_megatron.policy.config import DecayStyle
from gspo_megatron.policy.models.builder import transformer_engine_available
from gspo_megatron.policy.parallel.device import compute_device

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from gspo_megatron.policy.config import OptimizerSection


def build_optimizer(
    ddp_model: DistributedDataParallel | list[DistributedDataParallel], section: OptimizerSection, total_updates: int
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """``ddp_model``: one DDP-wrapped model or the list of a rank's chunks (``policy/models/chunks.py``)."""
    from megatron.core.optimizer import get_megatron_optimizer

    chunks = list(ddp_model) if isinstance(ddp_model, list) else [ddp_model]
    if section.cpu_offload:
        _hybrid_optimizer_loads_fp32_parameters()
    optimizer = get_megatron_optimizer(optimizer_config(chunks[0], section), chunks)
    if section.cpu_offload:
        _hybrid_param_groups_as_plain_data(optimizer)
    use_fused_torch_adam(optimizer)
    return optimizer, build_scheduler(optimizer, section, total_updates)


def _hybrid_optimizer_loads_fp32_parameters() -> None:
    """megatron-core's ``HybridDeviceOptimizer._update_fp32_params_by_new_state`` (0.16.1 to 0.19.2), run
    by its post-load hook and after the distributed optimizer loads parameter state, looks up an fp32
    copy for every parameter with state -- but makes copies only of parameters that are not fp32, and
    inside the distributed optimizer (the only place ``optimizer.cpu_offload`` runs) its parameters are
    the fp32 main shards: every checkpoint load raised ``KeyError`` (found by the resume test). An fp32
    parameter is its own fp32 copy; where it was offloaded, its host copy takes its (loaded) value, which
    is what the copy for a bf16 parameter gets. Patched once, on every machine (it is not a CPU matter)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    if getattr(HybridDeviceOptimizer._update_fp32_params_by_new_state, "loads_fp32_parameters", False):
        return

    def update_fp32_params_by_new_state(self: HybridDeviceOptimizer) -> None:
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            fp32_param = self.param_to_fp32_param.get(param)
            if fp32_param is not None:
                fp32_param.data.copy_(state["master_param"])
            elif param in self.gpu_params_map_cpu_copy:
                self.gpu_params_map_cpu_copy[param].data.copy_(param.data)

    update_fp32_params_by_new_state.loads_fp32_parameters = True  # type: ignore[attr-defined]
    HybridDeviceOptimizer._update_fp32_params_by_new_state = update_fp32_params_by_new_state


def _hybrid_param_groups_as_plain_data(optimizer: MegatronOptimizer) -> None:
    """megatron's ``HybridDeviceOptimizer`` passes its sub-optimizer classes as optimizer defaults, so
    torch copies ``cpu_optimizer_cls`` / ``gpu_optimizer_cls`` (classes) into every param group, and
    from there into the checkpoint -- which ``checkpoint_reader.py`` then refuses to load (it takes
    plain data only; a class reference is an import). Nothing reads those two keys from a group (the
    optimizer keeps its classes as attributes and in ``defaults``): each becomes the class's dotted name."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    for hybrid in _inner_optimizers(optimizer, (HybridDeviceOptimizer,)):
        for group in hybrid.param_groups:
            for key, value in group.items():
                if isinstance(value, type):
                    group[key] = f"{value.__module__}.{value.__qualname__}"


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def optimizer_config(ddp_model: DistributedDataParallel, section: OptimizerSection) -> OptimizerConfig:
    """megatron's ``OptimizerConfig`` for the optimizer section (Adam; bf16 as the model is; the
    distributed optimizer exactly when the DDP wrapper was built for it)."""
    from megatron.core.optimizer import OptimizerConfig

    bf16 = ddp_model.config.bf16
    pinned = compute_device().type == "cuda"  # no pinned allocator without a device to copy from
    te = transformer_engine_available()
    check_precision_aware(section, te)
    config = OptimizerConfig(
        optimizer="adam",
        lr=section.lr,
        min_lr=section.min_lr,
        weight_decay=section.weight_decay,
        adam_beta1=section.adam_beta1,
        adam_beta2=section.adam_beta2,
        adam_eps=section.adam_eps,
        clip_grad=section.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer,
        optimizer_cpu_offload=section.cpu_offload,
        optimizer_offload_fraction=section.offload_fraction if section.cpu_offload else 0.0,
        use_precision_aware_optimizer=section.precision_aware and te,
        # float32 unless precision-aware (config/validate.py); TE's FusedAdam holds them
        main_params_dtype=_TORCH_DTYPES[section.main_params_dtype],
        exp_avg_dtype=_TORCH_DTYPES[section.exp_avg_dtype],
        exp_avg_sq_dtype=_TORCH_DTYPES[section.exp_avg_sq_dtype],
        pin_cpu_grads=pinned,  # the host copies of optimizer.cpu_offload
        pin_cpu_params=pinned,
    )
    if section.precision_aware and not te:
        _precision_aware_without_te(config)
    return config


def check_precision_aware(section: OptimizerSection, te: bool) -> None:
    """The precision-aware optimizer needs TransformerEngine's FusedAdam (``te``), or the host optimizer."""
    if section.precision_aware and not (te or section.cpu_offload):
        raise ValueError(
            "optimizer.precision_aware=true without optimizer.cpu_offload needs TransformerEngine's FusedAdam "
            "(megatron's precision-aware optimizer), which this machine lacks (CUDA and the transformer_engine "
            "package); set optimizer.cpu_offload=true (megatron's HybridDeviceOptimizer then holds the fp32 "
            "master weights) or optimizer.precision_aware=false"
        )


def _precision_aware_without_te(config: OptimizerConfig) -> None:
    """``optimizer.precision_aware`` with ``optimizer.cpu_offload`` where TransformerEngine is not installed.

    megatron-core's ``OptimizerConfig.__post_init__`` (0.16.1 to 0.19.2) asks TE's version for every
    precision-aware config (``is_te_min_version("2.1.0")``: TE's ``store_param_remainders``) before it
    returns early for ``optimizer_cpu_offload`` -- the one case that does not use TE (its
    HybridDeviceOptimizer holds the master weights) -- and without TE that comparison raises
    ``TypeError`` (None >= Version). The config is built without the flag and given what
    ``__post_init__`` would set: the flag, ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` (True
    whenever ``optimizer_cpu_offload``) and ``store_param_remainders=False`` (TE below 2.1: none).
    """
    assert config.optimizer_cpu_offload and config.use_distributed_optimizer, "config/validate.py refuses others"
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = False


def _inner_optimizers(
    optimizer: MegatronOptimizer, kind: tuple[type[torch.optim.Optimizer], ...]
) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers of ``kind`` inside megatron's optimizer (each part of a chained one)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, kind):
            yield inner


def use_fused_torch_adam(optimizer: MegatronOptimizer) -> None:
    """Switch megatron's torch Adam fallback to torch's fused kernel.

    Without TransformerEngine or Apex, megatron builds ``torch.optim.AdamW`` with torch's defaults,
    which on CPU tensors is the per-tensor Python loop (``_single_tensor_adam``: ~12 kernel calls per
    parameter). The fused kernel (CPU and CUDA) does the same update in one pass per tensor: 3x faster
    on a 7.9M-parameter MoE here, and equal to the loop within float rounding (one ulp). TE/Apex
    FusedAdam, where megatron found one, is left as it is. The flag lives in the param groups, so it
    is saved with the optimizer state and a resumed run steps with the same kernel.
    """
    for inner in _inner_optimizers(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        for group in inner.param_groups:
            group["foreach"], group["fused"] = False, True


def allocate_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Give a fresh optimizer's torch Adam its state (zero moments, step 0) before a checkpoint loads.

    megatron's distributed optimizer, with torch's Adam (no TE/Apex), reads the Adam ``step`` of its
    existing state while it builds the sharded state dict to load into
    (``DistributedOptimizer.state_dict``: ``assert len(steps) == 1``), and a fresh optimizer has none.
    This allocates what the first ``step()`` would (megatron's ``init_state_fn`` plus ``step``); the
    load then overwrites every value, the step included. A no-op for state that exists. With
    ``optimizer.cpu_offload`` the Adams are the sub-optimizers of megatron's ``HybridDeviceOptimizer``
    (host and device), whose state it then gathers under its own parameters, as its step does
    (megatron's alternative, ``dummy_step``, steps with random gradients).
    """
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    for inner in _inner_optimizers(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        _allocate_adam_state(inner)
    for hybrid in _inner_optimizers(optimizer, (HybridDeviceOptimizer,)):
        assert isinstance(hybrid, HybridDeviceOptimizer)
        if not hybrid.state:
            for sub in hybrid.sub_optimizers:
                _allocate_adam_state(sub)
            hybrid._sync_sub_optimizers_state_to_hdo()


def _allocate_adam_state(inner: torch.optim.Optimizer) -> None:
    for group in inner.param_groups:
        for param in group["params"]:
            if not inner.state[param]:
                inner.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param),
                    "exp_avg_sq": torch.zeros_like(param),
                }


def restore_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Give every parameter's Adam ``step`` after a load its checkpoint's value, in a tensor of its own.

    megatron's distributed optimizer without TE/Apex keeps the Adam step count in its param groups
    (``DistributedOptimizer.state_dict``), and its load leaves two faults in torch's per-parameter
    ``step``: ``load_state_dict`` puts one tensor into every parameter's state, and the parameter-state
    load that follows (``_set_main_param_and_optimizer_states``) copies into it the template's step --
    the 0 of the state allocated before the load (``allocate_optimizer_state``), since megatron does
    not shard the step. torch's Adam then starts again at step 1 and adds 1 to the shared tensor once
    per parameter, so the bias corrections ``1 - beta^t`` of every update after a resume are wrong.
    The loaded param group's ``step`` is the checkpoint's count; an optimizer whose groups hold none
    (the plain one loads torch's own per-parameter state) keeps its values, each in its own tensor.
    """
    for inner in _inner_optimizers(optimizer, (torch.optim.Optimizer,)):
        for group in inner.param_groups:
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if torch.is_tensor(step):
                    value = torch.tensor(float(group["step"])) if "step" in group else step
                    inner.state[param]["step"] = value.to(dtype=step.dtype, device=step.device).clone()


def build_scheduler(
    optimizer: MegatronOptimizer, section: OptimizerSection, total_updates: int
) -> OptimizerParamScheduler:
    """megatron's LR/weight-decay scheduler. Its ``state_dict`` goes into the checkpoint's trainer state,
    which is loaded with ``weights_only=True``: the decay style is handed over as a plain string, not as
    the ``DecayStyle`` enum (which the unpickler would refuse on resume)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if section.decay_style not in tuple(DecayStyle):
        raise ValueError(f"optimizer.decay_style={section.decay_style!r} is unknown; valid: {', '.join(DecayStyle)}")
    decay_style = str(DecayStyle(section.decay_style))  # str(): plain str, not the enum
    warmup = min(section.warmup_steps, max(total_updates - 1, 0))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else section.lr,
        max_lr=section.lr,
        min_lr=section.min_lr if decay_style != DecayStyle.constant else section.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_updates, warmup + 1),
        lr_decay_style=decay_style,
        start_wd=section.weight_decay,
        end_wd=section.weight_decay,
        wd_incr_steps=max(total_updates, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,  # resume: the config's schedule, the checkpoint's step count
    )


@contextmanager
def keep_configured_hyperparameters(optimizer: MegatronOptimizer) -> Iterator[None]:
    """Around loading optimizer state: the param groups keep the config's hyperparameters (max_lr,
    min_lr, betas, eps, ...) and take only the moments and step counts from the checkpoint."""
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    yield
    groups = optimizer.param_groups
    if len(groups) != len(configured):
        raise RuntimeError(f"the checkpoint's optimizer has {len(groups)} param groups, the model {len(configured)}")
    for group, values in zip(groups, configured, strict=True):
        group.update(values)


def restore_schedule(scheduler: OptimizerParamScheduler, saved: dict, log: Callable[[str], None] | None = None) -> None:
    """The checkpoint's step count on the config's schedule; ``log`` gets a line per changed setting."""
    changed = {
        name: (saved.get(name), getattr(scheduler, name))
        for name in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
        if name in saved and saved[name] != getattr(scheduler, name)
    }
    scheduler.load_state_dict(saved)
    if log is not None:
        for name, (old, new) in changed.items():
            log(f"[gspo] resume: schedule {name} {old} -> {new} (from the config)")

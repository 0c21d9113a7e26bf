"""Build the policy on every rank: process groups, model chunks, weights, the KL reference, DDP, optimizer.

Weights: from a local HF checkpoint when ``model.hf_checkpoint`` is set, else a seeded random init that
is identical for any layout (drawn in HF names, then sharded on load). The CPU bridges are applied
before anything of megatron-core runs (``policy/cpu_bridges.py:apply_cpu_bridges``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gspo_megatron.policy.config import PolicySettings, use_distributed_optimizer
from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
from gspo_megatron.policy.models.builder import build_model_chunks
from gspo_megatron.policy.models.chunks import ModelChunks
from gspo_megatron.policy.models.conversion import hf_shapes, load_hf_weights
from gspo_megatron.policy.models.schedule import wrap_for_training
from gspo_megatron.policy.models.weight_sources import SafetensorsSource
from gspo_megatron.policy.optimizer import build_optimizer
from gspo_megatron.policy.parallel.mesh import initialize_parallel
from gspo_megatron.policy.policy import Policy
from gspo_megatron.policy.reference import ReferenceModel
from gspo_megatron.policy.routing.replay import RoutingReplay

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from gspo_megatron.policy.config import ModelSection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_policy(settings: PolicySettings, world_size: int) -> Policy:
    """The policy of this rank (collective: every rank builds its share of the same layout)."""
    model_cfg = settings.model
    layout = settings.parallel.layout(world_size).validate(model_cfg)
    bridges = apply_cpu_bridges()  # every process-wide patch, before the process groups form
    mesh = initialize_parallel(layout, seed=settings.seed, timeout_s=settings.parallel.timeout_s)
    if mesh.is_driver:
        print(bridges, flush=True)
    dtype = DTYPES[model_cfg.dtype]
    instances_before = RoutingReplay.instance_count()
    chunks = build_model_chunks(
        model_cfg,
        layout,
        params_dtype=dtype,
        layer_spec=model_cfg.layer_spec,
        token_dispatcher=model_cfg.token_dispatcher,
        expert_mlp=model_cfg.expert_mlp,
        recompute=settings.recompute_activations,
    )
    moe_layers = [stage_moe_layers(chunk) for chunk in chunks]  # per chunk, in router build order
    replay = None
    if model_cfg.is_moe:
        replay = RoutingReplay.capture_new_instances(instances_before, [len(layers) for layers in moe_layers])
    source = SafetensorsSource(model_cfg.hf_checkpoint) if model_cfg.hf_checkpoint else random_hf_weights(model_cfg)
    load_hf_weights(chunks, model_cfg, source, mesh)
    reference = None
    if settings.algorithm.kl.coef > 0:  # the frozen reference of the KL term: same layout, its own weights
        reference = ReferenceModel.build(
            model_cfg,
            layout,
            mesh,
            source,
            dtype,
            kl_reference=settings.algorithm.kl.reference,
            temperature=settings.temperature,
            chunk_size=settings.logprob_chunk_size,
            offload=settings.reference_offload,
        )
    distributed = use_distributed_optimizer(settings.optimizer.distributed, layout)
    ddp = ModelChunks(wrap_for_training(chunk, chunk.config, use_distributed_optimizer=distributed) for chunk in chunks)
    optimizer, scheduler = build_optimizer(ddp, settings.optimizer, settings.total_updates)
    return Policy(
        settings,
        mesh,
        ddp,
        optimizer,
        scheduler,
        replay=replay,
        stage_moe_layers=[layer for layers in moe_layers for layer in layers],
        reference=reference,
    )


def random_hf_weights(model_cfg: ModelSection) -> dict[str, torch.Tensor]:
    """Seeded init in HF names: normal(0, init_std) for matrices, ones for norms (any layout alike)."""
    generator = torch.Generator().manual_seed(model_cfg.init_seed)
    weights = {}
    for name, shape in hf_shapes(model_cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * model_cfg.init_std
    return weights


def stage_moe_layers(model_chunk: GPTModel) -> list[int]:
    """Global indices of a model chunk's MoE layers, in the order their routers were built."""
    layers = []
    for layer in model_chunk.decoder.layers:
        if hasattr(layer.mlp, "router"):
            layers.append(layer.layer_number - 1)
    return layers
